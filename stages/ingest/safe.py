"""Reading untrusted files safely: bounded reads, no special files, no escaping the source
folder, and text that always fits an Arrow string column.

Every function here returns a reason instead of raising: the caller turns it into a reject row.
"""
from __future__ import annotations

import functools
import os
import stat
from pathlib import Path
from typing import Optional

import pyarrow.fs as pafs

from vlcurate.schemas import reasons as R

from .objpath import ObjPath, RangeFile

MAX_DETAIL = 200      # characters of an error message kept in a row (never file contents)
# A compression bomb: a tar member (of a gzip shard) or a Parquet row group that declares more
# than BOMB_RATIO times the bytes its whole file has on disk, and more than BOMB_FLOOR. Image
# bytes (JPEG, PNG, WebP) do not compress, so real data never comes near; zeros do (gzip
# ~1000x, zstd far more). Without this a 10 kB file could expand to max_image_bytes of zeros.
BOMB_RATIO = 100
BOMB_FLOOR = 4 << 20


def bomb(declared: int, on_disk: int) -> bool:
    return declared > BOMB_FLOOR and declared > BOMB_RATIO * on_disk


def clean_text(s: Optional[str]) -> Optional[str]:
    """``s`` as valid UTF-8 text: lone surrogates (from a JSON ``\\ud800`` escape, or a non-UTF-8
    byte decoded with surrogateescape) become visible escapes (``\\xff``, ``\\ud800``), so the
    same input always gives the same key and Arrow can store it."""
    if s is None:
        return None
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return "".join(_escape(c) if "\ud800" <= c <= "\udfff" else c for c in s)


def _escape(c: str) -> str:
    n = ord(c)
    return f"\\x{n - 0xDC00:02x}" if 0xDC80 <= n <= 0xDCFF else f"\\u{n:04x}"


def detail(e: BaseException | str) -> str:
    """A short, single-line error message for reason_detail / extra."""
    msg = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    msg = clean_text(" ".join(msg.split()))
    return msg if len(msg) <= MAX_DETAIL else msg[:MAX_DETAIL - 3] + "..."


def kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


@functools.lru_cache(maxsize=64)
def _real_root(root: bytes) -> bytes:
    return os.path.realpath(root).rstrip(b"/") + b"/"


def inside(path: str | Path, root: str | Path) -> bool:
    """``path`` resolves (``..``, absolute paths and symlinks followed) to ``root`` or below."""
    top = _real_root(os.fsencode(root))
    return (os.path.realpath(os.fsencode(path)) + b"/").startswith(top)


def read_file(path: str | Path, limit: int) -> tuple[Optional[bytes], Optional[str], str]:
    """(bytes, reason, detail): at most ``limit`` bytes of a regular file. A FIFO, device, socket
    or directory is never opened; a file over ``limit`` is never read; a read never blocks."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None, R.MISSING_FILE, "no such file"
    except (OSError, ValueError) as e:  # NUL byte, unencodable name, permission, loop, too long
        return None, R.MISSING_FILE, detail(e)
    if not stat.S_ISREG(st.st_mode):
        reason = R.MISSING_FILE if stat.S_ISDIR(st.st_mode) else R.SPECIAL_FILE
        return None, reason, f"is {kind_of(st.st_mode)}"
    if st.st_size > limit:
        return None, R.FILE_TOO_LARGE, f"{st.st_size} bytes > max_image_bytes {limit}"
    try:  # O_NONBLOCK: if the path was swapped for a FIFO since the stat, open does not wait
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        return None, R.MISSING_FILE, detail(e)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, R.SPECIAL_FILE, f"is {kind_of(os.fstat(fd).st_mode)}"
        return _read_fd(fd, limit)
    except OSError as e:
        return None, R.MISSING_FILE, detail(e)
    finally:
        os.close(fd)


def _read_fd(fd: int, limit: int) -> tuple[Optional[bytes], Optional[str], str]:
    chunks, n = [], 0
    while n <= limit:          # one byte past the limit is enough to know it is over
        b = os.read(fd, min(1 << 20, limit + 1 - n))
        if not b:
            return b"".join(chunks), None, ""
        chunks.append(b)
        n += len(b)
    return None, R.FILE_TOO_LARGE, f"more than max_image_bytes {limit} bytes (file grew)"


def read_object(p: ObjPath, limit: int) -> tuple[Optional[bytes], Optional[str], str]:
    """``read_file`` for an object in a bucket: its listed size is checked before any byte is
    read, and at most ``limit`` + 1 bytes are read."""
    info = p.info()
    if info is None:
        return None, R.MISSING_FILE, "no such file"
    if info.type != pafs.FileType.File:
        return None, R.MISSING_FILE, "is a directory"
    if info.size > limit:
        return None, R.FILE_TOO_LARGE, f"{info.size} bytes > max_image_bytes {limit}"
    try:
        with p.open() as fh:
            data = fh.read(limit + 1)
    except OSError as e:
        return None, R.MISSING_FILE, detail(e)
    if len(data) > limit:
        return None, R.FILE_TOO_LARGE, f"more than max_image_bytes {limit} bytes (file grew)"
    return data, None, ""


def _read_in_bucket(base: ObjPath, ref: str | bytes, root: ObjPath, limit: int,
                    allow_outside: bool) -> tuple[Optional[bytes], Optional[str], str]:
    ref = ref.decode("utf-8", "surrogateescape") if isinstance(ref, bytes) else ref
    if "\0" in ref:
        return None, R.MISSING_FILE, "path has a NUL byte"
    p = ObjPath(ref, root.root) if "://" in ref else base / ref
    if not allow_outside and not p.inside(root):
        return None, R.OUTSIDE_SOURCE, ("resolves outside the source folder "
                                        "(source.allow_outside_source: false)")
    return read_object(p, limit)


def read_member(base: Path | ObjPath, ref: str | bytes, root: Path | ObjPath, *, limit: int,
                allow_outside: bool) -> tuple[Optional[bytes], Optional[str], str]:
    """An image file named in a record: ``ref`` relative to ``base`` (or absolute), which must
    resolve inside ``root`` unless ``allow_outside``."""
    if isinstance(base, ObjPath):
        return _read_in_bucket(base, ref, root, limit, allow_outside)
    try:
        p = os.path.join(os.fsencode(base), ref if isinstance(ref, bytes) else os.fsencode(ref))
    except (UnicodeError, ValueError, TypeError) as e:
        return None, R.MISSING_FILE, detail(e)
    if b"\0" in p:
        return None, R.MISSING_FILE, "path has a NUL byte"
    if not allow_outside and not inside(p, root):
        return None, R.OUTSIDE_SOURCE, ("resolves outside the source folder "
                                        "(source.allow_outside_source: false)")
    return read_file(p, limit)


class NotRegular(OSError):
    """A FIFO, device, socket or directory where a regular file was expected."""


def open_regular(path: str | Path | ObjPath):
    """A binary file object for ``path`` if it is a regular file; OSError otherwise. Never
    blocks (a FIFO is refused, not waited on); a device is never opened. An object in a bucket
    opens as a seekable file read by range."""
    if isinstance(path, ObjPath):
        if not path.is_file():
            if path.is_dir():
                raise NotRegular(f"{path.name} is a directory")
            raise FileNotFoundError(f"no such object: {path.name}")
        return path.open()
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegular(f"{Path(os.fsdecode(path)).name} is {kind_of(mode)}")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegular(f"{Path(os.fsdecode(path)).name} is {kind_of(mode)}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def size_of(fh) -> int:
    """The size of an open file: a local one's (fstat), or an object's (``ObjPath.open``)."""
    raw = getattr(fh, "raw", None)
    return raw.size if isinstance(raw, RangeFile) else os.fstat(fh.fileno()).st_size
