"""``vlcurate inspect RUN_DIR``: what happened in a run, for a person at a terminal."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import pyarrow as pa

from vlcurate.schemas import F
from vlcurate.schemas import embed as E

from vlcurate.foundation import storage
from .rundir import StageDir, read_json


def display(run_dir: Any) -> str:
    """A run directory as shown to a person: absolute when local, redacted when a URI."""
    return storage.redact(str(run_dir)) if not storage.is_local(str(run_dir)) else \
        storage.resolve(str(run_dir))[1]


def stage_names(run_dir: Any) -> list[str]:
    """The run's stages in DAG order (from run.json), else every folder holding a manifest."""
    run = read_json(storage.join(str(run_dir), "run.json")) or {}
    return run.get("dag") or sorted(
        i.base_name for i in storage.listdir(str(run_dir)) if i.type.name == "Directory"
        and storage.exists(storage.join(str(run_dir), i.base_name, "_manifest.json")))


def run_config(run_dir: Any) -> dict:
    """The config snapshot of run.json (an empty dict when there is none)."""
    return (read_json(storage.join(str(run_dir), "run.json")) or {}).get("config", {})


def is_run_dir(run_dir: Any) -> bool:
    return storage.exists(storage.join(str(run_dir), "run.json"))


def stage_dir(run_dir: Any, name: str, config: Optional[dict] = None,
              export_dir: Any = None) -> StageDir:
    """A stage's folder; export's may live elsewhere (``export.out_dir``, or ``export_dir``: a
    re-export written with ``vlcurate export --out``)."""
    cfg = run_config(run_dir) if config is None else config
    root = (export_dir or cfg.get("export", {}).get("out_dir")) if name == "export" else None
    return StageDir(run_dir, name, root)


def inspect_run(run_dir: Any, examples: int = 3, rows: int = 5, export_dir: Any = None) -> str:
    run_dir = str(run_dir)
    if not is_run_dir(run_dir):
        raise SystemExit(f"error: {display(run_dir)} is not a vlcurate run directory (no run.json)")
    if export_dir is not None and not StageDir(run_dir, "export", export_dir).manifest():
        raise SystemExit(f"error: {display(export_dir)} is not a finished export "
                         "(no _manifest.json)")
    cfg = run_config(run_dir)
    out = [f"run: {display(run_dir)}" + (f"  (export: {display(export_dir)})" if export_dir
                                         else "")]
    ingest = StageDir(run_dir, "ingest")
    t = ingest.read_all([F.SAMPLE_ID.name, F.KEY.name, F.CAPTION.name, F.IMAGE_REF.name])
    captions = {r[F.SAMPLE_ID.name]: r for r in t.to_pylist()} if t.num_columns else {}
    for name in stage_names(run_dir):
        out += _stage(stage_dir(run_dir, name, cfg, export_dir), examples, captions)
    exp = stage_dir(run_dir, "export", cfg, export_dir)
    if rows and exp.committed():
        out += _annotated(exp, rows)
    return "\n".join(out)


def _stage(sd: StageDir, examples: int, captions: dict) -> list[str]:
    m, name = sd.manifest(), sd.name
    if m is None:
        att = sd.attempt()
        return [f"\n== {name}: incomplete ({len(sd.committed())}/{(att or {}).get('parts', '?')}"
                " parts committed; rerun to resume)"]
    out = [f"\n== {name}  ({m['parts']} parts, {m[F.MK.WALL_S]:.1f}s, fingerprint {m[F.MK.FINGERPRINT]})",
           f"   rows {m[F.MK.ROWS]}  in {m[F.MK.ROWS_IN]}  kept {m[F.MK.ROWS_KEPT]}  "
           f"rejected {m[F.MK.ROWS_REJECTED]}"]
    if m[F.MK.ROWS_REJECTED]:
        found: dict[str, list[dict]] = {}
        for r in sd.read_all(kind="rejects").to_pylist():
            for reason in r[F.REASONS.name] or []:
                if len(found.setdefault(reason, [])) < examples:
                    found[reason].append(r)
        for reason, n in sorted(m[F.MK.REASON_COUNTS].items(), key=lambda kv: -kv[1]):
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
    return out


def _annotated(exp: StageDir, rows: int) -> list[str]:
    t: pa.Table = exp.read_all()
    show = [c for c in (F.SAMPLE_ID.name, F.KEY.name, F.CAPTION.name, F.WIDTH.name,
                        F.HEIGHT.name, F.KEEP.name, F.ALL_REASONS.name) if c in t.column_names]
    out = [f"\n== first {rows} rows of the annotated table ({display(exp.data)})"]
    import pandas as pd
    with pd.option_context("display.width", 160, "display.max_colwidth", 48):
        out.append(t.select(show).slice(0, rows).to_pandas().to_string(index=False))
    sm = read_json(exp.uri("shards", "manifest.json"))
    if E.CROSS_SCORE.name in t.column_names:
        out.append(score_line(t, (sm or {}).get("policy", {})))
    if sm:
        policy = ", ".join(f"{k}={v}" for k, v in sm["policy"].items())
        out.append(f"\nshards: {sm['samples']} samples in {sm['shards']} files, "
                   f"{sm['bytes'] / 1e6:.1f} MB, policy {policy} ({display(exp.uri('shards'))})")
    return out


def score_line(t: pa.Table, policy: dict) -> str:
    """cross_score's distribution over the scored rows, and where the policy's cut falls."""
    v = t.column(E.CROSS_SCORE.name).drop_null().to_numpy()
    if not v.size:
        return "\ncross_score: no row has a score"
    q = np.quantile(v, [0, 0.1, 0.25, 0.5, 0.75, 0.9, 1])
    out = (f"\ncross_score over {v.size} scored rows: min {q[0]:.3f}  p10 {q[1]:.3f}  "
           f"p25 {q[2]:.3f}  median {q[3]:.3f}  p75 {q[4]:.3f}  p90 {q[5]:.3f}  max {q[6]:.3f}")
    for key in ("min_score", "cut_score"):
        if policy.get(key) is not None:
            c = float(policy[key])
            out += (f"\n   cut at {key} {c:.4f}: {(v >= c).mean():.1%} of scored rows at or "
                    "above it")
    return out
