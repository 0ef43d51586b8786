"""A content-addressed cache of per-image results, shared across runs (``run.cache_dir``).

A stage whose result for an image depends only on the image's bytes and a few settings (OCR:
the backend, its version, the downscale size) keys that result by ``image_hash`` inside a
*namespace*: the stage, its cache format and those settings. A later run (a changed CAT
threshold, overlapping data, another dataset) then reads the result instead of recomputing it.

Only results computed image by image may be cached: a hit must equal a recompute byte for byte,
so that the cache changes speed, never output. (Model embeddings are not cached: a batched
forward pass gives last-bit differences with the batch's composition.) Failed images are not
cached; they are tried again.

Layout: ``<cache_dir>/<stage>/<namespace digest>/`` holds ``namespace.json`` (what the digest
stands for) and segments ``seg-<digest>.parquet`` (``image_hash``, ``value`` as JSON), one per
stage call that computed anything, named by their content: two workers writing the same
results write the same object, and a segment is never rewritten. A worker lists the folder and
reads the segments' hash columns once, at its first lookup, into a sorted array (20 bytes per
cached image: a 16-byte hash and its segment's number; one GET per segment); hits read their
segments' values. Nothing is ever renamed, so a bucket works. A cache shared by many runs
grows with every image it has seen: give a new namespace (another cache_dir) when that is
more than a worker should index.
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any, Callable, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from vlcurate.foundation import storage
from vlcurate.schemas import tables as TB

FORMAT = "1"
DEFAULT_DIR = "_cache"          # inside the run directory when run.cache_dir is unset
_SEGMENTS_KEPT = 16             # segments' values held per worker (a small LRU)
_SCHEMA = TB.IMAGE_CACHE
_HASH, _VALUE = _SCHEMA.names


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


class ImageCache:
    """Results keyed by image hash in one namespace; ``encode``/``decode`` turn a result into
    JSON-able values and back (exactly: JSON round-trips floats)."""

    def __init__(self, root: str, stage: str, namespace: dict, encode: Callable[[Any], Any],
                 decode: Callable[[Any], Any], keep: Callable[[Any], bool] = bool) -> None:
        text = json.dumps({"stage": stage, "format": FORMAT, **namespace}, sort_keys=True)
        self.dir = storage.join(root, stage, _digest(text))
        self.namespace, self.encode, self.decode, self.keep = text, encode, decode, keep
        self._keys = np.zeros(0, "S16")              # sorted 16-byte hashes
        self._where = np.zeros(0, np.int32)          # their segment numbers
        self._segments: list[str] = []
        self._values: OrderedDict[str, dict] = OrderedDict()
        self._described = False                       # namespace.json written (or found)
        self.hits = self.misses = 0

    @classmethod
    def of(cls, run: Any, stage: str, namespace: dict, **codec: Callable
           ) -> Optional["ImageCache"]:
        """The run's cache for ``stage`` (None when ``run.image_cache`` is off)."""
        if not run.image_cache:
            return None
        root = run.cache_dir or storage.join(run.run_dir, DEFAULT_DIR)
        return cls(root, stage, namespace, **codec)

    # --- reading ---------------------------------------------------------------------------
    def _load_index(self) -> None:
        """Index the segments written since the last look (by this worker or any other: a part
        on another actor or node), so that an image computed once anywhere in the run is read,
        not computed again. One listing per batch."""
        known = set(self._segments)
        names = sorted(i.base_name for i in storage.listdir(self.dir)
                       if i.base_name.startswith("seg-") and i.base_name.endswith(".parquet")
                       and i.base_name not in known)
        for name in names:
            self._index(name, _hashes(storage.join(self.dir, name)))

    def _index(self, name: str, hashes: Sequence[str]) -> None:
        """Add segment ``name``'s ``hashes`` to the sorted index (a segment once)."""
        keys = np.sort(np.frombuffer(bytes.fromhex("".join(hashes)), "S16"))
        at = np.searchsorted(self._keys, keys, side="right")   # after equal keys: the first
        self._keys = np.insert(self._keys, at, keys)           # segment holding one answers
        self._where = np.insert(self._where, at, np.int32(len(self._segments)))
        self._segments.append(name)

    def _segment(self, n: int) -> dict:
        name = self._segments[n]
        if name not in self._values:
            try:
                t = _read(storage.join(self.dir, name), None).to_pydict()
            except (OSError, pa.ArrowException):     # damaged since the index was read: misses
                t = {_HASH: [], _VALUE: []}
            self._values[name] = dict(zip(t[_HASH], t[_VALUE]))
            if len(self._values) > _SEGMENTS_KEPT:
                self._values.popitem(last=False)
        self._values.move_to_end(name)
        return self._values[name]

    def get(self, hashes: Sequence[str]) -> dict[str, Any]:
        """{hash: result} for the hashes the cache holds."""
        self._load_index()
        out = {}
        if len(self._keys):
            want = np.array([bytes.fromhex(h) for h in hashes], dtype="S16")
            pos = np.minimum(np.searchsorted(self._keys, want), len(self._keys) - 1)
            for h, p, ok in zip(hashes, pos, self._keys[pos] == want):
                value = self._segment(int(self._where[p])).get(h) if ok else None
                if value is not None:
                    out[h] = self.decode(json.loads(value))
        self.hits += len(out)
        self.misses += len(set(hashes)) - len(out)
        return out

    # --- writing ---------------------------------------------------------------------------
    def put(self, results: dict[str, Any]) -> None:
        """Store ``{hash: result}`` as one segment named by its content."""
        if not results:
            return
        rows = sorted((h, json.dumps(self.encode(v), sort_keys=True)) for h, v in results.items())
        table = pa.table({_HASH: [h for h, _ in rows], _VALUE: [v for _, v in rows]},
                         schema=_SCHEMA)
        name = f"seg-{_digest(chr(10).join(h + v for h, v in rows))}.parquet"
        if not self._described:                       # once per instance, not per segment
            about = storage.join(self.dir, "namespace.json")
            if not storage.exists(about):
                storage.write_bytes(about, self.namespace.encode())
            self._described = True
        buf = pa.BufferOutputStream()
        pq.write_table(table, buf)
        storage.write_bytes(storage.join(self.dir, name), buf.getvalue().to_pybytes())
        if name not in self._segments:                # this worker reads its own writes
            self._index(name, [h for h, _ in rows])


def _hashes(uri: str) -> list[str]:
    """A segment's hashes; none when it cannot be read (a damaged segment is a miss, never an
    error: the cache only ever saves work)."""
    try:
        return _read(uri, [_HASH]).column(0).to_pylist()
    except (OSError, pa.ArrowException):
        return []


def _read(uri: str, columns: Optional[list[str]]) -> pa.Table:
    fs, path = storage.resolve(uri)
    with fs.open_input_file(path) as fh:
        return pq.read_table(fh, columns=columns)


def cached(cache: Optional[ImageCache], hashes: Sequence[str],
           compute: Callable[[list[int]], list]) -> list:
    """The result for each of ``hashes`` (distinct images): from ``cache`` where it holds them,
    else ``compute(indices)`` for the others, whose results the cache ``keep``s are stored."""
    if cache is None:
        return compute(list(range(len(hashes))))
    got = cache.get(hashes)
    missing = [i for i, h in enumerate(hashes) if h not in got]
    fresh = compute(missing) if missing else []
    cache.put({hashes[i]: r for i, r in zip(missing, fresh) if cache.keep(r)})
    results = dict(zip(missing, fresh))
    return [results[i] if i in results else got[h] for i, h in enumerate(hashes)]
