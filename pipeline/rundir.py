"""The run directory: per-stage tables committed part by part, and one manifest per stage.

::

    <run_dir>/
      summary.parquet                 one MANIFEST row per stage of the last run
      <stage>/
        _manifest.json                written last: the stage is complete (MANIFEST schema)
        _attempt.json                 fingerprint of the attempt in progress (for resume)
        data/part-00000/              one directory per ingest part = the unit of commit
          rows-000000000-000000999.parquet   the whole part, one file (bytes independent of
                                             batch size, concurrency and executor)
          _counts.json                the commit record: rows, rows_in, rows_rejected,
                                      reason_counts, and the size of every file of the part
        rejects/part-00000/...        the rows this stage flagged (REJECTS schema)
        _tmp/                         fragments of parts not yet committed

A part is committed by renaming its finished directory from ``_tmp/`` into ``data/``; readers
only ever look in ``data/``, so a killed run leaves nothing half-written that looks complete, and
a rerun redoes only the parts that have no committed directory. A rerun also verifies every
committed part against its commit record (``damaged``: files present with their recorded sizes,
Parquet footers readable, row counts as recorded) and redoes a damaged one.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from vlcurate.schemas import F, conform, tables

_PART = re.compile(r"^part-(\d{5,})$")


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def fingerprint(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(json.dumps(p, sort_keys=True, default=str).encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def part_name(part: int) -> str:
    return f"part-{part:05d}"


def fragment_name(r0: int, r1: int) -> str:
    return f"rows-{r0:09d}-{r1:09d}.parquet"


class StageDir:
    def __init__(self, run_dir: str | Path, stage: str, root: str | Path | None = None):
        self.run_dir = Path(run_dir)
        self.name = stage
        self.root = Path(root) if root else self.run_dir / stage
        self.data = self.root / "data"
        self.rejects = self.root / "rejects"
        self.tmp = self.root / "_tmp"
        self.manifest_path = self.root / "_manifest.json"
        self.attempt_path = self.root / "_attempt.json"

    # --- state -------------------------------------------------------------------------------
    def manifest(self) -> Optional[dict]:
        return read_json(self.manifest_path)

    def attempt(self) -> Optional[dict]:
        return read_json(self.attempt_path)

    def committed(self) -> list[int]:
        if not self.data.exists():
            return []
        out = []
        for d in self.data.iterdir():
            m = _PART.match(d.name)
            if m and (d / "_counts.json").exists():
                out.append(int(m.group(1)))
        return sorted(out)

    def part_counts(self, part: int) -> dict:
        counts = read_json(self.data / part_name(part) / "_counts.json")
        if counts is None:
            raise FileNotFoundError(f"{self.name}: part {part} is not committed")
        return counts

    # --- lifecycle ---------------------------------------------------------------------------
    def reset(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def begin(self, attempt: dict) -> None:
        """Start (or resume) an attempt: keep committed parts, drop uncommitted fragments."""
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)
        for stale in (self.manifest_path, self.root / "_state.pkl"):
            if stale.exists():
                stale.unlink()
        shutil.rmtree(self.root / "_prepare", ignore_errors=True)
        committed = set(self.committed())
        if self.rejects.exists():  # rejects whose data part never committed
            for d in self.rejects.iterdir():
                m = _PART.match(d.name)
                if m and int(m.group(1)) not in committed:
                    shutil.rmtree(d, ignore_errors=True)
        if self.data.exists():  # part dirs without _counts.json (should not exist, but be safe)
            for d in self.data.iterdir():
                m = _PART.match(d.name)
                if m and int(m.group(1)) not in committed:
                    shutil.rmtree(d, ignore_errors=True)
        write_json(self.attempt_path, attempt)

    def finish(self, manifest: dict) -> dict:
        row = conform(pa.Table.from_pylist([_for_arrow(manifest)], schema=tables.MANIFEST),
                      tables.MANIFEST)  # validates every field
        del row
        write_json(self.manifest_path, manifest)
        if self.attempt_path.exists():
            self.attempt_path.unlink()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return manifest

    # --- parts -------------------------------------------------------------------------------
    def write_fragment(self, part: int, r0: int, r1: int, data: pa.Table,
                       rejects: Optional[pa.Table]) -> None:
        """Write rows [r0, r1) of ``part`` under _tmp (invisible to readers until commit)."""
        d = self.tmp / part_name(part)
        (d / "data").mkdir(parents=True, exist_ok=True)
        name = fragment_name(r0, r1)
        _write_parquet(data, d / "data" / name)
        if rejects is not None and rejects.num_rows:
            (d / "rejects").mkdir(parents=True, exist_ok=True)
            _write_parquet(rejects, d / "rejects" / name)

    def commit(self, part: int, counts: dict) -> None:
        src = self.tmp / part_name(part)
        (src / "data").mkdir(parents=True, exist_ok=True)
        files = {k: _one_file(src / k, counts.get("rows", 0)) for k in ("data", "rejects")}
        write_json(src / "data" / "_counts.json", {**counts, "files": files})
        self.data.mkdir(parents=True, exist_ok=True)
        dst = self.data / part_name(part)
        rej_dst = self.rejects / part_name(part)
        shutil.rmtree(rej_dst, ignore_errors=True)
        if (src / "rejects").exists():
            self.rejects.mkdir(parents=True, exist_ok=True)
            os.replace(src / "rejects", rej_dst)
        shutil.rmtree(dst, ignore_errors=True)
        os.replace(src / "data", dst)  # the commit point
        shutil.rmtree(src, ignore_errors=True)

    def read(self, part: int, columns: Optional[Iterable[str]] = None) -> pa.Table:
        d = self.data / part_name(part)
        files = sorted(d.glob("rows-*.parquet"))
        if not files:
            raise FileNotFoundError(f"{self.name}: part {part} is not committed ({d})")
        cols = list(columns) if columns is not None else None
        parts = [pq.read_table(f, columns=cols) for f in files]
        return pa.concat_tables(parts) if len(parts) > 1 else parts[0]

    def damaged(self, n_parts: int) -> list[int]:
        """The parts that are not committed, or whose files no longer match their commit record
        (missing, resized, unreadable footer, wrong row count). Cheap: sizes and footers only."""
        return [p for p in range(n_parts) if not self._intact(p)]

    def _intact(self, part: int) -> bool:
        rec = read_json(self.data / part_name(part) / "_counts.json")
        if rec is None:
            return False
        files = rec.get("files") or {"data": {f.name: f.stat().st_size for f in
                                              (self.data / part_name(part)).glob("rows-*.parquet")}}
        rows = {}
        for kind, names in files.items():
            d = self.root / kind / part_name(part)
            rows[kind] = 0
            for name, size in names.items():
                f = d / name
                try:
                    if f.stat().st_size != size:
                        return False
                    rows[kind] += pq.read_metadata(f).num_rows
                except (OSError, pa.ArrowException):
                    return False
            if kind == "rejects" and d.exists() and {x.name for x in d.iterdir()} != set(names):
                return False
        return bool(files.get("data")) and rows["data"] == rec.get("rows", 0)

    def uncommit(self, parts: Iterable[int]) -> None:
        """Drop committed parts (to redo them): data first, so a kill leaves them uncommitted."""
        for p in parts:
            shutil.rmtree(self.data / part_name(p), ignore_errors=True)
            shutil.rmtree(self.rejects / part_name(p), ignore_errors=True)

    def schema(self) -> Optional[pa.Schema]:
        for f in sorted(self.data.glob("part-*/rows-*.parquet")):
            return pq.read_schema(f)
        return None


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


def _write_parquet(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(canonical(table), tmp, compression="zstd")
    os.replace(tmp, path)


def _one_file(d: Path, rows: int) -> dict[str, int]:
    """Merge the fragments in ``d`` (one per batch) into the part's one file, named for the
    whole part, so the committed bytes never depend on how the part was batched; {name: size}."""
    files = sorted(d.glob("rows-*.parquet")) if d.exists() else []
    name = d / fragment_name(0, rows)
    if len(files) > 1:
        _write_parquet(pa.concat_tables([pq.read_table(f) for f in files],
                                        promote_options="default"), name)
        for f in files:
            if f != name:
                f.unlink()
    elif files and files[0] != name:
        os.replace(files[0], name)
    return {name.name: name.stat().st_size} if files else {}


def _for_arrow(m: dict) -> dict:
    out = dict(m)
    for k in (F.M_UPSTREAM.name, F.M_REASON_COUNTS.name, F.M_VERSIONS.name):
        out[k] = list(out.get(k, {}).items())
    return out


def manifests_table(manifests: list[dict]) -> pa.Table:
    return conform(pa.Table.from_pylist([_for_arrow(m) for m in manifests], schema=tables.MANIFEST),
                   tables.MANIFEST)
