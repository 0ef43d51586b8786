"""Memory and speed of the trainer's random-access index (HELIP hard pairs) on a synthetic
1M-row export index: the former per-rank Python lists + dict against the memory-mapped
``trainer/index.ShardIndex``. Each variant runs in a fresh process; RSS is read from
/proc (resident set, and its private part: the pages a second rank on this machine would not
share).

    .venv/bin/python tests/benchmarks/bench_index.py [--rows 1000000] [--lookups 20000]
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def rss_mib() -> tuple[float, float]:
    """(resident, private resident) MiB of this process."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text()
                  .splitlines()[1:])
    kib = (lambda k: int(fields[k].split()[0]))
    return kib("Rss") / 1024, (kib("Private_Clean") + kib("Private_Dirty")) / 1024


def make(d: Path, rows: int, per_shard: int = 10_000) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlcurate.schemas import tables
    (d / "index").mkdir(parents=True)
    files = []
    for s in range(rows // per_shard):
        name = f"shard-{s:05d}.tar"
        n = per_shard
        off = [1536 * i for i in range(n)]
        cols = {"sample_id": [f"coco:{s * per_shard + i:09d}" for i in range(n)],
                "shard": [name] * n}
        for j, ext in enumerate(("jpg", "txt", "json")):
            cols[f"{ext}_offset"] = [o + 512 * j for o in off]
            cols[f"{ext}_size"] = [100] * n
        pq.write_table(pa.table(cols, schema=tables.SHARD_INDEX), d / "index" / f"{name[:-4]}.parquet")
        files.append({"shard": name, "samples": n})
    (d / "manifest.json").write_text(json.dumps({"files": files}))


def old_index(d: Path):
    """The former index (the baseline), verbatim: every column as a Python list, plus a dict."""
    import pyarrow.dataset as ds
    t = ds.dataset(d / "index", format="parquet").to_table()
    cols = {c: t.column(c).to_pylist() for c in t.column_names}
    pos = {sid: i for i, sid in enumerate(cols["sample_id"])}
    return (lambda sid: pos.get(sid)), (lambda i: cols["jpg_offset"][i])


def new_index(d: Path):
    from vlcurate.trainer.index import ShardIndex
    idx = ShardIndex(d)
    return idx.row, (lambda i: int(idx.num["jpg_offset"][i]))


def child(kind: str, d: Path, lookups: int) -> None:
    # both variants' imports before the baseline (the trainer has them loaded anyway)
    import pyarrow.dataset  # noqa: F401
    import pyarrow.ipc  # noqa: F401

    import vlcurate.trainer.index  # noqa: F401
    base, base_private = rss_mib()
    t0 = time.perf_counter()
    row, offset = (old_index if kind == "before" else new_index)(d)
    t_open = time.perf_counter() - t0
    n = len(json.loads((d / "manifest.json").read_text())["files"]) * 10_000
    ids = [f"coco:{random.Random(i).randrange(n):09d}" for i in range(lookups)]
    t0 = time.perf_counter()
    assert all(offset(row(s)) >= 0 for s in ids)
    t_look = time.perf_counter() - t0
    rss, private = rss_mib()
    print(json.dumps({"kind": kind, "open_s": t_open, "lookup_us": 1e6 * t_look / lookups,
                      "rss_mib": rss - base, "private_mib": private - base_private}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--lookups", type=int, default=20_000)
    ap.add_argument("--child", default=None)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    if a.child:
        child(a.child, Path(a.dir), a.lookups)
        return 0
    d = Path(tempfile.mkdtemp(prefix="vlc-bench-index-")) / "shards"
    make(d, a.rows)
    runs = {}
    for kind in ("before", "after", "after"):     # the second "after": the cache already built
        out = subprocess.run([sys.executable, __file__, "--child", kind, "--dir", str(d),
                              "--lookups", str(a.lookups)], capture_output=True, text=True, check=True)
        runs.setdefault(kind, []).append(json.loads(out.stdout))
    print(f"\n{a.rows:,}-row index, {a.lookups:,} random sample_id lookups, one process each\n")
    print(f"{'index':<34}{'open s':>8}{'lookup us':>11}{'+RSS MiB':>10}{'+private MiB':>14}")
    rows = [("before: Python lists + dict", runs["before"][0]),
            ("after: mmap, first open (builds)", runs["after"][0]),
            ("after: mmap, later opens", runs["after"][1])]
    for name, r in rows:
        print(f"{name:<34}{r['open_s']:>8.2f}{r['lookup_us']:>11.1f}{r['rss_mib']:>10.0f}"
              f"{r['private_mib']:>14.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
