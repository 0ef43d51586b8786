"""The vectors a mining stage works on, gathered once by its global step.

``collect`` reads every part's still-kept rows (the runner's ``read``), keeps those with every
embedding present, L2-normalises the vectors in float32 and appends them to raw files in the
stage's ``workdir`` (memory-mapped by every actor, so a node holds one copy in its page cache),
with their sample ids and positions (hpm deletes the vector files once its pass has sorted them:
``drop_vectors``). Rows are in part/row order: global row g of part p is
``starts[p] + i`` for the i-th stored row of p.
"""
from __future__ import annotations

import dataclasses
import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from vlcurate.stages.arrow import list_array
from vlcurate.schemas import F

from .hpm import normalize


def vectors(col: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A fixed_size_list<float32|float16, d> column without nulls -> float32 [n, d]."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    d = arr.type.list_size
    return arr.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, d)


@dataclass(frozen=True)
class StoreMeta:
    dir: str
    n: int
    dims: tuple[tuple[str, int], ...]     # (column, dimension)
    starts: tuple[int, ...]               # first global row of each part
    counts: tuple[int, ...]               # stored rows of each part
    names: tuple[str, ...] = ()           # the columns the reader gave (part 0's)


def collect(read: Callable[[int], pa.Table], n_parts: int, workdir: str,
            columns: Sequence[str], write: bool = True) -> StoreMeta:
    """The rows with every one of ``columns`` present; with ``write``, their vectors too (else
    ids and positions only: positives, which reads hpm's sorted copy through ``Gathered``)."""
    os.makedirs(workdir, exist_ok=True)
    dims: dict[str, int] = {}
    ids, rows, starts, counts, names = [], [], [], [], ()
    n = 0
    with ExitStack() as stack:
        files = {c: stack.enter_context(open(os.path.join(workdir, f"{c}.f32"), "wb"))
                 for c in (columns if write else ())}
        for part in range(n_parts):
            t = read(part)
            names = names or tuple(t.column_names)
            t = _complete(t, columns)
            for c, fh in files.items():
                v = normalize(vectors(t.column(c)))
                if dims.setdefault(c, v.shape[1]) != v.shape[1]:
                    raise ValueError(f"{c}: dimension {v.shape[1]} in part {part}, "
                                     f"{dims[c]} before")
                fh.write(v.tobytes())
            ids.append(t.column(F.SAMPLE_ID.name).combine_chunks().cast(pa.string()))
            rows.append(t.column(F.ROW.name).to_numpy())
            starts.append(n), counts.append(t.num_rows)
            n += t.num_rows
    pq.write_table(pa.table({F.SAMPLE_ID.name: pa.concat_arrays(ids) if ids else
                             pa.array([], pa.string())}), os.path.join(workdir, "ids.parquet"))
    np.save(os.path.join(workdir, "rows.npy"),
            np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, np.int64))
    return StoreMeta(workdir, n, tuple((c, dims.get(c, 0)) for c in files), tuple(starts),
                     tuple(counts), names)


def _complete(t: pa.Table, columns: Sequence[str]) -> pa.Table:
    """The rows of ``t`` with every one of ``columns`` present."""
    missing = [c for c in columns if c not in t.column_names]
    if missing:
        raise ValueError(f"no upstream stage provides {missing}: mining needs them")
    ok = np.ones(t.num_rows, bool)
    for c in columns:
        ok &= t.column(c).is_valid().to_numpy(zero_copy_only=False)
    return t.filter(pa.array(ok))


def drop_vectors(meta: StoreMeta) -> StoreMeta:
    """Delete the collected vector files and return the store without them (ids and positions
    only): for hpm's pass, whose workers read the sorted copy instead, so the vectors are kept
    on disk once."""
    for c, _ in meta.dims:
        os.remove(os.path.join(meta.dir, f"{c}.f32"))
    return dataclasses.replace(meta, dims=())


class Gathered:
    """Rows of a stored [N, d] array through an index map: row g is ``base[at[g]]``. Positives
    reads hpm's vectors (sorted by cluster) so, in its own row order, without a copy; indexing
    (ints, slices, index arrays) gives arrays, ``np.asarray`` gathers every row."""

    def __init__(self, base: np.ndarray, at: np.ndarray) -> None:
        self.base, self.at = base, at
        self.shape, self.dtype = (len(at), base.shape[1]), base.dtype

    def __len__(self) -> int:
        return len(self.at)

    def __getitem__(self, key) -> np.ndarray:
        return self.base[np.asarray(self.at[key])]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.base[np.asarray(self.at)]
        return out if dtype is None else out.astype(dtype, copy=False)

    def ids(self, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` (-1: none, kept) as rows of ``base``."""
        return np.where(idx >= 0, np.asarray(self.at)[np.maximum(idx, 0)], -1)


class Store:
    """An actor's view of the collected rows: memory-mapped vectors, ids and positions."""

    def __init__(self, meta: StoreMeta) -> None:
        self.meta = meta
        self.n = meta.n
        self.vec: dict[str, np.ndarray] = {}
        for c, d in meta.dims:
            path = os.path.join(meta.dir, f"{c}.f32")
            self.vec[c] = (np.memmap(path, np.float32, "r", shape=(meta.n, d)) if meta.n
                           else np.zeros((0, d), np.float32))
        self.ids = pq.read_table(os.path.join(meta.dir, "ids.parquet")).column(0).combine_chunks()
        self.rows = np.load(os.path.join(meta.dir, "rows.npy"))

    def locate(self, parts: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Global row of each (part, row); -1 for a row that was not stored."""
        out = np.full(len(parts), -1, np.int64)
        for p in np.unique(parts):
            sel = np.flatnonzero(parts == p)
            if p >= len(self.meta.starts):
                continue
            s, c = self.meta.starts[p], self.meta.counts[p]
            stored = self.rows[s:s + c]
            pos = np.searchsorted(stored, rows[sel])
            hit = pos < c
            hit[hit] = stored[pos[hit]] == rows[sel][hit]
            out[sel[hit]] = s + pos[hit]
        return out

    def lookup(self, ids: pa.Array) -> np.ndarray:
        """Global row of each sample id; -1 for an id that was not stored; of equal stored ids,
        the first. A hash lookup (pyarrow's index_in): a binary search of the sorted string ids
        was a third of positives' time at 1M rows, its cost per id growing with N."""
        found = pc.index_in(ids.cast(self.ids.type), value_set=self.ids)
        return found.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)

    def id_lists(self, idx: np.ndarray) -> pa.ListArray:
        """[q, k] global rows, -1 padded -> list<string> of sample ids (the -1 left out)."""
        valid = idx >= 0
        return list_array(valid.sum(1), self.ids.take(pa.array(idx[valid])))


__all__ = ["Gathered", "Store", "StoreMeta", "collect", "drop_vectors", "vectors"]
