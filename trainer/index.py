"""Random access to exported samples without materialising the index (issue 14).

Export writes ``shards/index/*.parquet``: per sample its shard and the byte offset and size of its
``.jpg``, ``.txt`` and ``.json`` tar members. The first process that opens the shards converts it
once into an uncompressed Arrow IPC file beside them (``.index-<manifest digest>.arrow``, written
atomically; a temp folder when the shards are read-only) and every process then *memory-maps* it:
the columns are numpy views of the mapped file, so the OS pages in what a rank touches and shares
those pages between ranks. Nothing becomes a Python list or dict per sample.

Rows are in (shard, offset) order, so a shard's samples are one contiguous run of rows (the
streaming order). ``sample_id -> row`` is a binary search over the sorted 64-bit id hashes
(``hash_sorted`` / ``by_hash``) and a string compare on the mapped ``sample_id`` column, which
also resolves hash collisions.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Optional

import numpy as np

from vlcurate.schemas import F

PARTS = F.SHARD_MEMBERS                                       # jpg, txt, json
_NUM = tuple(f.name for ext in PARTS for f in F.SH_RANGES[ext])
_SID, _SHARD = F.SAMPLE_ID.name, F.SH_NAME.name


def id_hash(sample_id: str) -> int:
    """A stable 63-bit integer for a sample id (blake2b; the trainer's key for masks and lookup)."""
    return int(hashlib.blake2b(sample_id.encode(), digest_size=8).hexdigest(), 16) >> 1


def _cache_path(shard_dir: Path) -> Path:
    digest = hashlib.sha256((shard_dir / "manifest.json").read_bytes()).hexdigest()[:16]
    name = f".index-{digest}.arrow"
    if os.access(shard_dir, os.W_OK):
        return shard_dir / name
    where = hashlib.sha256(str(shard_dir.resolve()).encode()).hexdigest()[:8]
    return Path(tempfile.gettempdir()) / f"vlcurate-{where}{name}"


def build(shard_dir: Path, dest: Path) -> None:
    """index/*.parquet -> one Arrow IPC file in (shard, offset) order, with the hash lookup."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    t = ds.dataset(shard_dir / "index", format="parquet").to_table()
    t = t.take(pc.sort_indices(t, [(_SHARD, "ascending"), (F.SH_JPG_OFFSET.name, "ascending")]))
    names = sorted(set(pc.unique(t.column(_SHARD)).to_pylist()))
    codes = pc.index_in(t.column(_SHARD), value_set=pa.array(names)).cast(pa.int32())
    hashes = np.fromiter((id_hash(s) for s in t.column(_SID).to_pylist()), np.uint64, len(t))
    by_hash = np.argsort(hashes, kind="stable")
    out = pa.table({_SID: t.column(_SID).combine_chunks(), "code": codes.combine_chunks(),
                    **{c: t.column(c).combine_chunks() for c in _NUM},
                    "id_hash": hashes, "by_hash": by_hash.astype(np.int64),
                    "hash_sorted": hashes[by_hash]})
    out = out.replace_schema_metadata({"shards": json.dumps(names)})
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    with pa.OSFile(str(tmp), "wb") as fh, pa.ipc.new_file(fh, out.schema) as w:
        w.write_table(out, max_chunksize=max(1, len(out)))
    os.replace(tmp, dest)
    for stale in dest.parent.glob(".index-*.arrow"):     # an older export's (another manifest)
        if stale != dest:
            stale.unlink(missing_ok=True)


class ShardIndex:
    """The memory-mapped index of one export's shards (see the module docstring)."""

    def __init__(self, shard_dir: str | Path) -> None:
        import pyarrow as pa
        self.dir = Path(shard_dir)
        path = _cache_path(self.dir)
        if not path.exists():
            build(self.dir, path)
        table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        self.shards: list[str] = json.loads(table.schema.metadata[b"shards"])
        col = (lambda c: table.column(c).chunk(0) if table.num_rows else table.column(c).combine_chunks())
        self.ids = col(_SID)                                    # mapped arrow strings
        self.code = col("code").to_numpy(zero_copy_only=True)
        self.num = {c: col(c).to_numpy(zero_copy_only=True) for c in _NUM}
        self.id_hash = col("id_hash").to_numpy(zero_copy_only=True)
        self._by_hash = col("by_hash").to_numpy(zero_copy_only=True)
        self._sorted = col("hash_sorted").to_numpy(zero_copy_only=True)
        self._fds: dict[int, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.code)

    def row(self, sample_id: str) -> Optional[int]:
        """The row of ``sample_id``, or None when export did not write it."""
        h = np.uint64(id_hash(sample_id))
        j = int(np.searchsorted(self._sorted, h))
        while j < len(self._sorted) and self._sorted[j] == h:
            r = int(self._by_hash[j])
            if self.ids[r].as_py() == sample_id:
                return r
            j += 1
        return None

    def _fd(self, code: int) -> int:
        if code not in self._fds:
            if len(self._fds) >= 16:                           # a few shards open at a time
                os.close(self._fds.pop(next(iter(self._fds))))
            self._fds[code] = os.open(self.dir / self.shards[code], os.O_RDONLY)
        return self._fds[code]

    def read(self, row: int, parts: tuple[str, ...] = PARTS) -> dict[str, bytes]:
        """The tar members of one sample, each by one ``pread`` of its byte range (under a lock:
        the loader thread and the evaluation may share the open files)."""
        with self._lock:
            fd = self._fd(int(self.code[row]))
            return {ext: os.pread(fd, int(self.num[F.SH_RANGES[ext][1].name][row]),
                                  int(self.num[F.SH_RANGES[ext][0].name][row])) for ext in parts}

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
