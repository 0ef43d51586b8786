"""A run's sources: the configured ``source`` plus any in ``source.also`` (or a top-level
``sources:`` list, which the config loader turns into that), each planned and read by
``readers``, and narrowed for quick trials by ``source.sample`` and ``source.limit``.

- **Several sources.** Their parts follow each other in config order (part numbers continue);
  each spec remembers its source. Names must differ: ``sample_id`` hashes (source name, key),
  so the same key in two sources gives two ids.
- **sample** (a share in (0, 1]): a record is read iff its ``sample_id``, read as a fraction of
  2^64, is below the share. That depends only on the source name and the record's key, never
  on the order or the parts, and a smaller share's sample is inside a larger one's.
- **limit**: the first ``limit`` records of the source (after ``sample``) in plan order. The
  plan counts records part by part until the limit is reached: from the plan itself for folder
  sources, from the row-group metadata for Parquet, by reading the part otherwise (tars), which
  is cheap for the small limits of a trial. Later parts are not planned at all.

Records left out by sample or limit are not ingested: they are neither rows nor rejects, and
the run's summary says how the source was narrowed (``notes``).

- **The second count.** ``plan`` also lists every source's files for ``census`` (in
  ``_census.json`` beside the plan), with the unit each part's rows count towards; the stage
  counts them after its parts ran and checks the books (``IngestStage.finalize``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from vlcurate.foundation import storage
from vlcurate.schemas import F

from . import census, readers

SOURCE_KEY = "source"        # a spec's index into all_sources(...)
CENSUS = "_census.json"


def sample_id(source: str, key: str) -> str:
    """Stable across runs and machines: derived from the source name and the record's key."""
    return hashlib.blake2b(f"{source}\0{key}".encode("utf-8", "surrogateescape"),
                           digest_size=8).hexdigest()


def all_sources(cfg: Any) -> list[Any]:
    """The configured source first (without its ``also``), then each of ``also``."""
    return [dataclasses.replace(cfg, also=()), *cfg.also] if cfg.also else [cfg]


def _in_sample(name: str, keys: list, share: float) -> list[bool]:
    bound = share * 2.0 ** 64
    return [int(sample_id(name, k or ""), 16) < bound for k in keys]


def _narrow(src: Any, table: pa.Table, limit: int | None) -> pa.Table:
    if src.sample is not None and src.sample < 1:
        keys = table.column(F.KEY.name).to_pylist()
        table = table.filter(pa.array(_in_sample(readers.source_name(src), keys, src.sample)))
    return table if limit is None else table.slice(0, limit)


def _plan_uri(plan_uri: str, i: int) -> str:
    """Source 0 keeps the stage's plan file name (a one-source run is unchanged)."""
    return str(plan_uri) if i == 0 else f"{str(plan_uri).removesuffix('.parquet')}-{i}.parquet"


def _count(src: Any, spec: dict) -> int:
    """Records of a part after ``sample``: cheaply where the plan knows them."""
    if "plan" in spec:                        # a folder source: the plan holds every key
        fs, path = storage.resolve(spec["plan"])
        with fs.open_input_file(path) as fh:
            keys = pq.ParquetFile(fh).read_row_group(spec["row_group"], columns=[F.KEY.name])
        return _narrow(src, keys, None).num_rows
    if "rows" in spec and src.sample is None:  # a Parquet row group
        return spec["rows"]
    return _narrow(src, readers.read_part(src, spec), None).num_rows


def _limited(src: Any, specs: list[dict]) -> list[dict]:
    if src.limit is None:
        return specs
    out, left = [], src.limit
    for spec in specs:
        if left <= 0:
            break
        n = _count(src, spec)
        out.append(dict(spec, limit=left) if n > left else spec)
        left -= n
    return out


def plan(cfg: Any, plan_uri: str) -> list[dict]:
    """Every source's parts, and its second count (``census``) beside the plan."""
    specs, books = [], []
    for i, src in enumerate(all_sources(cfg)):
        mine = _limited(src, readers.plan(src, _plan_uri(plan_uri, i)))
        books.append(census.record(src, mine, readers.source_name(src)))
        for spec in mine:
            specs.append(dict(spec, part=len(specs), **({SOURCE_KEY: i} if i else {})))
    storage.write_bytes(census_uri(plan_uri), json.dumps(books).encode())
    return specs


def census_uri(plan_uri: str) -> str:
    """The second count's file, beside the plan (``<run>/ingest/_census.json``)."""
    path, q, query = str(plan_uri).partition("?")
    folder = path.rsplit("/", 1)[0] + "/" if "/" in path else ""
    return f"{folder}{CENSUS}{q}{query}"


def read_part(cfg: Any, spec: dict) -> pa.Table:
    src = all_sources(cfg)[spec.get(SOURCE_KEY, 0)]
    return _narrow(src, readers.read_part(src, spec), spec.get("limit"))


def signature(cfg: Any) -> str:
    sigs = [readers.signature(src) for src in all_sources(cfg)]
    return sigs[0] if len(sigs) == 1 else hashlib.sha256("\n".join(sigs).encode()).hexdigest()[:16]


def notes(cfg: Any) -> list[str]:
    """How each source is narrowed, for the run's summary."""
    out = []
    for src in all_sources(cfg):
        how = [f"a {src.sample:g} sample by sample_id"] if src.sample is not None else []
        how += [f"at most its first {src.limit} records"] if src.limit is not None else []
        if how:
            out.append(f"source {readers.source_name(src)!r}: {' and '.join(how)} "
                       "(source.sample / source.limit; the rest is not ingested)")
    return out


def check(cfg: Any) -> list[tuple[str, str]]:
    """Problems between the sources: a nested ``also``, two sources of one name."""
    out, seen = [], set()
    for i, src in enumerate(cfg.also):
        if src.also:
            out.append((f"also[{i}].also", "sources do not nest: list every source in one list"))
    for src in all_sources(cfg):
        name = readers.source_name(src)
        if name in seen:
            out.append(("name", f"two sources are named {name!r}: give each its own "
                                "source name (sample_ids hash it)"))
        seen.add(name)
    return out
