"""The run directory: per-stage tables committed part by part, and one manifest per stage. It is
a local folder or any URI ``storage`` opens (``s3://``, ``gs://``, ...): one code path for both,
with no rename anywhere (an object store has none).

::

    <run_dir>/
      summary.parquet                 one MANIFEST row per stage of the last run
      <stage>/
        _manifest.json                written last: the stage is complete (MANIFEST schema)
        _attempt.json                 the attempt in progress: fingerprint (for resume) and
                                      ``attempt``, a random id chosen by ``begin``
        _commit/part-00007.json       the commit record of part 7, written last: rows, rows_in,
                                      rows_rejected, reason_counts, and the name and size of every
                                      file of the part (``files``: {"data": {..}, "rejects": {..}})
        data/part-00007/rows-000000000-000000999-<attempt>.parquet
                                      the whole part, one file (bytes independent of batch size,
                                      concurrency and executor; only the name carries the attempt)
        rejects/part-00007/rows-...-<attempt>.parquet   the rows this stage flagged (REJECTS)

The commit protocol. Workers write each batch's rows as a fragment under an attempt-unique name
(``rows-<first>-<end>-<attempt>.parquet``) in the part's folder. Once every row of the part is
in, ``commit`` merges the fragments into the part's one file and then writes the commit record,
which names the exact files: that PUT is the commit point. Readers look only at commit records
and read only the files a record names (never a LIST per part): a killed run leaves nothing
half-written that looks committed, a rerun redoes only the parts with no record, and files of a
stale attempt (a killed run's fragments, a torn write) are never read, and are deleted by
``commit`` (its own part), ``begin`` and ``finish`` (every part with no record). Re-committing a
part is idempotent: the same files, the same record. A rerun verifies every committed part against
its record (``damaged``: files present with their recorded sizes, Parquet footers readable, row
counts as recorded) and redoes a damaged one.

Listing: ``committed()`` is one LIST of ``_commit/``; ``read(part)`` is one GET of the record and
the reads of the named files; ``damaged`` adds one recursive LIST per kind (data, rejects) for the
sizes, never one per part. Run directories written before this protocol
(``data/part-N/_counts.json`` beside the files, committed by rename) are read as they are;
``begin`` writes their records.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import uuid
from typing import Any, Iterable, Optional

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from vlcurate.schemas import F, conform, tables

from vlcurate.foundation import storage

_PART = re.compile(r"^part-(\d{5,})$")
_RECORD = re.compile(r"^part-(\d{5,})\.json$")
_FILE = re.compile(r"^rows-(\d{9,})-(\d{9,})(?:-([0-9a-z]+))?\.parquet$")
KINDS = ("data", "rejects")
LEGACY_RECORD = "_counts.json"      # the commit record of the rename protocol, inside data/part-N/


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def fingerprint(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def write_json(uri: Any, obj: Any) -> None:
    """Write ``obj`` as JSON to a path or URI, atomically (``storage.write_bytes``)."""
    storage.write_json(str(uri), obj)


def read_json(uri: Any) -> Optional[dict]:
    """The JSON object at a path or URI; None when it is missing or not valid JSON."""
    return storage.read_json(str(uri))


def write_table(uri: Any, table: pa.Table, **options: Any) -> int:
    """Write a Parquet file (``summary.parquet``, a part's file) to a path or URI; its size."""
    fs, path = storage.resolve(str(uri))
    storage.ensure_parent(fs, path)
    with fs.open_output_stream(path) as f:
        pq.write_table(table, f, **options)
        return f.tell()


def part_name(part: int) -> str:
    return f"part-{part:05d}"


def fragment_name(r0: int, r1: int, attempt: Optional[str] = None) -> str:
    return f"rows-{r0:09d}-{r1:09d}" + (f"-{attempt}" if attempt else "") + ".parquet"


def without_attempt(name: str) -> str:
    """A part file's name less its attempt id: what stays equal from one run to the next."""
    m = _FILE.match(name)
    return fragment_name(int(m.group(1)), int(m.group(2))) if m else name


class StageDir:
    def __init__(self, run_dir: Any, stage: str, root: Any = None):
        self.run_dir = str(run_dir)
        self.name = stage
        self.root = str(root) if root else storage.join(self.run_dir, stage)
        self.data = storage.join(self.root, "data")
        self.rejects = storage.join(self.root, "rejects")
        self.commits = storage.join(self.root, "_commit")
        self.tmp = storage.join(self.root, "_tmp")
        self.manifest_path = storage.join(self.root, "_manifest.json")
        self.attempt_path = storage.join(self.root, "_attempt.json")
        self._attempt: Optional[str] = None
        self._legacy = False

    # --- files of the stage ------------------------------------------------------------------
    def uri(self, *names: str) -> str:
        """The path or URI of a file of this stage (``sd.uri("_info.json")``)."""
        return storage.join(self.root, *names)

    def read_json(self, name: str) -> Optional[dict]:
        return storage.read_json(self.uri(name))

    def write_json(self, name: str, obj: Any) -> None:
        storage.write_json(self.uri(name), obj)

    def part_uri(self, kind: str, part: int, name: str = "") -> str:
        return storage.join(self.root, kind, part_name(part), name)

    def record_uri(self, part: int) -> str:
        return storage.join(self.commits, f"{part_name(part)}.json")

    # --- state -------------------------------------------------------------------------------
    def manifest(self) -> Optional[dict]:
        return read_json(self.manifest_path)

    def attempt(self) -> Optional[dict]:
        return read_json(self.attempt_path)

    def attempt_id(self) -> str:
        """The id of the attempt in progress (chosen by ``begin``, read from _attempt.json)."""
        if self._attempt is None:
            self._attempt = (self.attempt() or {}).get("attempt")
            if not self._attempt:
                raise RuntimeError(f"{self.name}: no attempt in progress ({self.attempt_path})")
        return self._attempt

    def committed(self) -> list[int]:
        """The committed parts: one LIST of the commit records."""
        out = sorted(int(m.group(1)) for i in storage.listdir(self.commits)
                     if (m := _RECORD.match(i.base_name)))
        if out:
            return out
        legacy = sorted(int(m.group(1)) for i in storage.list_files(self.data)
                        if i.base_name == LEGACY_RECORD
                        and (m := _PART.match(i.path.rstrip("/").split("/")[-2])))
        self._legacy = bool(legacy)
        return legacy

    def record(self, part: int) -> Optional[dict]:
        """The commit record of ``part`` (None: not committed)."""
        rec = read_json(self.record_uri(part))
        if rec is None:    # a run directory of the rename protocol
            rec = read_json(self.part_uri("data", part, LEGACY_RECORD))
        return rec

    def part_counts(self, part: int) -> dict:
        counts = self.record(part)
        if counts is None:
            raise FileNotFoundError(f"{self.name}: part {part} is not committed")
        return counts

    def files(self, part: int, kind: str = "data") -> dict[str, int]:
        """{file name: size} of a committed part's ``kind`` (data or rejects)."""
        return dict(self.part_counts(part).get("files", {}).get(kind, {}))

    # --- lifecycle ---------------------------------------------------------------------------
    def reset(self) -> None:
        storage.delete(self.root)

    def begin(self, attempt: dict) -> None:
        """Start (or resume) an attempt under a new attempt id: keep committed parts, delete
        every file no commit record names."""
        if storage.is_local(self.root):
            storage.makedirs(self.root)
        for stale in (self.manifest_path, self.uri("_state.pkl"), self.uri("_prepare"), self.tmp):
            storage.delete(stale)
        committed = self.committed()
        if self._legacy:   # give parts of the rename protocol their records
            for p in committed:
                write_json(self.record_uri(p), self.record(p))
        self.sweep(set(committed))
        self._attempt = uuid.uuid4().hex[:8]
        write_json(self.attempt_path, {**attempt, "attempt": self._attempt})

    def finish(self, manifest: dict) -> dict:
        row = conform(pa.Table.from_pylist([_for_arrow(manifest)], schema=tables.MANIFEST),
                      tables.MANIFEST)  # validates every field
        del row
        self.sweep(set(self.committed()))
        write_json(self.manifest_path, manifest)
        storage.delete(self.attempt_path)
        storage.delete(self.tmp)
        return manifest

    def sweep(self, committed: set[int]) -> None:
        """Delete the files of stale attempts: every part folder with no commit record, and the
        files its record does not name in a committed part that holds more than one file of a
        kind (one recursive LIST a kind; a record is read only for such a part)."""
        found: dict[int, list[pafs.FileInfo]] = {}
        crowded = set()
        for kind in KINDS:
            seen = set()
            for info in storage.list_files(storage.join(self.root, kind)):
                m = _PART.match(info.path.rstrip("/").split("/")[-2])
                if m and _FILE.match(info.base_name):
                    p = int(m.group(1))
                    found.setdefault(p, []).append(info)
                    crowded |= {p} & seen
                    seen.add(p)
        for p, infos in found.items():
            if p not in committed:
                self._drop(p)
            elif p in crowded:
                named = {n for kind in KINDS for n in self.files(p, kind)} | {LEGACY_RECORD}
                _delete_files([i for i in infos if i.base_name not in named], self.root)

    def _drop(self, part: int) -> None:
        for kind in KINDS:
            storage.delete(self.part_uri(kind, part))

    # --- parts -------------------------------------------------------------------------------
    def write_fragment(self, part: int, r0: int, r1: int, data: pa.Table,
                       rejects: Optional[pa.Table]) -> None:
        """Write rows [r0, r1) of ``part`` under this attempt's name (invisible to readers until
        a commit record names it)."""
        name = fragment_name(r0, r1, self.attempt_id())
        _write_parquet(data, self.part_uri("data", part, name))
        if rejects is not None and rejects.num_rows:
            _write_parquet(rejects, self.part_uri("rejects", part, name))

    def commit(self, part: int, counts: dict) -> None:
        """Merge this attempt's fragments of ``part`` into its one file per kind, write the commit
        record (the commit point), then delete every other file of the part."""
        att, rows = self.attempt_id(), counts.get("rows", 0)
        listed = {k: storage.list_files(self.part_uri(k, part)) for k in KINDS}
        mine = {k: {_range(i.base_name): i for i in v if _attempt_of(i.base_name) == att}
                for k, v in listed.items()}
        ranges = _tiling(sorted(mine["data"]), rows, f"{self.name} part {part}")
        files = {k: self._one_file(k, part, [mine[k][r] for r in ranges if r in mine[k]], rows)
                 for k in KINDS}
        write_json(self.record_uri(part), {**counts, "files": files})
        _delete_files([i for k in KINDS for i in listed[k] if i.base_name not in files[k]],
                      self.root)

    def _one_file(self, kind: str, part: int, frags: list[pafs.FileInfo], rows: int
                  ) -> dict[str, int]:
        """The part's one file of ``kind``, named for the whole part so that the committed bytes
        never depend on how the part was batched: {name: size}."""
        name = fragment_name(0, rows, self.attempt_id())
        uri = self.part_uri(kind, part, name)
        if not frags:
            return {}
        if len(frags) == 1 and frags[0].base_name == name:
            return {name: frags[0].size}
        if len(frags) == 1:
            fs, path = storage.resolve(uri)
            fs.copy_file(frags[0].path, path)
            return {name: frags[0].size}
        fs, _ = storage.resolve(uri)
        parts = [_read_parquet(fs, f.path) for f in frags]
        return {name: _write_parquet(pa.concat_tables(parts, promote_options="default"), uri)}

    def read(self, part: int, columns: Optional[Iterable[str]] = None,
             kind: str = "data") -> pa.Table:
        """A committed part's table (``kind="rejects"``: its rejects, maybe empty): the files its
        commit record names, never a LIST."""
        rec = self.record(part)
        if rec is None:
            raise FileNotFoundError(f"{self.name}: part {part} is not committed ({self.root})")
        cols = list(columns) if columns is not None else None
        names = sorted(rec.get("files", {}).get(kind, {}))
        if not names and kind == "data":
            raise FileNotFoundError(f"{self.name}: part {part}'s record names no file")
        if not names:
            return tables.REJECTS.empty_table().select(cols or tables.REJECTS.names)
        fs, _ = storage.resolve(self.root)
        parts = [_read_parquet(fs, storage.resolve(self.part_uri(kind, part, n))[1], cols)
                 for n in names]
        return pa.concat_tables(parts) if len(parts) > 1 else parts[0]

    def read_all(self, columns: Optional[Iterable[str]] = None, kind: str = "data") -> pa.Table:
        """Every committed part, in part order (one LIST, then the records' files)."""
        parts = [self.read(p, columns, kind) for p in self.committed()]
        return pa.concat_tables(parts, promote_options="default") if parts else \
            pa.table({}) if kind == "data" else tables.REJECTS.empty_table()

    def damaged(self, n_parts: int) -> list[int]:
        """The parts that are not committed, or whose files no longer match their commit record
        (missing, resized, unreadable footer, wrong row count). Cheap: one LIST of the records,
        one recursive LIST a kind for the sizes, then each part's record and footers."""
        committed = set(self.committed())
        fs, _ = storage.resolve(self.root)
        sizes = {i.path: i.size for k in KINDS
                 for i in storage.list_files(storage.join(self.root, k))}
        return [p for p in range(n_parts) if p not in committed or not self._intact(p, fs, sizes)]

    def _intact(self, part: int, fs: pafs.FileSystem, sizes: dict[str, int]) -> bool:
        rec = self.record(part)
        files = (rec or {}).get("files") or {}
        rows = {}
        for kind, names in files.items():
            rows[kind] = 0
            for name, size in names.items():
                path = storage.resolve(self.part_uri(kind, part, name))[1]
                if sizes.get(path) != size:
                    return False
                try:
                    with fs.open_input_file(path) as f:
                        rows[kind] += pq.read_metadata(f).num_rows
                except (OSError, pa.ArrowException):
                    return False
        return bool(files.get("data")) and rows["data"] == rec.get("rows", 0)

    def uncommit(self, parts: Iterable[int]) -> None:
        """Drop committed parts (to redo them): the record first, so a kill leaves them
        uncommitted, then their files."""
        for p in parts:
            storage.delete(self.record_uri(p))
            self._drop(p)

    def schema(self) -> Optional[pa.Schema]:
        for p in self.committed()[:1]:
            name = sorted(self.files(p))[0]
            fs, path = storage.resolve(self.part_uri("data", p, name))
            with fs.open_input_file(path) as f:
                return pq.read_schema(f)
        return None


def _attempt_of(name: str) -> Optional[str]:
    m = _FILE.match(name)
    return m.group(3) if m else None


def _range(name: str) -> tuple[int, int]:
    m = _FILE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


def _tiling(ranges: list[tuple[int, int]], rows: int, what: str) -> list[tuple[int, int]]:
    """The fragments that make up rows [0, rows): the whole-part file when there is one (a
    re-commit), else consecutive fragments from row 0."""
    if (0, rows) in ranges:
        return [(0, rows)]
    out, at = [], 0
    for r0, r1 in ranges:
        if r0 == at and r1 > r0:
            out.append((r0, r1))
            at = r1
    if at != rows:
        raise RuntimeError(f"{what}: its fragments cover rows [0, {at}), not [0, {rows})")
    return out


def _delete_files(infos: list[pafs.FileInfo], root: str) -> None:
    fs, _ = storage.resolve(root)
    for i in infos:
        try:
            fs.delete_file(i.path)
        except FileNotFoundError:
            pass


CANONICAL_CHUNK = 1024   # rows per Arrow chunk when writing: Parquet bytes depend on chunking


def _as_read(t: pa.DataType) -> pa.DataType:
    """The type Parquet gives back: list items are named "element" (the stored Arrow schema
    would otherwise keep "item" for a table written from memory, "element" for one read back)."""
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_as_read(f.type)) for f in t])
    if pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t):
        item = pa.field("element", _as_read(t.value_type), t.value_field.nullable)
        return (pa.list_(item, t.list_size) if pa.types.is_fixed_size_list(t)
                else pa.large_list(item) if pa.types.is_large_list(t) else pa.list_(item))
    return t


def canonical(table: pa.Table) -> pa.Table:
    """The same rows with a fixed chunk layout and the types Parquet reads back, so equal tables
    write equal Parquet bytes however they were assembled (in memory or from fragments)."""
    schema = pa.schema([f.with_type(_as_read(f.type)) for f in table.schema],
                       metadata=table.schema.metadata)
    table = table.cast(schema)   # unconditional: Schema equality ignores list item names
    n = table.num_rows
    if n <= CANONICAL_CHUNK:
        return table.combine_chunks()
    return pa.concat_tables([table.slice(lo, CANONICAL_CHUNK).combine_chunks()
                             for lo in range(0, n, CANONICAL_CHUNK)])


def _write_parquet(table: pa.Table, uri: str) -> int:
    """Write ``table`` (canonical chunks, zstd) to a path or URI; its size in bytes."""
    return write_table(uri, canonical(table), compression="zstd")


def _read_parquet(fs: pafs.FileSystem, path: str, columns: Optional[list[str]] = None) -> pa.Table:
    with fs.open_input_file(path) as f:
        return pq.read_table(f, columns=columns)


def _for_arrow(m: dict) -> dict:
    out = dict(m)
    for k in (F.M_UPSTREAM.name, F.M_REASON_COUNTS.name, F.M_VERSIONS.name):
        out[k] = list(out.get(k, {}).items())
    return out


def manifests_table(manifests: list[dict]) -> pa.Table:
    return conform(pa.Table.from_pylist([_for_arrow(m) for m in manifests], schema=tables.MANIFEST),
                   tables.MANIFEST)
