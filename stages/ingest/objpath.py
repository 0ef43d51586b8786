"""A source on an object store (``source.path: s3://bucket/prefix``, ``gs://...``, any
pyarrow.fs / fsspec URI), seen through the slice of ``pathlib.Path`` the readers use, so that
one reader serves local folders and buckets alike.

An object store has no links, FIFOs or devices, so of the local guarantees (``safe.py``) what is
left to enforce is the read bound (an object's size comes from its listing and is checked before
any byte is read; no read takes more than ``max_image_bytes + 1``) and the source boundary (a
record's image path resolving outside the source prefix is ``ingest.outside_source``). Objects
are read by range through pyarrow's input files: a tar or a Parquet file streams, never
downloaded whole. Listing is one recursive LIST of the source, cached per source.
"""
from __future__ import annotations

import functools
import io
import posixpath
import time
from typing import Iterator, Optional

import pyarrow.fs as pafs

from vlcurate.foundation import storage


LISTING_TTL_S = 60   # a worker re-lists a source at most this often (plan() always re-lists)


def _listing(root: str) -> dict[str, pafs.FileInfo]:
    """Every object (and implied folder) under ``root``: one recursive LIST, kept for a
    minute (a worker reads many parts of one source; a later run sees a fresh listing)."""
    return _listed(root, int(time.monotonic() // LISTING_TTL_S))


@functools.lru_cache(maxsize=16)
def _listed(root: str, _epoch: int) -> dict[str, pafs.FileInfo]:
    fs, path = storage.resolve(root)
    infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True, recursive=True))
    return {i.path.rstrip("/"): i for i in infos}


class ObjPath:
    """A location in a bucket: ``scheme://`` + a POSIX key, with Path's operators."""

    def __init__(self, uri: str, root: Optional[str] = None) -> None:
        self.scheme, _, key = str(uri).partition("://")
        self.key = posixpath.normpath(key).lstrip("/") if key else ""
        self.root = root if root is not None else self.uri     # the listed source root

    @property
    def uri(self) -> str:
        return f"{self.scheme}://{self.key}"

    def __str__(self) -> str:
        return self.uri

    def __repr__(self) -> str:
        return f"ObjPath({self.uri!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjPath) and other.uri == self.uri

    def __hash__(self) -> int:
        return hash(self.uri)

    def __lt__(self, other: "ObjPath") -> bool:
        return self.uri < other.uri

    def __truediv__(self, part: str) -> "ObjPath":
        return ObjPath(f"{self.scheme}://{posixpath.join(self.key, str(part))}", self.root)

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def stem(self) -> str:
        return posixpath.splitext(self.name)[0]

    @property
    def parent(self) -> "ObjPath":
        return ObjPath(f"{self.scheme}://{posixpath.dirname(self.key)}", self.root)

    def with_suffix(self, suffix: str) -> "ObjPath":
        return ObjPath(f"{self.scheme}://{posixpath.splitext(self.key)[0]}{suffix}", self.root)

    def is_absolute(self) -> bool:
        return True

    def relative_to(self, other: "ObjPath") -> str:
        return posixpath.relpath(self.key, other.key)

    def inside(self, root: "ObjPath") -> bool:
        return self.key == root.key or self.key.startswith(root.key.rstrip("/") + "/")

    # --- what the listing says -------------------------------------------------------------
    def info(self) -> Optional[pafs.FileInfo]:
        """From the source's one LIST, which is the whole truth about the objects under the
        source; one HEAD for a location outside it."""
        hit = _listing(self.root).get(self._fs_path())
        root = ObjPath(self.root)
        if hit is not None or (self.key != root.key and self.inside(root)):
            return hit
        fs, path = storage.resolve(self.uri)
        info = fs.get_file_info(path)
        return None if info.type == pafs.FileType.NotFound else info

    def _fs_path(self) -> str:
        return storage.resolve(self.uri)[1].rstrip("/")

    def exists(self) -> bool:
        return self.info() is not None or self.is_dir()

    def is_file(self) -> bool:
        info = self.info()
        return info is not None and info.type == pafs.FileType.File

    def is_dir(self) -> bool:
        if self.key == ObjPath(self.root).key:
            return bool(_listing(self.root))
        info = self.info()
        return info is not None and info.type == pafs.FileType.Directory

    def size(self) -> int:
        info = self.info()
        return int(info.size) if info is not None and info.size is not None else 0

    def signature(self) -> str:
        info = self.info()
        return f"{info.size}:{info.mtime_ns}" if info is not None else "missing"

    def walk_files(self) -> list["ObjPath"]:
        """Every object under this prefix, sorted (the source's one LIST)."""
        prefix = self._fs_path() + "/"
        return sorted(ObjPath(f"{self.scheme}://{p}", self.root)
                      for p, i in _listing(self.root).items()
                      if i.type == pafs.FileType.File and p.startswith(prefix))

    def iterdir(self) -> Iterator["ObjPath"]:
        prefix = self._fs_path() + "/"
        for p in sorted(_listing(self.root)):
            if p.startswith(prefix) and "/" not in p[len(prefix):]:
                yield ObjPath(f"{self.scheme}://{p}", self.root)

    def open(self) -> io.BufferedReader:
        """A seekable, buffered binary file read by range (tars, Parquet and text files stream
        through it, as through a local file)."""
        fs, path = storage.resolve(self.uri)
        return io.BufferedReader(RangeFile(fs.open_input_file(path)), buffer_size=1 << 20)


class RangeFile(io.RawIOBase):
    """pyarrow's random-access input file as a Python raw file (``readline``, ``tarfile`` and
    ``gzip`` need one); ``size`` is the object's."""

    def __init__(self, native) -> None:
        self.native, self.size = native, native.size()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.native.read(len(b))
        b[:len(data)] = data
        return len(data)

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.native.seek(pos, whence)

    def tell(self) -> int:
        return self.native.tell()

    def close(self) -> None:
        self.native.close()
        super().close()


def forget_listings() -> None:
    _listed.cache_clear()


def src_path(location: str, root: Optional[str] = None):
    """A local ``Path`` for a plain path, an :class:`ObjPath` for a URI (``root``: the source's
    URI, whose one LIST answers for every object under it)."""
    from pathlib import Path
    return Path(location) if storage.is_local(location) else ObjPath(location, root)
