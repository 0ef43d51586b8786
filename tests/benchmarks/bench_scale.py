"""Scale benchmark: the whole DAG on N synthetic tiny images with English captions,
with the demo's offline models (pipeline/demo.py DEMO_MODELS), one table per N.

    .venv/bin/python tests/benchmarks/bench_scale.py --sizes 2000,10000 [--rows-per-part 1000]
        [--ocr]          # also run textspot (OCR): skipped by default, see below
        [--keep DIR]     # keep the data and runs there (else a temp folder, removed); the
                         # same command again after a kill resumes the run there (run_once)
        [--set KEY=VALUE]  # a config override (repeatable), e.g. hpm.engine.exact_max_n=10000
        [--embed synthetic]  # embed's contract with clustered synthetic vectors, no models
                         # (synthetic_embed: the random ViT's all-pairs-near worst case aside)

What it measures, per stage (a stage's span runs from the previous stage's "done" log line to its
own, so a global step, model loads and the commit are all inside it):
  rows/s    rows that entered the stage (``rows_in``) / wall seconds
  CPU-s     user + system CPU of the process and its children (getrusage) over the span
  peak RSS  the largest RSS seen by a sampler (/proc, every 50 ms; children every 1 s) during
            the span, of the driver process and, separately, the sum over its child processes
  anon MB   the driver's peak anonymous (private) RSS: RSS less its file-backed pages, which
            are the memory-mapped vectors and models (page cache, shared between the processes
            of a node and dropped under pressure: a 1M run maps ~1.5 GB of sorted vectors)
  disk      bytes of the stage's folder after the run
  load      the 1-minute load average when the stage finished (the machine is shared)

Process kinds: this runs the in-process executor (``executor="local"``): tasks, actor-pool
stages and global steps all run in the driver process, so "peak RSS per process kind" is per
stage in one process (what a Ray task worker or actor of that stage would hold, plus the driver's
bookkeeping and the models earlier stages loaded). Each N runs in a fresh process. Ray was
impractical here (2 shared cores; its idle workers would blur the
per-stage figures). The RSS peak is a sampled current RSS (not ru_maxrss, which never goes
down), so each stage gets its own peak.

OCR: textspot costs 170-430 ms per image on CPU (deploy/SIZING.md); at 10k rows it would take hours on 2
shared cores. By default it is left out of the DAG (``run.stages`` without it; the
DAG then runs embed straight after cat); ``--ocr`` puts it back. Per-row cost growth: for each
stage, CPU-s per row at the largest N over the smallest; a ratio > 1.3 is printed as a finding.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import os
import random
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

def all_stages() -> tuple[str, ...]:
    from vlcurate.pipeline.dag import default_dag
    return tuple(n.name for n in default_dag())


def synthetic_embed(clusters: int):
    """The embed stage's contract (its output schema, from the demo's models) with synthetic
    vectors instead of the models (``--embed synthetic``): each row's vectors are drawn from its
    sample id alone (so batching changes nothing), around one of ``clusters`` centres per space
    (cosine ~0.9 to it; N / 200 of them, so every N has the same density), like a trained
    encoder's clusters. The demo's random ViT instead puts almost
    every pair of pictures above positives.candidates.image (cosine 0.94-0.999), so each row fills
    its 256
    candidate pairs: a worst case that made hpm ~3 h of the 1M run alone."""
    import zlib

    import numpy as np
    import pyarrow as pa

    from vlcurate.schemas import F, conform
    from vlcurate.schemas import embed as E
    from vlcurate.stages.arrow import fixed_lists
    from vlcurate.stages.embed import EmbedStage

    cols = (E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME, E.CROSS_IMAGE_EMB_NAME,
                            E.CROSS_TEXT_EMB_NAME)

    class SyntheticEmbed(EmbedStage):
        def setup(self) -> None:
            self.cfg = self.config.embed
            names = [c for c in cols if c in self.schema.names]
            self.types = {c: self.schema.field(c).type for c in names}
            self.centres = {c: np.random.default_rng(i).standard_normal(
                (clusters, t.list_size)).astype(np.float32) for i, (c, t) in
                enumerate(self.types.items())}

        def __call__(self, batch: pa.Table) -> pa.Table:
            ids = batch.column(F.SAMPLE_ID.name).to_pylist()
            seeds = [zlib.crc32(str(x).encode()) for x in ids]
            n, c = len(ids), self.cfg
            out = {F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
                   E.IMAGE_MODEL.name: pa.array([c.image_model.id] * n, pa.string()),
                   E.TEXT_MODEL.name: pa.array([c.text_model.id] * n, pa.string()),
                   E.RANDOM_WEIGHTS.name: pa.array([True] * n, pa.bool_()),
                   F.REASONS.name: pa.array([[]] * n, F.REASONS.type)}
            if c.cross_model is not None:
                out[E.CROSS_MODEL.name] = pa.array([c.cross_model.id] * n, pa.string())
            for i, (col, typ) in enumerate(self.types.items()):
                d = typ.list_size
                noise = np.stack([np.random.default_rng([x, i]).standard_normal(d)
                                  for x in seeds]).astype(np.float32) if n else \
                    np.zeros((0, d), np.float32)
                lab = np.asarray(seeds, np.int64) % clusters
                x = self.centres[col][lab] + 0.45 * noise
                out[col] = fixed_lists(x / np.linalg.norm(x, axis=1, keepdims=True), typ)
            return conform(pa.table(out), self.schema)
    return SyntheticEmbed


def make_data(out: Path, n: int, seed: int = 0, size: int = 48, per_file: int = 10_000) -> Path:
    """``n`` rows of (id, image JPEG bytes, caption) in Parquet files: two shapes on a background,
    captioned in English like the demo (pipeline/demo.py), positions jittered so that every image
    is distinct. Tiny (48 px, ~1 kB) so that rendering 100k rows takes about a minute."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image, ImageDraw

    from vlcurate.pipeline.demo import COLOURS, SHAPES, caption_for

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    names = list(COLOURS)
    rows: dict[str, list] = {"id": [], "image": [], "caption": []}

    def flush(i: int) -> None:
        pq.write_table(pa.table(rows), out / f"data-{i:05d}.parquet")
        for v in rows.values():
            v.clear()

    for i in range(n):
        bg, c1, c2 = rng.sample(names, 3)
        s1, s2 = rng.choice(SHAPES), rng.choice(SHAPES)
        im = Image.new("RGB", (size, size), COLOURS[bg])
        d = ImageDraw.Draw(im)
        for s, c, x in ((s1, c1, rng.randint(1, 8)), (s2, c2, rng.randint(24, 30))):
            y = rng.randint(4, 26)
            box = (x, y, x + 16, y + 16)
            (d.ellipse if s == "circle" else d.rectangle)(box, fill=COLOURS[c])
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=85)
        cap = caption_for(rng, (c1, s1), (c2, s2), bg)
        rows["id"].append(f"s{i:08d}")
        rows["image"].append(buf.getvalue())
        rows["caption"].append(cap)
        if len(rows["id"]) == per_file:
            flush(i // per_file)
    if rows["id"]:
        flush(n // per_file)
    return out


def rss(pid: int | str = "self", anon: bool = False) -> int:
    """Current resident set size of a process, from /proc (Linux; psutil is not a dependency);
    ``anon``: less its file-backed and shared pages (statm's resident - shared)."""
    try:
        with open(f"/proc/{pid}/statm") as fh:
            f = fh.read().split()
        return (int(f[1]) - (int(f[2]) if anon else 0)) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc/*/stat parent ids)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    parent[int(d)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


class Sampler:
    """Peak RSS of this process and of its children since the last ``reset``, sampled."""

    def __init__(self, every: float = 0.05) -> None:
        self.pid, self.every = os.getpid(), every
        self.peak_self = self.peak_children = self.peak_anon = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        i = 0
        while not self._stop.is_set():
            self.sample(kids=i % 20 == 0)   # children every second: listing /proc costs more
            i += 1
            time.sleep(self.every)

    def sample(self, kids: bool = True) -> None:
        self.peak_self = max(self.peak_self, rss())
        self.peak_anon = max(self.peak_anon, rss(anon=True))
        if kids:
            self.peak_children = max(self.peak_children, sum(rss(c) for c in children(self.pid)))

    def reset(self) -> tuple[int, int, int]:
        """(peak RSS, peak anonymous RSS, children's peak RSS) since the last reset."""
        self.sample()
        out = (self.peak_self, self.peak_anon, self.peak_children)
        self.peak_self, self.peak_anon, self.peak_children = rss(), rss(anon=True), 0
        return out

    def stop(self) -> None:
        self._stop.set()


def cpu_s() -> float:
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def run_once(data: Path, run_dir: Path, rows_per_part: int, ocr: bool, embed: str = "models",
             n_rows: int = 0, sets: tuple[str, ...] = ()) -> list[dict]:
    """The DAG once, each stage's span appended to run_dir/../spans<N>.jsonl as it ends. Run
    again on the same --keep folder after a kill (the runner resumes from the committed parts),
    the stages that ended before keep their recorded spans (a stage that runs again, its code or
    config changed, gets a fresh one), and a stage the kill cut short is marked resumed: its
    figures cover only the parts computed after the restart."""
    import json

    from vlcurate.pipeline import config as C
    from vlcurate.pipeline.demo import DEMO_MODELS
    from vlcurate.pipeline.dag import default_dag
    from vlcurate.pipeline.runner import run

    stages = [s for s in all_stages() if ocr or s != "textspot"]
    cfg = C.load(None, {"source.kind": "parquet", "source.path": str(data),
                        "source.key_column": "id", "source.rows_per_part": rows_per_part,
                        "run.run_dir": str(run_dir), "run.progress": False,
                        "run.stages": stages, "export.samples_per_shard": 10_000, **DEMO_MODELS,
                        **overrides(sets)})
    book = run_dir.parent / f"spans{run_dir.name[3:]}.jsonl"
    prior = {x["stage"]: x for x in map(json.loads, book.read_text().splitlines())} \
        if book.exists() else {}
    sampler, spans = Sampler(), {}
    state = {"t": time.perf_counter(), "cpu": cpu_s()}
    sampler.reset()

    def log(line: str) -> None:
        if not line.startswith("[") or not (" done: " in line or "skipped" in line):
            return
        name = line[1:line.index("]")]
        now, cpu = time.perf_counter(), cpu_s()
        peak, anon, kids = sampler.reset()
        if name not in prior or " done: " in line:       # ran (again): a fresh span
            prior.pop(name, None)
            spans[name] = {"stage": name, "wall": now - state["t"], "cpu": cpu - state["cpu"],
                           "rss": peak, "anon": anon, "rss_children": kids,
                           "load": os.getloadavg()[0]}
            with open(book, "a") as f:
                f.write(json.dumps(spans[name]) + "\n")
        state.update(t=now, cpu=cpu)

    dag = default_dag()
    if embed == "synthetic":
        stage = synthetic_embed(max(1, n_rows // 200))
        dag = [dataclasses.replace(n, stage=stage) if n.name == "embed" else n
               for n in dag]
    res = run(cfg, dag, executor="local", log=log)
    sampler.stop()
    man = {r.manifest["stage"]: r.manifest for r in res}
    status = {r.manifest["stage"]: r.status for r in res}
    spans = [prior.get(name) or spans[name] for name in man]
    for s in spans:
        m = man[s["stage"]]
        s.update(rows_in=m["rows_in"], rows_kept=m["rows_kept"], disk=du(run_dir / s["stage"]),
                 resumed=s.get("resumed", False) or (s["stage"] not in prior
                                                      and status[s["stage"]] == "resumed"))
    book.write_text("".join(json.dumps(s) + "\n" for s in spans))     # with their marks
    spans.append({"stage": "TOTAL", "wall": sum(s["wall"] for s in spans),
                  "cpu": sum(s["cpu"] for s in spans),
                  "rss": max(s["rss"] for s in spans),
                  "anon": max(s.get("anon", 0) for s in spans),
                  "rss_children": max(s["rss_children"] for s in spans),
                  "load": os.getloadavg()[0], "rows_in": man["ingest"]["rows_in"],
                  "rows_kept": man["export"]["rows_kept"], "disk": du(run_dir),
                  "resumed": any(s["resumed"] for s in spans)})
    return spans


def print_table(n: int, spans: list[dict]) -> None:
    print(f"\n== N = {n:,} rows (in-process executor; RSS = driver process, children = its forks; "
          f"* resumed after a kill: only the parts computed after the restart)")
    print(f"{'stage':<10} {'rows in':>8} {'kept':>8} {'wall s':>8} {'rows/s':>9} {'CPU-s':>8} "
          f"{'CPU-ms/row':>10} {'peak RSS MB':>11} {'anon MB':>8} {'child MB':>8} "
          f"{'disk MB':>8} {'load1':>6}")
    for s in spans:
        rate = s["rows_in"] / s["wall"] if s["wall"] else 0.0
        per = 1000 * s["cpu"] / s["rows_in"] if s["rows_in"] else 0.0
        name = s["stage"] + ("*" if s.get("resumed") else "")
        anon = f"{s['anon'] / 2**20:.0f}" if s.get("anon") else "-"     # older result files
        print(f"{name:<10} {s['rows_in']:>8,} {s['rows_kept']:>8,} {s['wall']:>8.1f} "
              f"{rate:>9,.0f} {s['cpu']:>8.1f} {per:>10.2f} {s['rss'] / 2**20:>11.0f} "
              f"{anon:>8} {s['rss_children'] / 2**20:>8.0f} {s['disk'] / 2**20:>8.1f} {s['load']:>6.2f}")


def growth(results: dict[int, list[dict]], limit: float = 1.3) -> None:
    ns = sorted(results)
    if len(ns) < 2:
        return
    lo, hi = ({s["stage"]: s for s in results[n]} for n in (ns[0], ns[-1]))
    print(f"\n== per-row CPU and peak RSS, N = {ns[-1]:,} over N = {ns[0]:,} "
          f"(> {limit} is a finding; fixed costs such as model loads make small N look dearer)")
    for name, a in lo.items():
        b = hi.get(name)
        if b is None or not a["rows_in"] or not b["rows_in"]:
            continue
        cpu = (b["cpu"] / b["rows_in"]) / max(a["cpu"] / a["rows_in"], 1e-9)
        rss = b["rss"] / max(a["rss"], 1)
        anon = f"x{b['anon'] / a['anon']:5.2f}" if a.get("anon") and b.get("anon") else "    -"
        flag = ("  <-- per-row cost grows" if cpu > limit else "") + \
            ("  <-- peak RSS grows" if rss > limit else "")
        print(f"{name:<10} CPU/row x{cpu:5.2f}   peak RSS x{rss:5.2f}   anon {anon}{flag}")


def overrides(sets: tuple[str, ...]) -> dict:
    """--set KEY=VALUE pairs as config overrides (VALUE read as JSON when it parses)."""
    import json
    out = {}
    for item in sets:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def one(n: int, root: Path, rows_per_part: int, ocr: bool, embed: str,
        sets: tuple[str, ...] = ()) -> list[dict]:
    """Render and run N rows in a fresh process, so that each N's peak RSS is its own."""
    import json
    import subprocess
    args = [sys.executable, __file__, "--one", str(n), "--rows-per-part", str(rows_per_part),
            "--keep", str(root), "--embed", embed] + (["--ocr"] if ocr else []) + \
        [x for kv in sets for x in ("--set", kv)]
    subprocess.run(args, check=True)
    return json.loads((root / f"result{n}.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="2000,10000")
    ap.add_argument("--rows-per-part", type=int, default=1000)
    ap.add_argument("--ocr", action="store_true")
    ap.add_argument("--keep", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override, e.g. hpm.engine.exact_max_n=10000 (repeatable)")
    ap.add_argument("--embed", choices=("models", "synthetic"), default="models",
                    help="synthetic: the embed stage's contract with clustered vectors drawn "
                         "from each sample id instead of the demo's models (synthetic_embed)")
    ap.add_argument("--report", action="store_true",
                    help="print the tables of --sizes from --keep's result files; run nothing")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    root = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="vlc-scale-"))
    if a.one is not None:
        import json
        t0, data, done = time.perf_counter(), root / f"data{a.one}", root / f"data{a.one}.done"
        if not done.exists():                    # a run resumed on --keep renders nothing
            make_data(data, a.one)
            done.touch()
        print(f"rendered {a.one:,} rows in {time.perf_counter() - t0:.1f}s "
              f"({du(data) / 2**20:.1f} MB), load {os.getloadavg()[0]:.2f}", flush=True)
        spans = run_once(data, root / f"run{a.one}", a.rows_per_part, a.ocr, a.embed, a.one,
                         tuple(a.set))
        (root / f"result{a.one}.json").write_text(json.dumps(spans))
        return 0
    results: dict[int, list[dict]] = {}
    if a.report:
        import json
        for n in (int(x) for x in a.sizes.split(",")):
            results[n] = json.loads((root / f"result{n}.json").read_text())
            print_table(n, results[n])
        growth(results)
        return 0
    try:
        for n in (int(x) for x in a.sizes.split(",")):
            results[n] = one(n, root, a.rows_per_part, a.ocr, a.embed, tuple(a.set))
            print_table(n, results[n])
            sys.stdout.flush()
        growth(results)
    finally:
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
