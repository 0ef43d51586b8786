"""Random access to exported samples without materialising the index.

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

The shards may live on an object store (``finetune.shards`` as an ``s3://``/``gs://`` URI):
everything goes through ``foundation.storage`` (a ``pyarrow.fs`` filesystem). The index
parquet is read once per process that builds the cache; a sample's members are read by *one*
ranged read (a ``pread`` locally, one HTTP GET with a ``Range`` header on S3/GCS) that spans its
``.jpg``, ``.txt`` and ``.json`` (adjacent in the tar). A whole tar is never downloaded. For
remote shards the mapped cache lives in the local temp folder, keyed by the shards' URI and the
manifest's digest.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

import numpy as np

from vlcurate.foundation import storage
from vlcurate.schemas import F

PARTS = F.SHARD_MEMBERS                                       # jpg, txt, json
_NUM = tuple(f.name for ext in PARTS for f in F.SH_RANGES[ext])
_SID, _SHARD = F.SAMPLE_ID.name, F.SH_NAME.name
MANIFEST, INDEX_DIR = "manifest.json", "index"      # export's files beside the tars
# the columns of the mapped cache file (the trainer's own, not export's): the shard's position in
# the metadata list, the id hash, and the hash-sorted lookup
_CODE, _HASH, _BY_HASH, _SORTED = "code", "id_hash", "by_hash", "hash_sorted"
CACHE_FORMAT = b"2"         # 2: group_hash, caption_index (a new format, a new cache file)
_GROUP = "group_hash"
_CAP = F.SH_CAPTION.name      # the hash of the sample's image group (its own id before groups)


def id_hash(sample_id: str) -> int:
    """A stable 63-bit integer for a sample id (blake2b; the trainer's key for masks and lookup)."""
    return int(hashlib.blake2b(sample_id.encode(), digest_size=8).hexdigest(), 16) >> 1


def _cache_path(shard_uri: str) -> Path:
    """Beside local, writable shards; else (read-only or remote shards) in the temp folder, keyed
    by where the shards are. Named by the manifest's digest: a new export gets a new cache."""
    manifest = storage.read_bytes(storage.join(shard_uri, MANIFEST))
    name = f".index-{hashlib.sha256(manifest + CACHE_FORMAT).hexdigest()[:16]}.arrow"
    local = storage.resolve(shard_uri)[1] if storage.is_local(shard_uri) else None
    if local is not None and os.access(local, os.W_OK):
        return Path(local) / name
    where = hashlib.sha256(f"{CACHE_FORMAT}{local or shard_uri}".encode()).hexdigest()[:8]
    return Path(tempfile.gettempdir()) / f"vlcurate-{where}{name}"


def build(shard_uri: str, dest: Path) -> None:
    """index/*.parquet -> one Arrow IPC file in (shard, offset) order, with the hash lookup."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    fs, path = storage.resolve(storage.join(shard_uri, INDEX_DIR))
    d = ds.dataset(path, format="parquet", filesystem=fs)
    names = d.schema.names          # an export from before image groups or layouts lacks them
    grouped, captioned = F.IMAGE_GROUP.name in names, _CAP in names
    t = d.to_table(columns=[_SID, _SHARD, *_NUM, *([F.IMAGE_GROUP.name] if grouped else []),
                            *([_CAP] if captioned else [])])
    t = t.take(pc.sort_indices(t, [(_SHARD, "ascending"), (F.SH_JPG_OFFSET.name, "ascending")]))
    names = sorted(set(pc.unique(t.column(_SHARD)).to_pylist()))
    codes = pc.index_in(t.column(_SHARD), value_set=pa.array(names)).cast(pa.int32())
    hashes = np.fromiter((id_hash(s) for s in t.column(_SID).to_pylist()), np.uint64, len(t))
    by_hash = np.argsort(hashes, kind="stable")
    groups = np.fromiter((id_hash(g) for g in t.column(F.IMAGE_GROUP.name).to_pylist()),
                         np.uint64, len(t)) if grouped else hashes
    caps = t.column(_CAP).fill_null(-1).cast(pa.int32()).combine_chunks() if captioned else \
        pa.array(np.full(len(t), -1, np.int32))
    out = pa.table({_SID: t.column(_SID).combine_chunks(), _CODE: codes.combine_chunks(),
                    _CAP: caps,
                    **{c: t.column(c).combine_chunks() for c in _NUM},
                    _HASH: hashes, _GROUP: groups, _BY_HASH: by_hash.astype(np.int64),
                    _SORTED: hashes[by_hash]})
    out = out.replace_schema_metadata({"shards": json.dumps(names)})
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    with pa.OSFile(str(tmp), "wb") as fh, pa.ipc.new_file(fh, out.schema) as w:
        w.write_table(out, max_chunksize=max(1, len(out)))
    os.replace(tmp, dest)
    prefix = dest.name.split(".index-")[0]             # "" beside the shards, else vlcurate-<where>
    for stale in dest.parent.glob(f"{prefix}.index-*.arrow"):   # an older export's cache
        if stale != dest:
            stale.unlink(missing_ok=True)


class ShardIndex:
    """The memory-mapped index of one export's shards (see the module docstring)."""

    def __init__(self, shard_uri: str | Path) -> None:
        import pyarrow as pa
        self.uri = str(shard_uri)
        self.fs, self.path = storage.resolve(self.uri)
        path = _cache_path(self.uri)
        if not path.exists():
            build(self.uri, path)
        table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        self.shards: list[str] = json.loads(table.schema.metadata[b"shards"])
        col = (lambda c: table.column(c).chunk(0) if table.num_rows else table.column(c).combine_chunks())
        self.ids = col(_SID)                                    # mapped arrow strings
        self.code = col(_CODE).to_numpy(zero_copy_only=True)
        self.num = {c: col(c).to_numpy(zero_copy_only=True) for c in _NUM}
        self.id_hash = col(_HASH).to_numpy(zero_copy_only=True)
        self.group_hash = col(_GROUP).to_numpy(zero_copy_only=True)
        # export.layout image: the row's caption in its image sample's json (-1: pair layout)
        self.caption = col(_CAP).to_numpy(zero_copy_only=True)
        self._by_hash = col(_BY_HASH).to_numpy(zero_copy_only=True)
        self._sorted = col(_SORTED).to_numpy(zero_copy_only=True)
        self._files: dict[int, Any] = {}
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

    def _file(self, code: int) -> Any:
        """The shard's random-access file (a few kept open): ``read_at`` is a ``pread`` locally
        and a ranged GET on an object store, and safe to call from several threads at once. One
        dropped from the cache closes when its last reader lets go of it."""
        with self._lock:
            f = self._files.get(code)
            if f is None:
                if len(self._files) >= 16:
                    self._files.pop(next(iter(self._files)))
                f = self._files[code] = self.fs.open_input_file(
                    f"{self.path}/{self.shards[code]}")
            return f

    def span(self, row: int, parts: tuple[str, ...] = PARTS) -> tuple[int, int]:
        """(offset, size) of the one byte range that holds the sample's ``parts``."""
        starts = [int(self.num[F.SH_RANGES[ext][0].name][row]) for ext in parts]
        ends = [s + int(self.num[F.SH_RANGES[ext][1].name][row]) for s, ext in zip(starts, parts)]
        return min(starts), max(ends) - min(starts)

    def read(self, row: int, parts: tuple[str, ...] = PARTS) -> dict[str, bytes]:
        """The tar members of one sample, by ONE ranged read of the span that holds them
        (thread-safe: the loader's read-ahead and the evaluation share the open files)."""
        start, size = self.span(row, parts)
        blob = self._file(int(self.code[row])).read_at(size, start)
        out = {}
        for ext in parts:
            off = int(self.num[F.SH_RANGES[ext][0].name][row]) - start
            out[ext] = blob[off:off + int(self.num[F.SH_RANGES[ext][1].name][row])]
        return out

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()
