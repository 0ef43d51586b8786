"""Duplicate ids: a global step over the whole ingest table.

Two records whose (source, key) collide get the same ``sample_id``; the first in part/row order
is kept and every later one is flagged ``ingest.duplicate_id`` with the position of the first.

The step is hash-partitioned: one task per part writes its ids into buckets by a hash
of the id, then one task per bucket finds the repeats among the ids that hash there. Equal ids
always share a bucket, so the result is ``find_duplicates``' (the naive one-pass reference);
a task holds one part, or one bucket (at most about IDS_PER_BUCKET ids), never the dataset.

Each row also gets its image group (``image_group``, see ``image_groups``): the rows that show
the same image bytes (COCO and Flickr give five captions per image) form one group, which the
per-image stages, dedup and the trainer work by.
"""
from __future__ import annotations

import functools
import zlib
from typing import Any, Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlcurate.foundation import storage

from vlcurate.schemas import F, tables
from vlcurate.schemas import reasons as R
from vlcurate.stages.base import GlobalStage, Resources, reasons_array


def find_duplicates(read: Callable[[int], pa.Table], n_parts: int = 0,
                    order: "list[int] | None" = None) -> dict[int, dict[int, str]]:
    """{part: {row: detail}} for every row whose sample_id appeared earlier (parts in ``order``,
    default 0 .. n_parts - 1)."""
    first: dict[str, tuple[int, int]] = {}
    dups: dict[int, dict[int, str]] = {}
    for part in (order if order is not None else range(n_parts)):
        t = read(part)
        for sid, row in zip(t.column(F.SAMPLE_ID.name).to_pylist(), t.column(F.ROW.name).to_pylist()):
            if sid in first:
                p0, r0 = first[sid]
                dups.setdefault(part, {})[row] = f"same sample_id as part {p0} row {r0}"
            else:
                first[sid] = (part, row)
    return dups


def bucket_of(ids: list[str], n_buckets: int) -> np.ndarray:
    """A stable hash of each id (crc32, the same on every machine), modulo ``n_buckets``."""
    return np.array([zlib.crc32(s.encode("utf-8", "surrogateescape")) % n_buckets for s in ids],
                    np.int64)


def _bucket_uri(scratch: str, bucket: int, part: int) -> str:
    return storage.join(scratch, f"bucket-{bucket:05d}", f"part-{part:05d}.parquet")


def scatter_ids(part: int, read: Callable[[int], pa.Table], scratch: str, n_buckets: int) -> int:
    """Write part ``part``'s (id, part, row) into one file per bucket it has ids in."""
    t = read(part)
    ids = t.column(F.SAMPLE_ID.name).to_pylist()
    b = bucket_of(ids, n_buckets)
    rows = pa.table({F.SAMPLE_ID.name: pa.array(ids, pa.string()),
                     F.PART.name: pa.array(np.full(len(ids), part, np.int64)),
                     F.ROW.name: t.column(F.ROW.name)})
    for bucket in np.unique(b):
        buf = pa.BufferOutputStream()
        pq.write_table(rows.filter(pa.array(b == bucket)), buf)
        storage.write_bytes(_bucket_uri(scratch, int(bucket), part), buf.getvalue().to_pybytes())
    return len(ids)


def bucket_duplicates(bucket: int, scratch: str) -> dict[int, dict[int, str]]:
    """``find_duplicates`` over one bucket's ids (read back in part order: first occurrence
    by part, then row)."""
    files = sorted(i.path for i in storage.list_files(storage.join(scratch, f"bucket-{bucket:05d}")))
    fs, _ = storage.resolve(scratch)
    tables = [pq.read_table(f, filesystem=fs) for f in files]
    if not tables:
        return {}
    t = pa.concat_tables(tables)
    by_part = {p: t.filter(pa.compute.equal(t.column(F.PART.name), p))
               for p in sorted(set(t.column(F.PART.name).to_pylist()))}
    return find_duplicates(lambda i: by_part[i], order=list(by_part))


IDS_PER_BUCKET = 1_000_000   # a bucket task holds about this many ids (~100 MB), whatever N is


def distributed_duplicates(read: Any, n_parts: int, scratch: str,
                           n_buckets: Optional[int] = None) -> dict[int, dict[int, str]]:
    """``find_duplicates``, hash-partitioned over ``read.map``'s tasks: about IDS_PER_BUCKET
    ids a bucket (estimated from part 0), so n_parts x n_buckets small files stay few."""
    if n_buckets is None:
        n_buckets = max(1, -(-n_parts * read(0).num_rows // IDS_PER_BUCKET)) if n_parts else 1
    read.map(functools.partial(scatter_ids, read=read, scratch=scratch, n_buckets=n_buckets),
             list(range(n_parts)))
    dups: dict[int, dict[int, str]] = {}
    for found in read.map(functools.partial(bucket_duplicates, scratch=scratch),
                          list(range(n_buckets))):
        for part, rows in found.items():
            dups.setdefault(part, {}).update(rows)
    storage.delete(scratch)
    return {p: dict(sorted(dups[p].items())) for p in sorted(dups)}


def image_groups(ids: list[str], hashes: list) -> list[str]:
    """Each row's group: its ``image_hash`` (equal bytes, equal hash), else its own sample_id (a
    row without an image is a group of one). Cheap and local to the row: no global step."""
    return [h if h else s for s, h in zip(ids, hashes)]


class IdsStage(GlobalStage):
    name = "ids"
    version = "2"   # writes image_group
    inputs = {"ingest": (F.SAMPLE_ID, F.IMAGE_HASH)}
    output = tables.IDS
    resources = Resources(num_cpus=0.25, batch_size=0)
    wants_position = True
    expected_reject = 0.05    # repeated keys: the key column is not unique
    knobs = {R.DUPLICATE_ID: "source.key_column (the column that names each record)"}

    @classmethod
    def prepare(cls, cfg: Any, read: Callable[[int], pa.Table], n_parts: int, workdir: str) -> Any:
        return distributed_duplicates(read, n_parts, storage.join(read.scratch, "ids"))

    def __call__(self, batch: pa.Table) -> pa.Table:
        dups = self.state or {}
        parts = batch.column(F.PART.name).to_pylist()
        rows = batch.column(F.ROW.name).to_pylist()
        details = [dups.get(p, {}).get(r) for p, r in zip(parts, rows)]
        ids = batch.column(F.SAMPLE_ID.name)
        groups = image_groups(ids.to_pylist(), batch.column(F.IMAGE_HASH.name).to_pylist())
        return pa.table({F.SAMPLE_ID.name: ids, F.IMAGE_GROUP.name: pa.array(groups, pa.string()),
                         F.REASONS.name: reasons_array([[R.DUPLICATE_ID] if d else [] for d in details]),
                         F.REASON_DETAIL.name: pa.array(details, pa.string())},
                        schema=self.output)
