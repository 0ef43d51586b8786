"""A locked tower's outputs, computed once per distinct image and caption and reused every epoch
(``finetune.lock_image`` / ``lock_text`` with ``arch: towers``), so a step costs the projections.

Keys are content: an image is the SHA-256 of its bytes (every caption row of one image, and a
re-exported copy, share one feature row), a text is its string (captions and the recaptions the
loss reads). The set covers every exported sample, training and held-out.

Determinism: the distinct keys are sorted and embedded in fixed chunks of ``CHUNK`` rows, in the
tower's eval mode without augmentation, so a feature never depends on the batch size, the batch
it first appeared in, the number of ranks or a resume. With several ranks, chunk k is computed by
rank k % world and the chunks are summed across ranks (each row is non-zero on one rank: exact).

The store: rank 0 keeps what it computed in ``<out_dir>/features/<tower>-<digest>/`` (the digest
covers the tower spec and the preprocessing) as files of (keys, features); a resumed run loads
them instead of recomputing. ``finetune.features_dir`` shares one store between runs (a sweep, a
benchmark): a run computes only the keys no file holds, so a feature is the one computed the
first time its image or text was seen, in a chunk with that run's other new keys (float sums
may differ in the last bits from a chunk of other neighbours; a run's own resume is exact). The
evaluation set (``finetune.eval_data``) goes through the same store (``locked_eval``).

What is not in the store runs through the tower in the step (``model._merge``): CLIP-C's
composites (a new image, a new "A and B" caption). Augmented views (``mp_views > 1``) need a
live image tower and are refused with a locked one (``check``).
"""
from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from vlcurate.foundation import storage
from vlcurate.foundation.params import to_json

from .data import ShardSet, load_rgb, read_ahead, to_tensor
from .fields import A

CHUNK = 64          # rows per tower call while precomputing (fixed: it shapes the numerics)
FOLDER = "features"


@dataclass
class FeatureStore:
    """Precomputed features of the locked towers (None: that tower runs live)."""
    image: Optional[torch.Tensor] = None            # [distinct images, d_image]
    image_row: dict = field(default_factory=dict)   # sample id -> row of ``image``
    text: Optional[torch.Tensor] = None             # [distinct texts, d_text]
    text_row: dict = field(default_factory=dict)    # text -> row of ``text``


def check(cfg: Any) -> None:
    if cfg.arch == "towers" and cfg.lock_image and cfg.loss == "mp_nce" and cfg.mp_views > 1:
        raise ValueError(
            f"finetune.mp_views {cfg.mp_views} with finetune.lock_image: a locked image tower's "
            "features are computed once, without augmentation, so every view would be the same; "
            "set mp_views: 1, or lock_image: false to embed each augmented view")


def texts_read(cfg: Any, meta: dict, caption: str) -> list[str]:
    """The texts of a sample a training or evaluation batch may hold (Composer.texts)."""
    extra = cfg.fff_recaptions if cfg.loss in ("sigmoid", "mp_nce") else 0
    return [caption] + list(meta.get(A.recaptions) or [])[:extra]


def build_store(cfg: Any, model: Any, shards: ShardSet, size: int, mean: tuple, std: tuple,
                tokenize: Callable, device: str, out: Optional[str]) -> FeatureStore:
    """The store of ``model``'s locked towers over every sample of ``shards``."""
    store = FeatureStore()
    if cfg.arch != "towers" or not (cfg.lock_image or cfg.lock_text):
        return store
    ids, hashes, first, texts = scan(cfg, shards)
    root = features_root(cfg, out)
    if cfg.lock_image:
        keys = sorted(first)
        store.image = stored(root, image_key(cfg, size, mean, std), keys, device,
                             lambda ks: model.image_features(pixels(
                                 [shards.sample(first[k]).image for k in ks], size, mean,
                                 std).to(device)))
        at = {k: i for i, k in enumerate(keys)}
        store.image_row = {sid: at[h] for sid, h in zip(ids, hashes)}
    if cfg.lock_text:
        keys = sorted(texts)
        store.text = stored(root, text_key(cfg), keys, device, text_embed(model, tokenize, device))
        store.text_row = {t: i for i, t in enumerate(keys)}
    return store


def image_key(cfg: Any, size: int, mean: tuple, std: tuple) -> tuple:
    return ("image", to_json(cfg.image_tower), size, mean, std)


def text_key(cfg: Any) -> tuple:
    return ("text", to_json(cfg.text_tower))


def text_embed(model: Any, tokenize: Callable, device: str) -> Callable:
    return lambda ks: model.text_features(**{k: v.to(device) for k, v in tokenize(ks).items()})


def locked_eval(cfg: Any, model: Any, images: list, captions: list, size: int, mean: tuple,
                std: tuple, tokenize: Callable, device: str, out: Optional[str]) -> tuple:
    """(image, text) tower features of an evaluation set through the store (None where that
    tower is not locked: it runs live), so a sweep embeds its eval set once."""
    if cfg.arch != "towers":
        return None, None
    root, img, txt = features_root(cfg, out), None, None
    if cfg.lock_image:
        hashes = [hashlib.sha256(b).hexdigest() for b in images]
        blob = dict(zip(hashes, images))
        keys = sorted(blob)
        feats = stored(root, image_key(cfg, size, mean, std), keys, device,
                       lambda ks: model.image_features(pixels([blob[k] for k in ks], size, mean,
                                                              std).to(device)))
        at = {k: i for i, k in enumerate(keys)}
        img = feats[[at[h] for h in hashes]]
    if cfg.lock_text:
        keys = sorted(set(captions))
        feats = stored(root, text_key(cfg), keys, device, text_embed(model, tokenize, device))
        at = {k: i for i, k in enumerate(keys)}
        txt = feats[[at[c] for c in captions]]
    return img, txt


def features_root(cfg: Any, out: Optional[str]) -> Optional[str]:
    """``finetune.features_dir``, else ``<out_dir>/features``; None: kept nowhere."""
    if getattr(cfg, "features_dir", None):
        return str(cfg.features_dir)
    return storage.join(out, FOLDER) if out else None


def scan(cfg: Any, shards: ShardSet) -> tuple[list, list, dict, set]:
    """(sample ids, their image hashes, the first row of each hash, every text) of ``shards``."""
    ids, hashes, first, texts = [], [], {}, set()
    for row, s in zip(shards.rows.tolist(), read_ahead(shards.sample, shards.rows.tolist())):
        h = hashlib.sha256(s.image).hexdigest()
        ids.append(s.key)
        hashes.append(h)
        first.setdefault(h, row)
        texts.update(texts_read(cfg, s.meta, s.caption))
    return ids, hashes, first, texts


def pixels(blobs: list, size: int, mean: tuple, std: tuple) -> torch.Tensor:
    """The eval transform of these images (no augmentation: the features are reused)."""
    ims = read_ahead(lambda b: load_rgb(b, size), blobs)
    return torch.stack([to_tensor(im, size, mean, std, None) for im in ims])


def stored(root: Optional[str], tower: tuple, keys: list, device: str,
           embed: Callable) -> torch.Tensor:
    """``embed`` of ``keys`` (distinct, sorted), through the store under ``root``: a key some
    run kept in ``root/<kind>-<tower digest>/`` is loaded (the first file by name holding it
    wins), the rest are computed in chunks and kept there as one new file (``root`` None: all
    computed, kept nowhere). Every rank reads the files rank 0 listed, so all agree."""
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if root is None:
        return compute(keys, device, embed, world)
    folder = storage.join(root, f"{tower[0]}-{_digest(tower)}")
    names = sorted(i.base_name for i in storage.listdir(folder) if i.base_name.endswith(".pt"))
    if world > 1:
        box = [names]
        dist.broadcast_object_list(box, src=0)
        names = box[0]
    have = _load(folder, names, set(keys))
    missing = [k for k in keys if k not in have]
    if missing:
        new = compute(missing, device, embed, world)
        have.update((k, new[i]) for i, k in enumerate(missing))
        if not world > 1 or dist.get_rank() == 0:
            buf = io.BytesIO()
            torch.save({"keys": missing, "features": new}, buf)
            storage.write_bytes(storage.join(folder, f"{_digest(missing)}.pt"), buf.getvalue())
    return torch.stack([have[k] for k in keys]) if keys else torch.zeros(0, 0)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, default=list).encode()).hexdigest()[:24]


def _load(folder: str, names: list, wanted: set) -> dict:
    """key -> feature row, from the store's files in name order (the first holding a key wins)."""
    have: dict = {}
    for name in names:
        kept = torch.load(io.BytesIO(storage.read_bytes(storage.join(folder, name))),
                          map_location="cpu", weights_only=True)
        for i, k in enumerate(kept["keys"]):
            if k in wanted and k not in have:
                have[k] = kept["features"][i]
    return have


@torch.no_grad()
def compute(keys: list, device: str, embed: Callable, world: int) -> torch.Tensor:
    """``embed`` of ``keys``: chunk k (``CHUNK`` keys) on rank k % world, summed across ranks."""
    import torch.distributed as dist
    n = len(keys)
    rank = dist.get_rank() if world > 1 else 0
    feats: Optional[torch.Tensor] = None
    chunks = [list(range(s, min(n, s + CHUNK))) for s in range(0, n, CHUNK)]
    for k, rows in enumerate(chunks):
        if k % world == rank:
            got = embed([keys[r] for r in rows]).float()
            feats = torch.zeros(n, got.shape[1], device=got.device) if feats is None else feats
            feats[rows[0]:rows[-1] + 1] = got
    if world > 1:
        width = torch.tensor([0 if feats is None else feats.shape[1]], device=device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        feats = torch.zeros(n, int(width), device=device) if feats is None else feats
        dist.all_reduce(feats)
    return torch.zeros(0, 0) if feats is None else feats.cpu()
