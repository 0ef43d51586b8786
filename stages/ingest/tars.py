"""WebDataset tar shards, read member by member with bounded memory.

* Plain and gzip-compressed tars (``.tar``, ``.tar.gz``, ``.tgz``: told apart by their first
  bytes, not their name) and concatenated tars (``cat a.tar b.tar``: every archive is read).
* A regular member is read only when its declared size is at most ``limit`` bytes, and no
  header (PAX, GNU long name) may make tarfile read more than that either.
* Links, sparse members, FIFOs and devices are members with a reason, never followed or read.
* A tar that ends early, or has garbage where a header should be, yields what it read and then
  reports the error; a file that is not a tar at all is reported as such (``bad_file``).
"""
from __future__ import annotations

import gzip
import os
import tarfile
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from vlcurate.schemas import reasons as R

from .safe import NotRegular, bomb, clean_text, detail, open_regular, size_of

BLOCK = tarfile.BLOCKSIZE
_NO_DATA = (tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE)   # (links: never read here)
_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error, ValueError, OverflowError)


@dataclass
class Member:
    name: str
    data: Optional[bytes] = None
    error: Optional[str] = None     # a reason code
    detail: str = ""


@dataclass
class TarEnd:
    """How the reading ended: ``error`` None for a complete archive."""
    error: Optional[str] = None     # R.BAD_FILE (nothing was a tar) or R.BAD_RECORD (a bad tail)
    detail: str = ""
    members: int = field(default=0)


class _Bounded:
    """A file object for tarfile that refuses any single read over ``limit`` bytes (a PAX or
    GNU long-name header that declares gigabytes must not allocate them)."""

    def __init__(self, f, limit: int) -> None:
        self.f, self.limit = f, max(limit, 1 << 20) + BLOCK
        self.last: tuple[int, bytes] = (-1, b"")     # the last header-sized read: (offset, data)

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > self.limit:
            raise tarfile.ReadError(f"a header asks to read {n} bytes (> max_image_bytes)")
        if n != BLOCK:
            return self.f.read(n)
        at = self.f.tell()
        self.last = (at, self.f.read(n))
        return self.last[1]

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos, whence)

    def tell(self) -> int:
        return self.f.tell()


def _member(tf: tarfile.TarFile, m: tarfile.TarInfo, limit: int, disk: int) -> Member:
    name = clean_text(m.name)
    if m.issym() or m.islnk():
        kind = "symbolic" if m.issym() else "hard"
        return Member(name, None, R.SPECIAL_FILE, f"is a {kind} link (to {clean_text(m.linkname)})")
    if m.issparse():
        return _unread(tf, m, Member(name, None, R.SPECIAL_FILE, "is a sparse member"))
    if not m.isreg():
        return _unread(tf, m, Member(name, None, R.SPECIAL_FILE, "is a FIFO or device member"))
    if m.size > limit:
        return _unread(tf, m, Member(name, None, R.FILE_TOO_LARGE,
                                     f"{m.size} bytes > max_image_bytes {limit}"))
    if bomb(m.size, disk):
        return _unread(tf, m, Member(name, None, R.FILE_TOO_LARGE, (
            f"declares {m.size} bytes in a {disk}-byte file (a compression bomb)")))
    fh = tf.extractfile(m)
    return Member(name, fh.read() if fh else b"")


def _unread(tf: tarfile.TarFile, m: tarfile.TarInfo, member: Member) -> Member:
    """``member``, a member whose data is skipped unread, if the file holds that data; a member
    that declares more than the file holds (a truncated tar, a header claiming a terabyte) is no
    record but the damage: it raises, and the reading ends with the ``<unreadable>`` row, as for
    a member cut short while read (the second count, ``census``, counts it so too). One byte is
    read, never the data."""
    if m.type in _NO_DATA:
        return member
    # (a sparse member's size is its expanded one: the blocks tarfile skips stand for its data)
    stored = tf.offset - m.offset_data if m.issparse() else m.size
    if stored:
        tf.fileobj.seek(m.offset_data + stored - 1)
        if not tf.fileobj.read(1):
            raise tarfile.ReadError(f"{member.name} declares {stored} bytes; the file ends "
                                    "before them (truncated)")
    return member


def _next_archive(f, pos: int) -> tuple[Optional[int], str]:
    """After an end-of-archive block at ``pos``: (offset of a following archive, "") or
    (None, "") at a clean end, or (None, error) when what follows is neither."""
    f.seek(pos)
    while True:
        chunk = f.read(64 * BLOCK)
        if not chunk:
            return None, ""
        nz = len(chunk) - len(chunk.lstrip(b"\0"))
        if nz < len(chunk):
            at = pos + nz // BLOCK * BLOCK
            if len(chunk) - nz // BLOCK * BLOCK < BLOCK:
                return None, f"{len(chunk) - nz // BLOCK * BLOCK} stray bytes at offset {at}"
            return at, ""
        pos += len(chunk)


def _end_of(f: _Bounded, tf: tarfile.TarFile) -> tuple[Optional[int], str]:
    """Why tarfile stopped at ``tf.offset``: (next archive offset or None, error or "")."""
    block = f.last[1]
    if f.last[0] != tf.offset:   # (gzip: seeking back means decompressing again from the start)
        f.f.seek(tf.offset)
        block = f.f.read(BLOCK)
    if len(block) < BLOCK:
        return None, f"no end-of-archive block at offset {tf.offset} (truncated)"
    if block != bytes(BLOCK):
        return None, f"invalid header at offset {tf.offset}"
    return _next_archive(f.f, tf.offset + BLOCK)


def read(path: Any, limit: int, end: TarEnd) -> Iterator[Member]:
    """Every non-directory member of every archive in the file (a path, or an object in a
    bucket, ``objpath.ObjPath``: read by range), in order; ``end`` says how the reading ended."""
    try:
        with open_regular(path) as raw:
            gz = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            f = gzip.GzipFile(fileobj=raw) if gz else raw
            yield from _archives(_Bounded(f, limit), limit, end, size_of(raw))
    except NotRegular as e:
        end.error, end.detail = R.SPECIAL_FILE, detail(e)
    except _ERRORS as e:
        end.error, end.detail = (R.BAD_RECORD if end.members else R.BAD_FILE), detail(e)


def _archives(f: _Bounded, limit: int, end: TarEnd, disk: int) -> Iterator[Member]:
    pos: Optional[int] = 0
    while pos is not None:
        f.seek(pos)
        tf = tarfile.TarFile(fileobj=f, mode="r", encoding="utf-8", errors="surrogateescape")
        while (m := tf.next()) is not None:
            tf.members.clear()           # tarfile keeps every header otherwise
            if not m.isdir():            # a directory entry is not a record
                end.members += 1
                yield _member(tf, m, limit, disk)
        pos, error = _end_of(f, tf)
        if error:
            end.error = R.BAD_RECORD if (end.members or tf.offset) else R.BAD_FILE
            end.detail = error
            return


def split_key(name: str) -> tuple[str, str]:
    """WebDataset convention: the key is the path up to the first dot of the basename."""
    d, base = os.path.split(name)
    stem, _, ext = base.partition(".")
    return (f"{d}/{stem}" if d else stem), ext.lower()


@dataclass
class Group:
    key: str
    fields: dict = field(default_factory=dict)     # extension -> bytes
    error: Optional[str] = None
    detail: str = ""


def groups(members: Iterator[Member]) -> Iterator[Group]:
    """Consecutive members with the same key form one record. A key that comes back later, or
    an extension seen twice in a row (``a.jpg a.txt a.jpg``), starts a new record with the same
    key: never merged, so the ids stage flags it ``ingest.duplicate_id``. A member without an
    extension is no sample's and is skipped."""
    cur: Optional[Group] = None
    for m in members:
        key, ext = split_key(m.name)
        if not ext:   # (a README in a shard): not part of any sample, by WebDataset's convention
            continue
        if cur is None or key != cur.key or ext in cur.fields:
            if cur is not None:
                yield cur
            cur = Group(key)
        cur.fields[ext] = m.data
        if m.error and cur.error is None:
            cur.error, cur.detail = m.error, f"{m.name}: {m.detail}"
    if cur is not None:
        yield cur
