"""The trainer's data: a deterministic WebDataset stream over the exported shards, random access
to any exported sample, and the batch composition of the papers.

HELIP (Alg. 3) needs each seed's hard pairs *in the same batch*, but shards are streamed. Choice:
the trainer has random access. Export writes ``shards/index/*.parquet`` (each sample's byte
offsets inside its tar), so for a seed the composer reads its p hard pairs straight from the
tars (one ``pread`` each). The shards stay plain open_clip shards, nothing is duplicated, and
any subset of seeds can draw any of its k mined pairs; hard pairs the export dropped are skipped.

Determinism: the stream order (shard order, shuffle buffer, the split across ranks) and every
random choice of a step (seeds, hard pairs, composites, crops) come from RNGs seeded by
(seed, epoch, step, rank), so a resumed run sees exactly the batches an uninterrupted one does.
"""
from __future__ import annotations

import hashlib
import io
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

import numpy as np
import torch

from .fields import A  # noqa: F401  (re-exported: the annotation names)


@dataclass
class Sample:
    key: str
    image: bytes
    caption: str
    meta: dict = field(default_factory=dict)


def key_int(key: str) -> int:
    """A stable 63-bit integer for a sample id (to build cross-rank masks from ids)."""
    return int(hashlib.blake2b(key.encode(), digest_size=8).hexdigest(), 16) >> 1


class ShardSet:
    """The exported shards: ``manifest.json`` for the list, ``index/`` for random access."""

    def __init__(self, shard_dir: str | Path, names: Optional[list[str]] = None) -> None:
        self.dir = Path(shard_dir)
        man = self.dir / "manifest.json"
        if not man.exists():
            raise FileNotFoundError(f"{self.dir}: no manifest.json; point finetune.shards at the "
                                    "shards folder that `vlcurate run` exported")
        files = json.loads(man.read_text())["files"]
        self.sizes = {f["shard"]: f["samples"] for f in files}
        self.names = names if names is not None else sorted(self.sizes)
        self._index: Optional[dict] = None

    def __len__(self) -> int:
        return sum(self.sizes[n] for n in self.names)

    def split(self, n_eval: int) -> tuple["ShardSet", "ShardSet"]:
        """(train, eval): the last ``n_eval`` shards are held out."""
        if n_eval and len(self.names) <= n_eval:
            raise ValueError(f"{len(self.names)} shards: cannot hold out {n_eval} for evaluation")
        cut = len(self.names) - n_eval
        return ShardSet(self.dir, self.names[:cut]), ShardSet(self.dir, self.names[cut:])

    # --- streaming --------------------------------------------------------------------------
    def _raw(self, names: list[str]) -> Iterator[Sample]:
        import webdataset as wds
        urls = [str(self.dir / n) for n in names]
        # every rank reads every shard and keeps its own samples (see stream): no node splitter
        for key, jpg, txt, meta in wds.WebDataset(urls, shardshuffle=False,
                                                  nodesplitter=_all_shards) \
                .to_tuple("__key__", "jpg", "txt", "json"):
            yield Sample(key, jpg, txt.decode("utf-8"), json.loads(meta))

    def stream(self, *, epoch: int, seed: int, rank: int, world: int, buffer: int = 256,
               skip: int = 0) -> Iterator[Sample]:
        """This rank's samples for ``epoch``: shards in a seeded order, every ``world``-th sample
        (equal counts on every rank), through a seeded shuffle buffer; ``skip`` drops the first
        ones (resume) without decoding anything."""
        names = list(self.names)
        random.Random(f"{seed}/{epoch}").shuffle(names)
        rng = random.Random(f"{seed}/{epoch}/{rank}")
        per_rank = len(self) // world
        mine = (s for i, s in enumerate(self._raw(names)) if i % world == rank and i // world < per_rank)
        buf: list[Sample] = []
        n = 0
        for s in mine:
            buf.append(s)
            if len(buf) < buffer:
                continue
            j = rng.randrange(len(buf))
            buf[j], buf[-1] = buf[-1], buf[j]
            out = buf.pop()
            n += 1
            if n > skip:
                yield out
        rng.shuffle(buf)
        for out in buf:
            n += 1
            if n > skip:
                yield out

    def first_meta(self) -> dict:
        """The ``{key}.json`` of the first sample (every sample of an export has the same keys)."""
        for s in self._raw(self.names[:1]):
            return s.meta
        raise ValueError(f"{self.dir}: the shards hold no sample")

    # --- random access -------------------------------------------------------------------------
    def _load_index(self) -> dict:
        import pyarrow.dataset as ds
        t = ds.dataset(self.dir / "index", format="parquet").to_table()
        cols = {c: t.column(c).to_pylist() for c in t.column_names}
        return {sid: i for i, sid in enumerate(cols["sample_id"])}, cols

    def fetch(self, sample_id: str) -> Optional[Sample]:
        if self._index is None:
            self._index = self._load_index()
        pos, cols = self._index
        i = pos.get(sample_id)
        if i is None:
            return None      # not exported (dropped by the policy)
        parts = {}
        with open(self.dir / cols["shard"][i], "rb") as fh:
            for ext in ("jpg", "txt", "json"):
                fh.seek(cols[f"{ext}_offset"][i])
                parts[ext] = fh.read(cols[f"{ext}_size"][i])
        return Sample(sample_id, parts["jpg"], parts["txt"].decode("utf-8"), json.loads(parts["json"]))


def _all_shards(src: Any) -> Any:
    return src


# --- images ------------------------------------------------------------------------------------
def load_rgb(data: bytes, size: Optional[int] = None) -> Any:
    """Decode; with ``size``, let the JPEG decoder downscale by DCT (1/2, 1/4, 1/8) to the
    smallest scale still >= ``size`` on the short side: several times faster on large photos."""
    from PIL import Image
    im = Image.open(io.BytesIO(data))
    if size and im.format == "JPEG":
        w, h = im.size
        short = min(w, h)
        im.draft("RGB", (max(1, w * size // short), max(1, h * size // short)))
    return im.convert("RGB")


def to_tensor(im: Any, size: int, mean: tuple, std: tuple, rng: Optional[random.Random]) -> torch.Tensor:
    """Train: a seeded random-resized crop (scale 0.8-1) and flip; eval (rng None): resize the
    short side and centre-crop. Then normalise."""
    from PIL import Image
    w, h = im.size
    if rng is None:
        s = size / min(w, h)
        im = im.resize((max(size, round(w * s)), max(size, round(h * s))), Image.BICUBIC)
        w, h = im.size
        left, top = (w - size) // 2, (h - size) // 2
        im = im.crop((left, top, left + size, top + size))
    else:
        area = rng.uniform(0.8, 1.0) * w * h
        ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        cw = int(min(w, round(np.sqrt(area * ratio))))
        ch = int(min(h, round(np.sqrt(area / ratio))))
        left, top = rng.randint(0, w - cw), rng.randint(0, h - ch)
        im = im.crop((left, top, left + cw, top + ch)).resize((size, size), Image.BICUBIC)
        if rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
    # normalise in numpy: tiny torch element-wise ops pay for intra-op thread wake-ups
    x = np.asarray(im, np.float32).transpose(2, 0, 1) / 255.0
    x = (x - np.asarray(mean, np.float32)[:, None, None]) / np.asarray(std, np.float32)[:, None, None]
    return torch.from_numpy(np.ascontiguousarray(x))


LAYOUTS = ("side_by_side", "stacked")


def composite(a: Any, b: Any, size: int, layout: str = "side_by_side") -> Any:
    """CLIP-C: the centre halves of two images joined into one S x S image. CLIP-C (sec. 3) takes
    "the central (S/2 x S) or (S x S/2)" crop of each: ``side_by_side`` puts the two central
    vertical halves (S/2 wide) left and right, ``stacked`` the two central horizontal halves
    (S/2 high) top and bottom. ``a`` fills the left (top) half."""
    from PIL import Image
    if layout not in LAYOUTS:
        raise ValueError(f"CLIP-C layout {layout!r}: expected one of {LAYOUTS}")
    out = Image.new("RGB", (size, size))
    lo, hi = size // 4, size // 4 + size // 2
    for i, im in enumerate((a, b)):
        sq = im.resize((size, size), Image.BICUBIC)
        if layout == "side_by_side":
            out.paste(sq.crop((lo, 0, hi, size)), (i * (size // 2), 0))
        else:
            out.paste(sq.crop((0, lo, size, hi)), (0, i * (size // 2)))
    return out
