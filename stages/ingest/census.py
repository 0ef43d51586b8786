"""The second count: how many records a source holds, counted without the readers.

"No row lost" compares it, file by file, with the rows the ingest stage wrote (kept +
rejected). The source's files are listed when ingest plans (``record``, beside the plan) and
counted after its parts ran (``count_all``: the executor's tasks, a few dozen files each). It
shares no parsing with ``readers``:

- Parquet: each file's footer ``num_rows`` (a file whose footer cannot be read: 1, its
  ``bad_file`` row).
- JSONL: the non-blank lines. CSV/TSV: the records Python's ``csv`` module finds after the
  header, when it parses the file strictly; a file it cannot parse so has no independent record
  count, only bounds: at least one record, at most one per non-blank line.
- WebDataset tars: the tar headers walked here (``tar_keys``), members grouped by key as the
  WebDataset convention says; a tar that ends early or holds garbage adds one record (the
  ``<unreadable>`` row), one that is not a tar at all is that one record.
- img2dataset: per shard, the status file's rows, plus the shard's samples that no success row
  of its status file stands for (a status file without its shard: its rows).
"""
from __future__ import annotations

import csv
import gzip
import json
import os
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterable, Optional

import pyarrow.parquet as pq

from .objpath import ObjPath, src_path
from .safe import clean_text, open_regular

BLOCK = 512
ZERO = bytes(BLOCK)
TARS = (".tar", ".tar.gz", ".tgz")
SKIP = (".parquet", "_stats.json")        # files beside an img2dataset shard's images


@dataclass(frozen=True)
class Count:
    """Records in one unit (a file, or an img2dataset shard): ``low`` .. ``high`` (equal when
    the count is exact), and how it was counted when it is not."""
    low: int
    high: int
    note: str = ""


def exact(n: int) -> Count:
    return Count(n, n)


# --- finding the files ----------------------------------------------------------------------------
def _walk(root: Path | ObjPath, suffixes: tuple[str, ...]) -> list:
    if not root.is_dir():
        return [root] if root.name.endswith(suffixes) else []
    if isinstance(root, ObjPath):
        return [p for p in root.walk_files() if p.name.endswith(suffixes)]
    found = [Path(d) / n for d, _, names in os.walk(root) for n in names]
    return sorted(p for p in found if p.name.endswith(suffixes))


def status_file(shard: Path | ObjPath) -> Path | ObjPath:
    """The img2dataset status file of a shard: 00000.parquet for 00000.tar(.gz) or 00000/."""
    name = shard.name
    for s in (".gz", ".tgz", ".tar"):
        name = name.removesuffix(s)
    return shard.parent / f"{name}.parquet"


# --- Parquet --------------------------------------------------------------------------------------
def parquet_rows(path: Path | ObjPath) -> int:
    try:
        with open_regular(path) as fh:
            return pq.ParquetFile(fh).metadata.num_rows
    except Exception:  # not Parquet: the reader's one bad_file row
        return 1


# --- text files -----------------------------------------------------------------------------------
def _lines(fh: IO[bytes]) -> Iterable[bytes]:
    first = True
    for line in fh:
        if first and line.startswith(b"\xef\xbb\xbf"):
            line = line[3:]
        first = False
        yield line


def jsonl_records(fh: IO[bytes]) -> int:
    return sum(1 for line in _lines(fh) if line.strip())


MAX_RECORD_LINES = 64   # a quoted field may span this many lines (as the reader allows)


def _csv_lines(fh: IO[bytes], odd: bytearray) -> Iterable[str]:
    """The non-blank lines (the reader's blank lines are no record's, even inside quotes); a
    line ends at LF only (a CR inside a line is text). ``odd``: each line's quote parity."""
    for line in _lines(fh):
        if not line.strip():
            continue
        line = line[:-1] if line.endswith(b"\n") else line
        line = line[:-1] if line.endswith(b"\r") else line
        odd.append(line.count(b'"') % 2)
        yield line.replace(b"\r", b" ").decode("utf-8", "surrogateescape") + "\n"


def table_records(fh: IO[bytes], delim: str) -> Count:
    """CSV/TSV records after the header, by Python's csv module (strict RFC 4180). A file it
    cannot parse so has bounds instead, as has one with a record over lines that is ragged, or
    whose first line does not open a quoted field (a quote inside an unquoted field)."""
    odd = bytearray()
    rows = csv.reader(_csv_lines(fh, odd), delimiter=delim, strict=True)
    n, width, at = -1, None, 0
    try:
        for row in rows:
            span, at = rows.line_num - at, rows.line_num
            width = len(row) if width is None else width
            if span > 1 and (span > MAX_RECORD_LINES or len(row) != width
                             or not odd[at - span]):
                raise csv.Error(f"a record over lines {at - span + 1}-{at} the reader may split")
            n += 1
    except csv.Error as e:
        lines = len(odd) + sum(1 for _ in _csv_lines(fh, odd))
        return Count(min(1, lines - 1), max(lines - 1, 0), f"not strict CSV ({e})")
    return exact(max(n, 0))


# --- tars -----------------------------------------------------------------------------------------
def _number(field: bytes) -> int:
    if field[:1] in (b"\x80", b"\xff"):                       # base-256 (GNU)
        n = int.from_bytes(field[1:], "big")
        return n - (1 << (8 * (len(field) - 1))) if field[:1] == b"\xff" else n
    s = field.split(b"\0", 1)[0].strip()
    return int(s, 8) if s else 0


def _checksum_ok(block: bytes) -> bool:
    try:
        stored = _number(block[148:156])
    except ValueError:
        return False
    rest = block[:148] + block[156:]
    plain = sum(rest) + 8 * 32
    return stored == plain or stored == plain - 256 * sum(b > 127 for b in rest)   # (signed)


def _name(block: bytes) -> str:
    name = block[:100].split(b"\0", 1)[0]
    if block[257:265] == b"ustar\x0000":
        prefix = block[345:500].split(b"\0", 1)[0]
        name = prefix + b"/" + name if prefix else name
    return name.decode("utf-8", "surrogateescape")


def _pax(data: bytes) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(data):
        length = data[pos:].split(b" ", 1)[0]
        if not length.isdigit() or int(length) <= 0:
            break
        rec = data[pos:pos + int(length)]
        key, _, value = rec.split(b" ", 1)[-1].rstrip(b"\n").partition(b"=")
        out[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos += int(length)
    return out


class _Blocks:
    """A tar's bytes read block by block (a gzip stream decompressed as it goes). A local plain
    tar's member data is seeked over, not read; a gzip or remote one's is read and dropped
    (one pass: no request per member)."""

    def __init__(self, fh: IO[bytes], local: bool) -> None:
        gz = fh.read(2) == b"\x1f\x8b"
        fh.seek(0)
        self.f = gzip.GzipFile(fileobj=fh) if gz else fh
        self.size = os.fstat(fh.fileno()).st_size if local and not gz else None

    def read(self, n: int) -> bytes:
        return self.f.read(n)

    def skip(self, n: int) -> bool:
        """Skip ``n`` bytes; False if the file ends first."""
        if self.size is not None:
            at = self.f.tell() + n
            self.f.seek(min(at, self.size))
            return at <= self.size
        while n > 0:
            got = len(self.f.read(min(n, 1 << 20)))
            if not got:
                return False
            n -= got
        return True


def _padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


META = (b"L", b"K", b"x", b"g")     # GNU long name / link, PAX headers: the next member's
NO_DATA = (b"1", b"2", b"3", b"4", b"5", b"6")   # links, devices, directories, FIFOs


def _header(b: _Blocks) -> Optional[bytes]:
    """The next header block (short if the tar ends early); None at a clean end. Zero blocks
    end an archive; another may follow them (``cat a.tar b.tar``)."""
    block = b.read(BLOCK)
    if block != ZERO:
        return block
    while block == ZERO:
        block = b.read(BLOCK)
    return block if block.strip(b"\0") else None


def _meta(b: _Blocks, kind: bytes, size: int, limit: int, pending: dict) -> bool:
    """Read a long-name or PAX header's data into ``pending``; False if the tar is damaged."""
    if size > max(limit, 1 << 20):
        return False
    data = b.read(_padded(size))
    if len(data) < _padded(size):
        return False
    if kind == b"L":
        pending["name"] = data[:size].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
    elif kind == b"x":
        pax = _pax(data[:size])
        pending.update({k: pax[v] for k, v in (("name", "path"), ("size", "size")) if v in pax})
    return True


def _member(b: _Blocks, block: bytes, pending: dict, names: list[str]) -> bool:
    """Skip a member's data, adding its name unless it is a directory or its data is cut
    short; False if the tar is damaged."""
    kind = block[156:157]
    name = pending.pop("name", None) or _name(block)
    size = int(pending.pop("size", _number(block[124:136])))
    if kind == b"S" and block[482]:          # GNU sparse: more map blocks follow
        ext = b.read(BLOCK)
        while len(ext) == BLOCK and ext[504]:
            ext = b.read(BLOCK)
    size = 0 if kind in NO_DATA else size
    if not b.skip(size):
        return False
    if kind != b"5" and not (kind in (b"0", b"\0") and name.endswith("/")):
        names.append(clean_text(name))
    return b.skip(_padded(size) - size)


def _member_names(b: _Blocks, limit: int, names: list[str]) -> bool:
    """Appends the names of the non-directory members to ``names``, in order; True if the tar
    is damaged (it ends early, or a header is not one)."""
    pending: dict[str, Any] = {}
    while (block := _header(b)) is not None:
        if len(block) < BLOCK or not _checksum_ok(block):
            return True
        kind = block[156:157]
        ok = _meta(b, kind, _number(block[124:136]), limit, pending) if kind in META \
            else _member(b, block, pending, names)
        if not ok:
            return True
    return False


def records_of(names: Iterable[str]) -> list[str]:
    """The WebDataset convention: consecutive members with one key (the path up to the first
    dot of the base name) are one record; an extension seen twice starts a new one; a member
    without an extension is no record's."""
    keys: list[str] = []
    exts: set[str] = set()
    for n in names:
        d, base = os.path.split(n)
        stem, _, ext = base.partition(".")
        if not ext:
            continue
        key, ext = (f"{d}/{stem}" if d else stem), ext.lower()
        if not keys or key != keys[-1] or ext in exts:
            keys.append(key)
            exts = set()
        exts.add(ext)
    return keys


def tar_keys(path: Path | ObjPath, limit: int) -> tuple[list[str], bool]:
    """(each record's key, in order; True when the tar is damaged: one more record)."""
    names: list[str] = []
    try:
        with open_regular(path) as fh:
            damaged = _member_names(_Blocks(fh, not isinstance(path, ObjPath)), limit, names)
    except (OSError, EOFError, zlib.error, ValueError, OverflowError):
        damaged = True     # (what was listed before the damage still counts)
    return records_of(names), damaged


def dir_keys(d: Path | ObjPath) -> list[str]:
    """img2dataset's files layout: a shard folder's files, by name, grouped by key."""
    entries = d.iterdir() if isinstance(d, ObjPath) else sorted(Path(d).iterdir())
    names = sorted(e.name for e in entries if not e.name.endswith(SKIP) and not e.is_dir())
    return records_of(clean_text(n) for n in names)


# --- img2dataset ----------------------------------------------------------------------------------
def _key_text(v: Any) -> Optional[str]:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, bytes):
        return v.decode("utf-8", "surrogateescape")
    return json.dumps(v, default=str)


def shard_records(samples: list[str], statuses: Path | ObjPath) -> int:
    """A shard's records: its status rows, plus its samples beyond the success rows of their
    key."""
    if not statuses.exists():
        return len(samples)
    try:
        with open_regular(statuses) as fh:
            pf = pq.ParquetFile(fh)
            cols = [c for c in ("key", "status") if c in pf.schema_arrow.names]
            rows = pf.read(columns=cols).to_pylist()
    except Exception:
        return len(samples) + 1      # its bad_file row
    success = Counter(_key_text(r.get("key")) for r in rows
                      if r.get("status") in (None, "success"))
    extra = sum(max(0, n - success[k]) for k, n in Counter(samples).items())
    return len(rows) + extra


def _i2d_tasks(root: Path | ObjPath, layout: str) -> dict[str, list]:
    """Per shard (keyed by its status file's path), in the tar or files ``layout``."""
    units: dict[str, list] = {}
    if layout == "tar":
        for t in _walk(root, TARS):          # (00000.tar and 00000.tar.gz share a status file)
            units.setdefault(str(status_file(t)), ["shard", [], str(status_file(t))])[1] \
                .append(str(t))
    elif layout == "files":
        for d in sorted(p for p in root.iterdir() if p.is_dir()):
            units[str(status_file(d))] = ["files", str(d), str(status_file(d))]
    for p in _walk(root, (".parquet",)):     # a status file without its shard; parquet layout
        units.setdefault(str(p), ["parquet", str(p)])
    return units


# --- a source ----------------------------------------------------------------------------------
def tasks(cfg: Any, captions: Optional[Path | ObjPath] = None,
          layout: str = "") -> dict[str, list]:
    """{unit: how to count it} for one source, from a listing of its files (``captions``: a
    folder source's captions file; ``layout``: an img2dataset source's, as the reader found
    it: tar, files or parquet). Counting is ``count_task``'s, unit by unit."""
    root = src_path(cfg.path)
    if cfg.kind == "folder":
        fmt = "jsonl" if captions.name.endswith(".jsonl") else \
            "\t" if captions.name.endswith(".tsv") else ","
        return {str(captions): ["text", str(captions), fmt]}
    if cfg.kind == "parquet":
        return {str(p): ["parquet", str(p)] for p in _walk(root, (".parquet",))}
    if cfg.kind == "webdataset":
        return {str(t): ["tar", str(t)] for t in _walk(root, TARS)}
    return _i2d_tasks(root, layout)


def count_task(root: str, limit: int, task: list) -> Count:
    """The records of one unit (``tasks``); ``root``: the source's path, ``limit``: its
    max_image_bytes."""
    kind = task[0]
    path = src_path(task[1], root) if isinstance(task[1], str) else None
    if kind == "text":
        with open_regular(path) as fh:
            return exact(jsonl_records(fh)) if task[2] == "jsonl" else table_records(fh, task[2])
    if kind == "parquet":
        return exact(parquet_rows(path))
    if kind == "tar":
        keys, damaged = tar_keys(path, limit)
        return exact(len(keys) + damaged)
    statuses = src_path(task[2], root)
    if kind == "files":
        return exact(shard_records(dir_keys(path), statuses))
    n = 0
    for t in task[1]:
        keys, damaged = tar_keys(src_path(t, root), limit)
        n += shard_records(keys, statuses) + damaged
    return exact(n)


def count(cfg: Any, captions: Optional[Path | ObjPath] = None,
          layout: str = "") -> dict[str, Count]:
    """{unit: Count} for one source, counted here (``tasks``, then ``count_task`` each)."""
    return {u: count_task(cfg.path, cfg.max_image_bytes, t)
            for u, t in tasks(cfg, captions, layout).items()}


def unit_of(cfg: Any, spec: dict, captions: Optional[Path | ObjPath] = None) -> str:
    """The unit a planned part's rows count towards."""
    if "plan" in spec:
        return str(captions)
    if "statuses_only" in spec:
        return spec["statuses_only"]
    if "dir" in spec:
        return str(status_file(src_path(spec["dir"], cfg.path)))
    if spec.get("statuses"):
        return str(status_file(src_path(spec["file"], cfg.path)))
    return spec["file"]



# --- the books ------------------------------------------------------------------------------------
def record(src: Any, specs: list[dict], name: str) -> dict:
    """What ``count_all`` and ``check`` need of one source, written when it is planned: how to
    count each unit (a listing only), each part's unit, and what narrows the source (then only
    its total can be checked)."""
    from . import readers
    captions = readers.captions_path(src) if src.kind == "folder" else None
    layout = readers.img2dataset_layout(src_path(src.path)) if src.kind == "img2dataset" else ""
    try:
        units, error = tasks(src, captions, layout), None
    except Exception as e:     # the check then says so: never a silent yes
        units, error = {}, f"{type(e).__name__}: {e}"
    return {"source": name, "root": src.path, "max_image_bytes": src.max_image_bytes,
            "units": units, "error": error, "parts": [unit_of(src, s, captions) for s in specs],
            "limit": src.limit, "sample": src.sample,
            "capped": src.kind == "folder" and src.max_captions_per_image is not None}


UNITS_PER_TASK = 64     # units counted by one item of count_all's map


def _count_units(item: tuple) -> list:
    root, limit, units = item
    out = []
    for unit, task in units:
        try:
            c = count_task(root, limit, task)
            out.append([unit, c.low, c.high, c.note])
        except Exception as e:   # (a file gone since the plan): said, never a silent yes
            out.append([unit, 0, 0, f"not counted: {type(e).__name__}: {e}"])
    return out


def count_all(records: list[dict], map_fn: Any = None) -> list[dict]:
    """Each record with its units' ``counts`` ([low, high, note]), counted by ``map_fn(fn,
    items)`` (in a run, the executor's map: Ray tasks over the cluster), UNITS_PER_TASK units
    an item."""
    items = []
    for rec in records:
        units = sorted(rec["units"].items())
        items += [(rec["root"], rec["max_image_bytes"], units[i:i + UNITS_PER_TASK])
                  for i in range(0, len(units), UNITS_PER_TASK)]
    found = (map_fn or (lambda f, xs: [f(x) for x in xs]))(_count_units, items)
    counts = {u: c for chunk in found for u, *c in chunk}
    return [dict(rec, counts={u: counts[u] for u in rec["units"]}) for rec in records]


def _within(n: int, low: int, high: int) -> bool:
    return low <= n <= high


def _said(low: int, high: int) -> str:
    return str(low) if low == high else f"{low} to {high}"


def _source_problems(rec: dict, rows: list[int]) -> list[str]:
    if rec["error"]:
        return [f"source {rec['source']!r}: the second count failed ({rec['error']})"]
    got: dict[str, int] = {}
    for unit, n in zip(rec["parts"], rows):
        got[unit] = got.get(unit, 0) + n
    units = rec["counts"]
    if rec["limit"] is not None or rec["capped"]:   # narrowed: the source's total only
        low = sum(u[0] for u in units.values())
        high = sum(u[1] for u in units.values())
        low = 0 if rec["capped"] else min(low, rec["limit"] or low)
        high = min(high, rec["limit"]) if rec["limit"] is not None else high
        total = sum(rows)
        return [] if _within(total, low, high) else [
            f"source {rec['source']!r}: {total} rows in, the second count says {_said(low, high)}"]
    out = []
    for unit in sorted(set(units) | set(got)):
        low, high, note = units.get(unit, [0, 0, "not in the source"])
        if not _within(got.get(unit, 0), low, high):
            out.append(f"{unit}: {got.get(unit, 0)} rows in, the second count says "
                       f"{_said(low, high)}" + (f" ({note})" if note else ""))
    return out


def check(records: list[dict], rows: list[int]) -> dict:
    """The ingest rows of each part (in plan order) against each source's second count
    (records from ``count_all``): what the run summary says (``second_count``) and every unit
    that does not balance (``lost``)."""
    out: dict = {"units": 0, "records": 0, "bounded": 0, "unchecked": [], "lost": []}
    at = 0
    for rec in records:
        part_rows, at = rows[at:at + len(rec["parts"])], at + len(rec["parts"])
        out["units"] += len(rec["counts"])
        out["records"] += sum(u[0] for u in rec["counts"].values() if u[0] == u[1])
        out["bounded"] += sum(u[0] != u[1] for u in rec["counts"].values())
        if rec["sample"] is not None and rec["sample"] < 1:
            out["unchecked"].append(rec["source"])
            continue
        out["lost"] += _source_problems(rec, part_rows)
    if at != len(rows):
        out["lost"].append(f"{len(rows)} parts written, {at} planned")
    return out
