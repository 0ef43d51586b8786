"""A locked tower's outputs, computed once per distinct image and caption and reused every epoch
(``finetune.lock_image`` / ``lock_text`` with ``arch: towers``), so a step costs the projections.

Keys are content: an image is the SHA-256 of its bytes (every caption row of one image, and a
re-exported copy, share one feature row), a text is its string (captions and the recaptions the
loss reads). The set covers every exported sample, training and held-out.

Determinism: the distinct keys are sorted and embedded in fixed chunks of ``CHUNK`` rows, in the
tower's eval mode without augmentation, so a feature never depends on the batch size, the batch
it first appeared in, the number of ranks or a resume. With several ranks, chunk k is computed by
rank k % world and the chunks are summed across ranks (each row is non-zero on one rank: exact).
Rank 0 keeps the result in ``<out_dir>/features/<digest>.pt`` (the digest covers the tower spec,
the preprocessing and the keys), which a resumed run loads instead of recomputing.

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
    if cfg.lock_image:
        keys = sorted(first)
        store.image = cached(out, ("image", to_json(cfg.image_tower), size, mean, std, keys),
                             len(keys), device, lambda rows: model.image_features(
                                 _pixels(shards, [first[keys[r]] for r in rows], size, mean,
                                         std).to(device)))
        at = {k: i for i, k in enumerate(keys)}
        store.image_row = {sid: at[h] for sid, h in zip(ids, hashes)}
    if cfg.lock_text:
        keys = sorted(texts)
        store.text = cached(out, ("text", to_json(cfg.text_tower), keys), len(keys), device,
                            lambda rows: model.text_features(
                                **{k: v.to(device) for k, v in
                                   tokenize([keys[r] for r in rows]).items()}))
        store.text_row = {t: i for i, t in enumerate(keys)}
    return store


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


def _pixels(shards: ShardSet, rows: list[int], size: int, mean: tuple, std: tuple) -> torch.Tensor:
    """The eval transform of these rows' images (no augmentation: the features are reused)."""
    ims = read_ahead(lambda r: load_rgb(shards.sample(r).image, size), rows)
    return torch.stack([to_tensor(im, size, mean, std, None) for im in ims])


def cached(out: Optional[str], key: tuple, n: int, device: str, embed: Callable) -> torch.Tensor:
    """``embed`` over ``n`` rows in chunks, or the copy a run of the same key kept in ``out``
    (``out`` None: computed, kept nowhere)."""
    import torch.distributed as dist
    digest = hashlib.sha256(json.dumps(key, default=list).encode()).hexdigest()[:24]
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if out is None:
        return compute(n, device, embed, world)
    uri = storage.join(out, FOLDER, f"{key[0]}-{digest}.pt")
    have = torch.tensor([int(storage.exists(uri))])
    if world > 1:                       # every rank decides alike (one may see it written)
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
    if have.item():
        return torch.load(io.BytesIO(storage.read_bytes(uri)), map_location="cpu",
                          weights_only=True)
    feats = compute(n, device, embed, world)
    if not world > 1 or dist.get_rank() == 0:
        buf = io.BytesIO()
        torch.save(feats, buf)
        storage.write_bytes(uri, buf.getvalue())
    return feats


@torch.no_grad()
def compute(n: int, device: str, embed: Callable, world: int) -> torch.Tensor:
    """Chunk k (``CHUNK`` rows of the sorted keys) on rank k % world, summed across ranks."""
    import torch.distributed as dist
    rank = dist.get_rank() if world > 1 else 0
    feats: Optional[torch.Tensor] = None
    chunks = [list(range(s, min(n, s + CHUNK))) for s in range(0, n, CHUNK)]
    for k, rows in enumerate(chunks):
        if k % world == rank:
            got = embed(rows).float()
            feats = torch.zeros(n, got.shape[1], device=got.device) if feats is None else feats
            feats[rows[0]:rows[-1] + 1] = got
    if world > 1:
        width = torch.tensor([0 if feats is None else feats.shape[1]], device=device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        feats = torch.zeros(n, int(width), device=device) if feats is None else feats
        dist.all_reduce(feats)
    return feats.cpu()
