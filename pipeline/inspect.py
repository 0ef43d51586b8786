"""``vlcurate inspect RUN_DIR``: what happened in a run, for a person at a terminal."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds

from vlcurate.schemas import F

from .rundir import StageDir, read_json


def stage_names(run_dir: Path) -> list[str]:
    """The run's stages in DAG order (from run.json), else every folder holding a manifest."""
    run = read_json(run_dir / "run.json") or {}
    return run.get("dag") or sorted(p.name for p in run_dir.iterdir() if (p / "_manifest.json").exists())


def run_config(run_dir: Path) -> dict:
    """The config snapshot of run.json (an empty dict when there is none)."""
    return (read_json(run_dir / "run.json") or {}).get("config", {})


def stage_dir(run_dir: Path, name: str, config: dict | None = None,
              export_dir: Path | None = None) -> StageDir:
    """A stage's folder; export's may live elsewhere (``export.out_dir``, or ``export_dir``: a
    re-export written with ``vlcurate export --out``)."""
    cfg = run_config(run_dir) if config is None else config
    root = (export_dir or cfg.get("export", {}).get("out_dir")) if name == "export" else None
    return StageDir(run_dir, name, root)


def _table(path: Path, columns=None) -> pa.Table:
    return ds.dataset(path, format="parquet").to_table(columns=columns)


def inspect_run(run_dir: Path, examples: int = 3, rows: int = 5,
                export_dir: Path | None = None) -> str:
    if not (run_dir / "run.json").exists():
        raise SystemExit(f"error: {run_dir} is not a vlcurate run directory (no run.json)")
    if export_dir is not None and not (export_dir / "_manifest.json").exists():
        raise SystemExit(f"error: {export_dir} is not a finished export (no _manifest.json)")
    cfg = run_config(run_dir)
    out = [f"run: {run_dir.resolve()}" + (f"  (export: {export_dir.resolve()})" if export_dir
                                           else "")]
    ingest = StageDir(run_dir, "ingest")
    captions = {}
    if ingest.data.exists():
        t = _table(ingest.data, [F.SAMPLE_ID.name, F.KEY.name, F.CAPTION.name, F.IMAGE_REF.name])
        captions = {r[F.SAMPLE_ID.name]: r for r in t.to_pylist()}
    for name in stage_names(run_dir):
        sd = stage_dir(run_dir, name, cfg, export_dir)
        m = sd.manifest()
        if m is None:
            att = sd.attempt()
            out.append(f"\n== {name}: incomplete ({len(sd.committed())}/{(att or {}).get('parts', '?')}"
                       " parts committed; rerun to resume)")
            continue
        out.append(f"\n== {name}  ({m['parts']} parts, {m['wall_s']:.1f}s, fingerprint {m['fingerprint']})")
        out.append(f"   rows {m['rows']}  in {m['rows_in']}  kept {m['rows_kept']}  "
                   f"rejected {m['rows_rejected']}")
        if sd.rejects.exists() and m["rows_rejected"]:
            found: dict[str, list[dict]] = {}
            for r in _table(sd.rejects).to_pylist():
                for reason in r[F.REASONS.name] or []:
                    if len(found.setdefault(reason, [])) < examples:
                        found[reason].append(r)
            for reason, n in sorted(m["reason_counts"].items(), key=lambda kv: -kv[1]):
                out.append(f"   {reason}: {n}")
                for r in found.get(reason, []):
                    c = captions.get(r[F.SAMPLE_ID.name], {})
                    cap = (c.get(F.CAPTION.name) or "")[:50]
                    out.append(f"      {r[F.SAMPLE_ID.name]}  {c.get(F.KEY.name, '')!s:<22} "
                               f"{cap!r:<40} {r[F.REASON_DETAIL.name] or ''}"[:170])
        schema = sd.schema()
        if schema is not None:
            cols = ", ".join(f"{f.name}: {f.type}" for f in schema)
            out.append(f"   schema: {cols}"[:600])
    exp = stage_dir(run_dir, "export", cfg, export_dir)
    if exp.data.exists() and rows:
        t = _table(exp.data)
        show = [c for c in (F.SAMPLE_ID.name, F.KEY.name, F.CAPTION.name, F.WIDTH.name,
                            F.HEIGHT.name, F.KEEP.name, F.ALL_REASONS.name) if c in t.column_names]
        out.append(f"\n== first {rows} rows of the annotated table ({exp.data})")
        import pandas as pd
        with pd.option_context("display.width", 160, "display.max_colwidth", 48):
            out.append(t.select(show).slice(0, rows).to_pandas().to_string(index=False))
        shards = exp.root / "shards" / "manifest.json"
        if shards.exists():
            sm = json.loads(shards.read_text())
            out.append(f"\nshards: {sm['samples']} samples in {sm['shards']} files, "
                       f"{sm['bytes'] / 1e6:.1f} MB, policy drop={sm['policy']['drop']} "
                       f"({exp.root / 'shards'})")
    return "\n".join(out)
