"""Export with and without its projection, on a finished run that has embeddings (e.g. the one
``bench_scale.py --keep DIR`` leaves in DIR/run10000, or ``vlcurate demo``'s runs/demo/run).

    .venv/bin/python tests/benchmarks/bench_export_projection.py RUN_DIR [--repeat 2]

Re-runs export alone (every upstream stage is reused) alternately as it was (reading every
upstream column but the image bytes, embeddings included) and as it is (annotation columns only),
and prints wall time, CPU-s, and the Parquet bytes of the upstream columns each variant reads (the
compressed column chunks of the columns it asks for, summed over every part file), with the load
average. The run folder's export is left as the current code writes it.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def column_bytes(stage_data: Path, columns: list[str]) -> int:
    """Compressed bytes of ``columns`` (nested leaves included) in every Parquet file under it."""
    import pyarrow.parquet as pq
    want, total = set(columns), 0
    for f in stage_data.rglob("*.parquet"):
        md = pq.ParquetFile(f).metadata
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            for c in range(rg.num_columns):
                cc = rg.column(c)
                if cc.path_in_schema.split(".")[0] in want:
                    total += cc.total_compressed_size
    return total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    import pyarrow.dataset as ds

    from tests.stages.test_export_projection import UnprojectedExport
    from vlcurate.pipeline import config as C
    from vlcurate.pipeline.dag import Node, default_dag, select
    from vlcurate.pipeline.runner import run
    from vlcurate.stages.export import ExportStage

    run_dir = Path(a.run_dir)
    cfg = C.from_dict(json.loads((run_dir / "run.json").read_text())["config"])
    cfg = cfg.replace(**{"run.run_dir": str(run_dir), "run.progress": False})
    dag = select(default_dag(), cfg.run.stages)
    ups = [n for n in dag[-1].after]
    variants = {"before (all columns)": UnprojectedExport, "after (projected)": ExportStage}
    read = {}
    for label, cls in variants.items():
        read[label] = 0
        for u in ups:
            path = run_dir / u / "data"
            if path.exists():
                cols = cls.input_columns(u, ds.dataset(path).schema, cfg)
                read[label] += column_bytes(path, cols)

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    rows = []
    for i in range(a.repeat):
        for label, cls in variants.items():
            d = [Node(cls, n.after) if n.stage is ExportStage else n for n in dag]
            shutil.rmtree(run_dir / "export", ignore_errors=True)   # recomputed from scratch
            t0, c0 = time.perf_counter(), cpu()
            out = run(cfg, dag=d, executor="local", log=lambda _: None)
            res = {r.manifest["stage"]: r for r in out}
            assert res["export"].status == "ran", res["export"].status
            files = (run_dir / "export" / "data").rglob("*")
            size = sum(p.stat().st_size for p in files if p.is_file())
            rows.append((label, time.perf_counter() - t0, cpu() - c0, size, os.getloadavg()[0]))
    n = res["export"].manifest["rows_in"]
    print(f"export of {run_dir} ({n:,} rows in, {res['export'].manifest['rows_kept']:,} kept)")
    print(f"{'variant':<22} {'upstream MB read':>16} {'wall s':>7} {'CPU-s':>6} {'table MB':>8} "
          f"{'load1':>6}")
    for label, wall, c, size, load in rows:
        print(f"{label:<22} {read[label] / 2**20:>16.1f} {wall:>7.2f} {c:>6.2f} "
              f"{size / 2**20:>8.1f} {load:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
