"""The run directory: per-stage tables committed part by part, and one manifest per stage.

::

    <run_dir>/
      summary.parquet                 one MANIFEST row per stage of the last run
      <stage>/
        _manifest.json                written last: the stage is complete (MANIFEST schema)
        _attempt.json                 fingerprint of the attempt in progress (for resume)
        data/part-00000/              one directory per ingest part = the unit of commit
          rows-000000000-000000999.parquet
          _counts.json                rows, rows_in, rows_rejected, reason_counts of the part
        rejects/part-00000/...        the rows this stage flagged (REJECTS schema)
        _tmp/                         fragments of parts not yet committed

A part is committed by renaming its finished directory from ``_tmp/`` into ``data/``; readers
only ever look in ``data/``, so a killed run leaves nothing half-written that looks complete, and
a rerun redoes only the parts that have no committed directory.
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
        write_json(src / "data" / "_counts.json", counts)
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

    def schema(self) -> Optional[pa.Schema]:
        for f in sorted(self.data.glob("part-*/rows-*.parquet")):
            return pq.read_schema(f)
        return None


def _write_parquet(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp, compression="zstd")
    os.replace(tmp, path)


def _for_arrow(m: dict) -> dict:
    out = dict(m)
    for k in (F.M_UPSTREAM.name, F.M_REASON_COUNTS.name, F.M_VERSIONS.name):
        out[k] = list(out.get(k, {}).items())
    return out


def manifests_table(manifests: list[dict]) -> pa.Table:
    return conform(pa.Table.from_pylist([_for_arrow(m) for m in manifests], schema=tables.MANIFEST),
                   tables.MANIFEST)
