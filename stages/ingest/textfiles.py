"""Captions files (CSV, TSV, JSONL) read record by record with bounded memory.

Every physical line is accounted for: it is part of exactly one record, or it is its own bad
record. A quoted CSV field may span lines (a caption with a newline), but only when the joined
lines parse as one record with the header's width; otherwise the first line alone is a bad
record and parsing resumes at the next line, so an unbalanced quote never swallows the
records after it. A span is at most ``MAX_RECORD_LINES`` lines, a line at most
``MAX_LINE_BYTES`` bytes (a longer one is skipped in chunks and is a bad record).
"""
from __future__ import annotations

import collections
import json
import re
from typing import IO, Any, Iterator, Optional

BOM = b"\xef\xbb\xbf"
MAX_LINE_BYTES = 1 << 20
MAX_RECORD_LINES = 64
_FIELD = {d: re.compile(rb'"((?:[^"]|"")*)"|([^"%s\n][^%s\n]*|)' % (re.escape(d), re.escape(d)),
                        re.S) for d in (b",", b"\t")}
# lenient: a quoted part then any text up to the delimiter (groups 1, 2); or any text (3)
_LENIENT = {d: re.compile(rb'"((?:[^"]|"")*)"([^%s\n]*)|([^%s\n]*)' % ((re.escape(d),) * 2))
            for d in (b",", b"\t")}

# (record, error or None, first line number); a bad line's record holds the cells that could
# be read (its key, say), or is None
Row = tuple[Optional[dict], Optional[str], int]


def physical_lines(fh: IO[bytes]) -> Iterator[tuple[int, Optional[bytes]]]:
    """(line number, line without its LF / CRLF) or (n, None) for a line over MAX_LINE_BYTES.
    A stray CR inside a line is kept (caption normalisation turns it into a space)."""
    n = 0
    while True:
        line = fh.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        n += 1
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while True:  # skip the rest of the line without holding it
                rest = fh.readline(1 << 20)
                if not rest or rest.endswith(b"\n"):
                    break
            yield n, None
            continue
        if n == 1 and line.startswith(BOM):
            line = line[len(BOM):]
        line = line[:-1] if line.endswith(b"\n") else line
        yield n, line[:-1] if line.endswith(b"\r") else line


def split(text: bytes, delim: bytes, lenient: bool = False) -> Optional[list[bytes]]:
    """RFC 4180 fields of ``text`` (quoted fields may hold delimiters, ``""`` and newlines; an
    unquoted field may hold a quote that is not its first character), or None if malformed.
    ``lenient`` (one physical line only): text after a closing quote joins the field, as
    Python's csv and Arrow read ``"the best" photo``."""
    if b'"' not in text:
        return text.split(delim) if b"\n" not in text else None
    pat, fields, pos = (_LENIENT if lenient else _FIELD)[delim], [], 0
    while True:
        m = pat.match(text, pos)
        q = m.group(1)
        if q is None:
            fields.append(m.group(3 if lenient else 2))
        else:
            fields.append(q.replace(b'""', b'"') + (m.group(2) if lenient else b""))
        pos = m.end()
        if pos == len(text):
            return fields
        if text[pos:pos + 1] != delim:
            return None
        pos += 1


def read_table(fh: IO[bytes], delim: bytes, header: list[str]) -> Iterator[Row]:
    """Records of a CSV/TSV file as {header: cell bytes}; the header is the first line, and
    its column names are put in ``header``."""
    lines = (x for x in physical_lines(fh) if x[1] is None or x[1].strip())  # blank: no record
    first = next(lines, None)
    if first is None or first[1] is None:
        return
    header += [h.decode("utf-8", "replace").strip() for h in (split(first[1], delim) or [])]
    buf: collections.deque = collections.deque()
    while True:
        while len(buf) < MAX_RECORD_LINES:
            nxt = next(lines, None)
            if nxt is None:
                break
            buf.append(nxt)
        if not buf:
            return
        yield _record(buf, header, delim)


def _record(buf: collections.deque, header: list[str], delim: bytes) -> Row:
    """The record starting at buf[0]; pops the lines it used (at least one)."""
    n, line = buf[0]
    if line is None:
        buf.popleft()
        return None, f"line {n}: longer than {MAX_LINE_BYTES} bytes", n
    fields, used = split(line, delim), 1
    if fields is None and line.count(b'"') % 2 == 1:   # an open quote: a field over lines?
        fields, used = _span(buf, delim)
    elif fields is None:                                # balanced: "the best" photo
        fields = split(line, delim, lenient=True)
    if fields is None or len(fields) != len(header):
        buf.popleft()
        why = ("unbalanced or misplaced quote" if fields is None
               else f"{len(fields)} fields, the header has {len(header)}")
        return dict(zip(header, fields or _leading(line, delim))), f"line {n}: {why}", n
    for _ in range(used):
        buf.popleft()
    return dict(zip(header, fields)), None, n


def _leading(line: bytes, delim: bytes) -> list[bytes]:
    """The fields of a malformed line that can still be read: those before its first quote
    (the quoted field and everything after it are lost)."""
    head = line.split(b'"', 1)[0]
    return head.split(delim)[:-1] if b'"' in line else head.split(delim)


def _span(buf: collections.deque, delim: bytes) -> tuple[Optional[list[bytes]], int]:
    """(fields, lines used) of a record whose quoted field goes on over the next lines, parsed
    strictly; (None, 1) if the lines never join into one well-formed record."""
    text, used = buf[0][1], 1
    while used < len(buf) and buf[used][1] is not None:
        text += b"\n" + buf[used][1]
        used += 1
        if text.count(b'"') % 2 == 0:
            fields = split(text, delim)
            return (fields, used) if fields is not None else (None, 1)
    return None, 1


def read_jsonl(fh: IO[bytes]) -> Iterator[Row]:
    for n, line in physical_lines(fh):
        if line is None:
            yield None, f"line {n}: longer than {MAX_LINE_BYTES} bytes", n
            continue
        if not line.strip():
            continue
        try:
            obj: Any = json.loads(line.decode("utf-8", "surrogateescape"))
        except (ValueError, RecursionError) as e:   # JSONDecodeError is a ValueError
            yield None, f"line {n}: {type(e).__name__}: {str(e)[:120]}", n
            continue
        if not isinstance(obj, dict):  # valid JSON, not a record: a bad row, not a bad source
            yield None, f"line {n}: expected a JSON object, got {type(obj).__name__}", n
            continue
        yield obj, None, n
