"""The source's preflight (``IngestStage.preflight``): each source plans, a configured key or
extra column exists, and a folder source's first records find their images, read as the run
would read them."""
from __future__ import annotations

import itertools
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from vlcurate.schemas import F
from vlcurate.schemas import reasons as R
from vlcurate.stages.base import Finding

from . import readers, safe, textfiles
from .readers import SourceError, plan, read_part, src_path
from .sources import all_sources


def check_sources(source: Any) -> list[Finding]:
    """Each source plans (the reader's own checks: path, captions file, columns) into parts with
    records, and a configured key column exists."""
    return [f for i, s in enumerate(all_sources(source))
            for f in _check_one_source(s, "source" if i == 0 else f"source.also[{i - 1}]")]


def _check_one_source(s: Any, key: str) -> list[Finding]:
    try:
        with tempfile.TemporaryDirectory(prefix="vlcurate-preflight-") as tmp:
            specs = plan(s, Path(tmp) / "_plan.parquet")
            rows = _planned_rows(specs)
            columns = _planned_columns(specs) if s.kind != "folder" else _captions_columns(s)
            images = _sample_images(s, specs, key, Path(tmp))
    except (SourceError, OSError, ValueError) as e:
        return [Finding(False, f"{key}: {e}")]
    if not specs:
        return [Finding(False, f"{key}: {s.kind} source {s.path!r} holds no records (no parts)")]
    out = [Finding(True, f"{key}: {s.kind} {s.path} in {len(specs)} parts"
                         + (f", {rows} records" if rows is not None else ""))]
    if s.key_column and columns is not None and s.key_column not in columns:
        out.append(Finding(False, f"{key}.key_column: the source has no column {s.key_column!r} "
                                  f"(columns: {sorted(columns)}); set it to the column that names "
                                  "each record, so that sample_ids do not depend on row order"))
    out += [Finding(False, f"{key}.extra_columns: the source has no column {c!r} (columns: "
                           f"{sorted(columns)}); remove it from {key}.extra_columns or fix its "
                           "name")
            for c in s.extra_columns if columns is not None and c not in columns]
    return out + images


SAMPLE = 32      # the first records whose images and columns preflight looks at


def _captions_columns(s: Any) -> "set[str] | None":
    """A folder source's columns: its CSV/TSV header, or the fields of its first JSONL records."""
    path = readers.captions_path(s)
    with safe.open_regular(path) as fh:
        if path.suffix == ".jsonl":
            rows = [r for r, _, _ in itertools.islice(textfiles.read_jsonl(fh), SAMPLE) if r]
            return set().union(*rows) if rows else None
        header: list[str] = []
        next(textfiles.read_table(fh, b"\t" if path.suffix == ".tsv" else b",", header), None)
        return set(header)


def _sample_images(s: Any, specs: list[dict], key: str, tmp: Path) -> list[Finding]:
    """A folder source's first records, read by its own reader: when none of those that name an
    image finds it, ``images_dir`` or ``image_column`` is wrong, and every row would be
    ``ingest.missing_file``."""
    if s.kind != "folder" or not specs:
        return []
    first = pq.ParquetFile(specs[0]["plan"]).read_row_group(0).slice(0, SAMPLE)
    pq.write_table(first, tmp / "_sample.parquet")
    got = read_part(s, {"part": 0, "plan": str(tmp / "_sample.parquet"), "row_group": 0})
    named = [(ref, err) for ref, err in zip(got.column(F.IMAGE_REF.name).to_pylist(),
                                            got.column(F.READ_ERROR.name).to_pylist())
             if ref and err != R.BAD_RECORD]
    if not named or any(err != R.MISSING_FILE for _, err in named):
        return []
    where = src_path(s.path) / s.images_dir
    return [Finding(False, f"{key}.images_dir: none of the first {len(named)} records' images is "
                           f"in {where} (e.g. {named[0][0]!r} is not there); set {key}.images_dir "
                           f"(relative to {key}.path; \"\" for the folder itself), or "
                           f"{key}.image_column ({s.image_column!r}) to the column of image "
                           "file names")]


def _planned_rows(specs: list[dict]) -> "int | None":
    """Records in a folder source's plan (the other kinds count theirs only when read)."""
    if specs and "plan" in specs[0]:
        return pq.ParquetFile(specs[0]["plan"]).metadata.num_rows
    return None


def _planned_columns(specs: list[dict]) -> "set[str] | None":
    """Columns of a Parquet source's first file (None for the kinds whose planner checks them)."""
    for spec in specs[:1]:
        f = spec.get("file", "")
        if f.endswith(".parquet"):
            return set(pq.read_schema(f).names)
    return None
