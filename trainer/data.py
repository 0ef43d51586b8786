"""The trainer's data: a deterministic stream over the exported shards, random access to any
exported sample, and the image helpers of the batch composition. Both read samples by byte range
through export's index, memory-mapped (``index.py``): a rank reads and decodes its own samples
only, and no rank holds the index as Python objects.

HELIP (Alg. 3) needs each seed's hard pairs *in the same batch*, but shards are streamed. Choice:
the trainer has random access. Export writes ``shards/index/*.parquet`` (each sample's byte
offsets inside its tar), so for a seed the composer reads its p hard pairs straight from the
tars (one ranged read each: a ``pread`` locally, a ranged GET on an object store). The shards
stay plain open_clip shards, nothing is duplicated, and any subset of seeds can draw any of its k
mined pairs; hard pairs the export dropped are skipped.

Reads overlap: ``READ_AHEAD`` samples are in flight per rank (the stream's next ones, or a batch's
hard pairs), each one ranged read, so an object store's latency is hidden without reading ahead
by whole shards (memory stays ``READ_AHEAD`` samples) or fetching a byte twice. Order and bytes
do not depend on it.

Determinism: the stream order (shard order, shuffle buffer, the split across ranks) and every
random choice of a step (seeds, hard pairs, composites, crops) come from RNGs seeded by
(seed, epoch, step, rank), so a resumed run sees exactly the batches an uninterrupted one does.
"""
from __future__ import annotations

import json
import random
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

from vlcurate.foundation import storage

from vlcurate.foundation.layout import read_sample
from vlcurate.foundation.pixels import load_rgb, to_tensor  # noqa: F401  (the trainer's transforms)

from .fields import A  # noqa: F401  (re-exported: the annotation names)
from .index import MANIFEST, PARTS, ShardIndex, id_hash

JPG, TXT, JSON = PARTS      # a sample's tar members (schemas.fields.SHARD_MEMBERS)
READ_AHEAD = 32             # sample reads in flight per rank (one ranged GET each on S3/GCS)
_POOL: Optional[ThreadPoolExecutor] = None
_POOL_LOCK = threading.Lock()


@dataclass
class Sample:
    key: str
    image: bytes
    caption: str
    meta: dict = field(default_factory=dict)
    group: int = -1          # the hash of its image group (index.group_hash); -1: none


key_int = id_hash       # a stable 63-bit integer for a sample id (cross-rank masks from ids)


class ShardSet:
    """The exported shards (``manifest.json``), or a subset of their samples (``rows`` of the
    memory-mapped index, in file order), streamed and read through ``index.ShardIndex``."""

    def __init__(self, shard_uri: str | Path, rows: Optional[np.ndarray] = None,
                 index: Optional[ShardIndex] = None) -> None:
        self.uri = str(shard_uri)          # a local path or a URI (s3://, gs://, ...)
        if index is None and not storage.exists(storage.join(self.uri, MANIFEST)):
            raise FileNotFoundError(f"{storage.redact(self.uri)}: no {MANIFEST}; point "
                                    "finetune.shards at the shards folder that `vlcurate run` "
                                    "exported")
        self.index = index or ShardIndex(self.uri)
        self.rows = np.arange(len(self.index)) if rows is None else rows
        self._member: Optional[np.ndarray] = None
        self._runs: Optional[tuple[np.ndarray, np.ndarray]] = None

    def __len__(self) -> int:
        return len(self.rows)

    def split(self, fraction: float, seed: int) -> tuple["ShardSet", "ShardSet"]:
        """(train, eval): a sample is held out when a seeded hash of its *image group* (its
        ``image_group``: every caption of one image) falls in the first ``fraction`` of the
        64-bit range, so no held-out image appears in training. It depends on the group alone,
        never on the shard layout, the order or the other samples (re-exporting with other shard
        sizes keeps it)."""
        if not 0 <= fraction < 1:
            raise ValueError(f"finetune.eval_fraction must be in [0, 1), got {fraction}")
        held = held_out(self.index.group_hash[self.rows], fraction, seed)
        return (ShardSet(self.uri, self.rows[~held], self.index),
                ShardSet(self.uri, self.rows[held], self.index))

    # --- streaming --------------------------------------------------------------------------
    def _shard_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """Where each shard's samples start and end in ``rows`` (rows are in file order)."""
        if self._runs is None:
            codes = self.index.code[self.rows]
            present = np.unique(codes)
            self._runs = (np.searchsorted(codes, present), np.searchsorted(codes, present, "right"))
        return self._runs

    def epoch_order(self, epoch: int, seed: int, start: int = 0,
                    stop: Optional[int] = None) -> np.ndarray:
        """Positions ``start:stop`` of this epoch's order before the shuffle buffer: the shards
        in a seeded order, each shard's samples in file order (contiguous reads). Only the shards
        that overlap the slice are gathered."""
        starts, ends = self._shard_runs()
        order = list(range(len(starts)))
        random.Random(f"{seed}/{epoch}").shuffle(order)
        first = np.concatenate([[0], np.cumsum((ends - starts)[order])]).astype(np.int64)
        stop = len(self) if stop is None else stop
        parts = [self.rows[starts[i] + max(start, first[k]) - first[k]:
                           starts[i] + min(stop, first[k + 1]) - first[k]]
                 for k, i in enumerate(order) if max(start, first[k]) < min(stop, first[k + 1])]
        return np.concatenate(parts) if parts else self.rows[:0]

    def rank_rows(self, epoch: int, seed: int, rank: int, world: int) -> np.ndarray:
        """This rank's rows: slice ``rank`` of ``world`` equal contiguous slices of the epoch
        order. Ranks read disjoint runs of shards; a shard that straddles a slice boundary is
        split at a sample, each rank reading only its own byte ranges. The ``len % world`` samples
        past the last slice sit out this epoch (others the next: the shard order changes)."""
        per_rank = len(self) // world
        return self.epoch_order(epoch, seed, rank * per_rank, (rank + 1) * per_rank)

    def stream(self, *, epoch: int, seed: int, rank: int, world: int, buffer: int = 256,
               skip: int = 0) -> Iterator[Sample]:
        """This rank's samples for ``epoch`` (``rank_rows``) through a seeded shuffle buffer. The
        buffer shuffles row numbers, so ``skip`` (resume) drops the first ones without reading
        anything, and a rank reads and decodes only its own samples."""
        rows = self.rank_rows(epoch, seed, rank, world)
        order = buffered(rows, random.Random(f"{seed}/{epoch}/{rank}"), buffer)
        yield from read_ahead(self.sample, (r for n, r in enumerate(order) if n >= skip))

    def sample(self, row: int) -> Sample:
        """One row: its image, caption and annotations, in either export layout (in the image
        layout, its caption of its image's sample: ``foundation/layout.py``)."""
        parts = self.index.read(row)
        caption, meta = read_sample(parts, int(self.index.caption[row]))
        return Sample(self.index.ids[row].as_py(), parts[JPG], caption, meta,
                      int(self.index.group_hash[row]))

    def group_of(self, sample_id: str) -> Optional[int]:
        """The image-group hash of an exported sample (None: export did not write it)."""
        row = self.index.row(sample_id)
        return None if row is None else int(self.index.group_hash[row])

    def sample_ids(self) -> list[str]:
        """This set's sample ids, in file order (the held-out list, ``heldout.parquet``)."""
        return self.index.ids.take(self.rows).to_pylist() if len(self.rows) else []

    def missing(self) -> dict:
        """The export's count of kept rows lacking each trainer annotation (manifest.json's
        ``missing``; empty for an export from before it was counted)."""
        return json.loads(storage.read_bytes(storage.join(self.uri, MANIFEST))).get("missing") or {}

    def first_meta(self) -> dict:
        """The ``{key}.json`` of the first sample (every sample of an export has the same keys)."""
        if not len(self.index):
            raise ValueError(f"{storage.redact(self.uri)}: the shards hold no sample")
        # its caption and json only: the driver's check reads no image bytes
        return read_sample(self.index.read(0, (TXT, JSON)), int(self.index.caption[0]))[1]

    # --- random access -------------------------------------------------------------------------
    def fetch(self, sample_id: str) -> Optional[Sample]:
        """A sample of this set by id; None when export dropped it or it is not in this set (a
        held-out sample never enters a training batch as a hard pair)."""
        row = self.index.row(sample_id)
        if row is None:
            return None
        if self._member is None:        # built whole before it is shared (fetch_many's threads)
            member = np.zeros(len(self.index), bool)
            member[self.rows] = True
            self._member = member
        return self.sample(row) if self._member[row] else None

    def fetch_many(self, sample_ids: list[str]) -> list[Optional[Sample]]:
        """``fetch`` of each id, the reads overlapping (``read_ahead``), in the given order."""
        return list(read_ahead(self.fetch, sample_ids))


def read_ahead(read: Callable[[Any], Any], items: Iterable[Any],
               depth: int = READ_AHEAD) -> Iterator[Any]:
    """``read(item)`` for each item, in order, with up to ``depth`` reads running at once on a
    shared thread pool (reads are leaves: they never wait on the pool, so sharing it is safe)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="vlcurate-read")
    pending: deque = deque()
    for item in items:
        pending.append(_POOL.submit(read, item))
        if len(pending) >= depth:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def buffered(rows: np.ndarray, rng: random.Random, buffer: int) -> Iterator[int]:
    """A seeded shuffle buffer over row numbers (the WebDataset-style streaming shuffle)."""
    buf: list[int] = []
    for row in (r for i in range(0, len(rows), 1 << 16) for r in rows[i:i + (1 << 16)].tolist()):
        buf.append(row)
        if len(buf) < buffer:
            continue
        j = rng.randrange(len(buf))
        buf[j], buf[-1] = buf[-1], buf[j]
        yield buf.pop()
    rng.shuffle(buf)
    yield from buf


def held_out(hashes: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Seeded membership by hash: splitmix64(id_hash XOR splitmix64(seed)) < fraction * 2^64."""
    if fraction <= 0:
        return np.zeros(len(hashes), bool)
    mixed = _splitmix64(hashes.astype(np.uint64) ^ _splitmix64(np.array([seed], np.uint64))[0])
    return mixed < np.uint64(min(int(fraction * 2.0 ** 64), 2 ** 64 - 1))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


# --- images ------------------------------------------------------------------------------------
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
