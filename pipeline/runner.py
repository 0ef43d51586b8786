"""Runs the DAG over a run directory, stage by stage, part by part, resumably.

A stage is skipped when its manifest's fingerprint matches (its config, its code version and
every upstream fingerprint); a changed parameter therefore reruns that stage and everything
downstream. Within a stage, parts committed by an interrupted attempt are kept and only the rest
run. Two executors share the per-part code in ``parts.py``: ``ray`` (Ray Data ``map_batches``,
the stage as a callable class on an actor pool) and ``local`` (the same objects, in-process).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pyarrow as pa
from tqdm.auto import tqdm

from vlcurate.stages.base import Resources as StageResources
from vlcurate.stages.base import Stage

from . import config as C
from . import guards
from .dag import Node, ancestors, default_dag, select, topo_order
from .parts import (Committer, PartIO, StageCall, add_counts, batch_rows, commit_empty,
                    empty_counts, pinned_threads, read_inputs, write_fragments, write_null_part)
from . import storage
from .rundir import StageDir, fingerprint, manifests_table, now, read_json, write_json, write_table
from .worker import TableReader, _apply, _prepare, _RayStageCall, _read_batch, _stage_task
from .versions import versions

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


class RunError(RuntimeError):
    pass


@dataclass
class StageResult:
    manifest: dict
    status: str                 # ran | resumed | repaired | skipped
    info: dict = field(default_factory=dict)
    redone: frozenset = frozenset()   # the parts this run (re)computed: downstream redoes them


# run settings that shape numerics (see RunConfig): their defaults are the historic behaviour
_NUMERICS = {f.name: f.default for f in dataclasses.fields(C.RunConfig)
             if f.name in ("chunk_rows", "intra_op_threads")}


def resources(stage: type[Stage], config: C.Config) -> StageResources:
    base = stage.resources
    sec = getattr(config, stage.name, None)
    over = getattr(sec, "resources", None) if sec is not None else None
    if over is None:
        return base
    return StageResources(*(getattr(over, k) if getattr(over, k) is not None else getattr(base, k)
                            for k in ("num_cpus", "num_gpus", "batch_size", "concurrency")))


def stage_config(stage: type[Stage], config: C.Config) -> dict:
    out = {}
    for sec in stage.config_sections:
        d = C.to_dict(config.section(sec))
        for key in ("resources", "out_dir", *C.SPEED_ONLY.get(sec, ())):
            d.pop(key, None)       # speed, never output: no rerun when they change
        out[sec] = d
    return out


# --- executors --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Work:
    """What one stage's parts need from an executor. ``items``: (part, lo, hi) row ranges, whole
    chunks (``batch_rows``, a multiple of ``run.chunk_rows``) of one part each; hi None = the
    part's end (a source part, whose size is known only once read)."""
    io: PartIO
    stage: type
    config: C.Config
    state: Any
    res: StageResources
    items: list[tuple[int, int, Optional[int]]]
    specs: Optional[list[dict]]
    schema: pa.Schema


def work_items(pending: list[int], sizes: Optional[dict[int, int]], rows: int
               ) -> list[tuple[int, int, Optional[int]]]:
    """Each pending part as row ranges of ``rows`` rows (0: one range per part)."""
    if sizes is None or not rows:
        return [(p, 0, None) for p in pending]
    return [(p, lo, min(lo + rows, sizes[p])) for p in pending
            for lo in range(0, max(sizes[p], 1), rows)]


class LocalExecutor:
    """The same stage objects and part functions, called in this process (no Ray)."""
    name = "local"

    def __init__(self, threads: int = 1) -> None:
        self.threads = threads

    def parts(self, w: Work, committer: Committer) -> None:
        call = StageCall(w.stage, w.config, w.state)
        rows = batch_rows(w.res.batch_size, w.config.run.chunk_rows)
        for p in dict.fromkeys(p for p, _, _ in w.items):
            t = read_inputs(w.io, p, w.specs[p] if w.specs else None)
            if t.num_rows == 0:
                commit_empty(w.io, p, w.schema)
                committer.committed.append(p)
                continue
            step = rows or t.num_rows
            out = pa.concat_tables([call(t.slice(lo, step)) for lo in range(0, t.num_rows, step)],
                                   promote_options="default")
            for rec in write_fragments(out, w.io).column("record").to_pylist():
                committer.add(rec)

    def call(self, fn: Callable, *args: Any, num_gpus: float = 0) -> Any:
        return fn(*args)

    def map(self, fn: Callable, items: list) -> list:
        return [_apply(fn, x, self.threads) for x in items]


class RayExecutor:
    """Ray Data: read (tasks) -> stage (callable class on an actor pool) -> write (tasks). Every
    Ray batch is one work item (a whole number of chunks of one part): batch_size=None, and Ray
    never slices a block (target_max_block_size=None), so no batch spans parts or cuts a chunk."""
    name = "ray"

    def __init__(self, rc: C.RayConfig, threads: int = 1) -> None:
        from .ray_env import init_ray
        self.ray, self.threads = init_ray(rc), threads
        import ray.data
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = rc.ray_progress_bars
        ctx.print_on_execution_start = False
        ctx.verbose_stats_logs = False
        ctx.target_max_block_size = None
        if not rc.ray_progress_bars:
            logging.getLogger("ray.data").setLevel(logging.ERROR)

    def parts(self, w: Work, committer: Committer) -> None:
        items = [{"part": p, "lo": lo, "hi": -1 if hi is None else hi,
                  "spec": json.dumps(w.specs[p]) if w.specs else ""} for p, lo, hi in w.items]
        ds = self.ray.data.from_items(items, override_num_blocks=len(items))
        ds = self._stage(ds, w, self._state_path(w))
        for b in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            for rec in b.column("record").to_pylist():
                committer.add(rec)

    @staticmethod
    def _state_path(w: Work) -> Optional[str]:
        if w.state is None:
            return None
        # beside the stage's tables, not in _tmp: an actor still starting when the stage
        # finishes must find it (it is replaced by the next attempt of this stage)
        path = w.io.dir().uri("_state.pkl")
        storage.write_bytes(path, pickle.dumps(w.state))
        return path

    def _stage(self, ds: Any, w: Work, state_path: Optional[str]) -> Any:
        res, read = w.res, {"io": w.io, "schema": w.schema}
        kw = {"stage_cls": w.stage, "config": w.config, "state_path": state_path}
        if not getattr(w.stage, "heavy_init", False):
            # read -> stage -> write with equal resources: Ray Data fuses them into one task
            cpus = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus or None}
            ds = ds.map_batches(_read_batch, fn_kwargs=read, batch_size=1, batch_format="pyarrow",
                                **cpus)
            ds = ds.map_batches(_stage_task, fn_kwargs=kw, batch_size=None,
                                batch_format="pyarrow", **cpus)
            return ds.map_batches(write_fragments, fn_kwargs={"io": w.io}, batch_size=None,
                                  batch_format="pyarrow", **cpus)
        ds = ds.map_batches(_read_batch, fn_kwargs=read, batch_size=1, batch_format="pyarrow",
                            num_cpus=0.1)
        ds = ds.map_batches(_RayStageCall, fn_constructor_kwargs=kw, batch_size=None,
                            batch_format="pyarrow", compute=self._pool(res, len(w.items)),
                            num_cpus=res.num_cpus, num_gpus=res.num_gpus or None)
        return ds.map_batches(write_fragments, fn_kwargs={"io": w.io}, batch_size=None,
                              batch_format="pyarrow", num_cpus=0.1)

    def _pool(self, res: StageResources, n_items: int) -> Any:
        from ray.data import ActorPoolStrategy
        total = self.ray.cluster_resources()
        if res.num_gpus:
            most = max(1, int(total.get("GPU", 0) // res.num_gpus))
        else:
            most = max(1, int(total.get("CPU", 1) // max(res.num_cpus, 0.01)))
        return (ActorPoolStrategy(size=res.concurrency) if res.concurrency
                else ActorPoolStrategy(min_size=1, max_size=min(most, n_items)))

    def call(self, fn: Callable, *args: Any, num_gpus: float = 0) -> Any:
        """A global step as one Ray task, with the stage's GPUs (a teacher model, an index)."""
        task = self.ray.remote(num_cpus=1, num_gpus=min(1.0, num_gpus) if num_gpus else 0)(fn)
        return self.ray.get(task.remote(*args))

    def map(self, fn: Callable, items: list) -> list:
        task = self.ray.remote(num_cpus=1)(_apply)
        return self.ray.get([task.remote(fn, x, self.threads) for x in items])


@dataclass
class FinalizeCtx:
    counts: list[dict]
    read: TableReader
    map: Callable
    root: Any          # the stage's folder: a Path when local, else its URI (str)
    tmp_dir: Path


# --- the run ----------------------------------------------------------------------------------------
class RunLock:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.path = storage.join(run_dir, ".lock")

    def __enter__(self) -> "RunLock":
        other = read_json(self.path)
        if other and other.get("pid") != os.getpid() and _alive(other.get("pid")):
            raise RunError(f"{storage.redact(self.run_dir)} is in use by another vlcurate run "
                           f"(pid {other['pid']}); wait for it or remove "
                           f"{storage.redact(self.path)} if it is stale")
        write_json(self.path, {"pid": os.getpid(), "since": now()})
        return self

    def __exit__(self, *exc: Any) -> None:
        storage.delete(self.path)


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (OSError, TypeError, ValueError):
        return False


class Runner:
    def __init__(self, config: C.Config, dag: Optional[list[Node]] = None,
                 executor: str = "ray", log: Callable[[str], None] = print) -> None:
        self.config = config
        self.dag = topo_order(select(dag or default_dag(), config.run.stages))
        self.executor_name = executor
        self._executor = None
        self.log = log
        self.run_dir = str(config.run.run_dir)
        self.roots = {"export": config.export.out_dir} if config.export.out_dir else {}

    @property
    def executor(self) -> Any:
        if self._executor is None:
            threads = self.config.run.intra_op_threads
            self._executor = RayExecutor(self.config.ray, threads) \
                if self.executor_name == "ray" else LocalExecutor(threads)
        return self._executor

    def stage_dir(self, name: str) -> StageDir:
        return StageDir(self.run_dir, name, self.roots.get(name))

    def run(self, only: Optional[set[str]] = None) -> list[StageResult]:
        # a re-export elsewhere (`vlcurate export --out DIR`) records itself in DIR: what the run
        # itself reports (its run.json and summary) never changes
        meta = str(self.roots["export"]) if only and "export" in self.roots else self.run_dir
        for d in {self.run_dir, meta}:
            if storage.is_local(d):
                storage.makedirs(d)
        record = {"config": storage.redact_tree(C.to_dict(self.config)),
                  "dag": [n.name for n in self.dag],
                  "started_at": now(), "versions": versions()}
        with RunLock(self.run_dir):
            if meta == self.run_dir:       # first, so that a run in progress can be inspected
                write_json(storage.join(meta, "run.json"), record)
            results: dict[str, StageResult] = {}
            for node in self.dag:
                results[node.name] = self.run_stage(node, results, only)
                stop = guards.stop_reason(results[node.name].manifest,
                                          self.config.run.max_reject_fraction)
                if stop:
                    raise RunError(stop)
            if meta != self.run_dir:       # after, since the export stage resets its folder
                write_json(storage.join(meta, "run.json"), record)
            ms = [r.manifest for r in results.values()]
            write_table(storage.join(meta, "summary.parquet"), manifests_table(ms))
            return list(results.values())

    def fingerprint(self, node: Node, results: dict[str, StageResult]) -> tuple[str, dict]:
        stage = node.stage
        ups = ancestors(self.dag, node)
        upstream = {a: results[a].manifest["fingerprint"] for a in ups}
        extra: dict = {}
        if getattr(stage, "source", False):
            extra["source_signature"] = stage.signature(self.config.source)
        elif len(ups) > 1:  # which rows are still kept can depend on it (conservatively)
            extra["compute_on_flagged"] = self.config.run.compute_on_flagged
        if hasattr(stage, "environment"):  # e.g. which spaCy pipeline / OCR backend is installed
            extra["environment"] = stage.environment(self.config)
        for k, default in _NUMERICS.items():   # only when changed: default fingerprints stay
            if getattr(self.config.run, k) != default:
                extra[k] = getattr(self.config.run, k)
        return fingerprint(node.name, stage.version, stage_config(stage, self.config), upstream,
                           extra), upstream

    def _progress(self, name: str, pending: list[int], node: Node) -> tuple[Any, bool]:
        """A bar in rows (rows/s and ETA), counted from the source's committed parts; a source
        stage, whose part sizes are not known before it reads them, counts parts."""
        ups = ancestors(self.dag, node)
        off = not self.config.run.progress
        if not ups:
            return tqdm(total=len(pending), desc=name, unit="part", disable=off, leave=False), False
        source = self.stage_dir(ups[0])
        total = sum(source.part_counts(p)["rows"] for p in pending)
        return tqdm(total=total, desc=name, unit="row", unit_scale=True, disable=off, leave=False,
                    smoothing=0.1), True

    def _nothing_to_compute(self, node: Node, results: dict[str, StageResult]) -> bool:
        """Every row was flagged upstream (an ancestor kept none of the rows it saw, and nothing
        it did not see is left), and this stage computes only kept rows."""
        stage = node.stage
        if getattr(stage, "source", False) or stage.all_rows or self.config.run.compute_on_flagged:
            return False
        return any(results[a].manifest["rows_kept"] == 0 for a in ancestors(self.dag, node))

    def run_stage(self, node: Node, results: dict[str, StageResult],
                  only: Optional[set[str]]) -> StageResult:
        stage, name = node.stage, node.name
        sd = self.stage_dir(name)
        fp, upstream = self.fingerprint(node, results)
        m, notes = sd.manifest(), stage.notes(self.config)
        complete = bool(m) and m.get("fingerprint") == fp and m.get("status") == "complete"
        redo = self.to_redo(node, sd, m["parts"], results) if complete else set()
        if complete and not redo:
            self.log(f"[{name}] up to date ({m['rows']} rows, fingerprint {fp}): skipped")
            info = sd.read_json("_info.json") or {}
            return StageResult(m, "skipped", _with_notes(info, notes))
        if only is not None and name not in only:
            raise RunError(f"stage {name!r} is not up to date with this config, and only "
                           f"{sorted(only)} may run here: run `vlcurate run` first")
        if complete:
            self.log(f"[{name}] up to date, but parts {sorted(redo)[:10]} are damaged or depend "
                     f"on redone upstream parts: redoing {len(redo)} of {m['parts']} parts")
            started = m.get("started_at") or now()
        else:
            att = sd.attempt()
            if not att or att.get("fingerprint") != fp:
                sd.reset()
            started = (att or {}).get("started_at") or now()
        t0 = time.time()
        n_parts, specs = self.plan(node, sd, results)
        if not complete and sd.committed():   # resuming: the committed parts must be sound too
            redo = self.to_redo(node, sd, n_parts, results)
        sd.uncommit(redo)
        sd.begin({"fingerprint": fp, "parts": n_parts, "started_at": started})
        before = set(sd.committed())
        pending = [p for p in range(n_parts) if p not in before]
        if pending:
            self.compute(node, sd, n_parts, pending, specs, results)
        missing = sorted(set(range(n_parts)) - set(sd.committed()))
        if missing:
            raise RunError(f"[{name}] parts {missing[:10]} did not commit; rerun to resume")
        counts = [sd.part_counts(p) for p in range(n_parts)]
        info = _with_notes(self.finalize(stage, sd, counts), notes)
        manifest = self.manifest(name, fp, upstream, stage, counts, len(before), t0, started)
        warn = guards.warning(manifest, self.config.run.warn_reject_fraction)
        if warn:
            info["warnings"] = [warn]
            self.log(f"[{name}] WARNING: {warn}")
        sd.write_json("_info.json", info)   # what finalize said, for later up-to-date runs
        sd.finish(manifest)
        self.log(f"[{name}] done: {manifest['rows_in']} in, {manifest['rows_kept']} kept, "
                 f"{manifest['rows_rejected']} rejected in {manifest['wall_s']:.1f}s "
                 f"({manifest['rows_in'] / max(manifest['wall_s'], 1e-3):,.0f} rows/s)"
                 + (f" ({len(before)} parts reused)" if before else ""))
        status = "repaired" if complete else "resumed" if before else "ran"
        return StageResult(manifest, status, info, frozenset(pending))

    def to_redo(self, node: Node, sd: StageDir, n_parts: int,
                results: dict[str, StageResult]) -> set[int]:
        """Parts to recompute: the damaged ones (``StageDir.damaged``), and those an upstream
        stage redid in this run. A stage with a global step (``prepare``) depends on every upstream
        part, so any redone upstream part redoes all of it (and so export's finalize reruns)."""
        redone = set().union(*(results[u].redone for u in ancestors(self.dag, node)))
        if redone and node.stage.prepare is not None:
            return set(range(n_parts))
        return {p for p in redone if p < n_parts} | set(sd.damaged(n_parts))

    def plan(self, node: Node, sd: StageDir, results: dict[str, StageResult]
             ) -> tuple[int, Optional[list[dict]]]:
        """How many parts (and, for the source, each part's spec)."""
        if getattr(node.stage, "source", False):
            if storage.is_local(sd.root):
                storage.makedirs(sd.root)
            specs = node.stage.plan(self.config.source, sd.uri("_plan.parquet"))
            return len(specs), specs
        return results[ancestors(self.dag, node)[0]].manifest["parts"], None

    def part_io(self, node: Node, specs: Optional[list[dict]]) -> tuple[PartIO, dict]:
        stage, ups = node.stage, ancestors(self.dag, node)
        schemas = {u: self.stage_dir(u).schema() for u in ups}
        schemas = {u: s for u, s in schemas.items() if s is not None}
        io = PartIO(run_dir=str(self.run_dir), stage=node.name,
                    stage_root=self.roots.get(node.name), ancestors=ups,
                    columns={u: stage.input_columns(u, schemas.get(u), self.config) for u in ups},
                    all_rows=stage.all_rows, all_reasons=stage.all_reasons,
                    compute_on_flagged=self.config.run.compute_on_flagged,
                    source_cfg=self.config.source if specs is not None else None,
                    read_source=stage.read_part if specs is not None else None,
                    preprocess=functools.partial(stage.preprocess, self.config)
                    if getattr(stage, "preprocess", None) else None)
        return io, schemas

    def compute(self, node: Node, sd: StageDir, n_parts: int, pending: list[int],
                specs: Optional[list[dict]], results: dict[str, StageResult]) -> None:
        stage, name = node.stage, node.name
        io, schemas = self.part_io(node, specs)
        out_schema = stage.output_schema(schemas, self.config)
        res = resources(stage, self.config)
        rows = batch_rows(res.batch_size, self.config.run.chunk_rows)
        self.log(f"[{name}] {n_parts} parts" + (f", {n_parts - len(pending)} already committed"
                                                 if len(pending) < n_parts else "")
                 + f" · {self.executor_name} · cpus={res.num_cpus} gpus={res.num_gpus} "
                 f"batch={rows or 'part'}")
        if self._nothing_to_compute(node, results):
            self.log(f"[{name}] no row is left to compute: null columns written, stage not run")
            committer = Committer(sd)
            for p in pending:
                write_null_part(io, p, out_schema, committer)
            return
        state = None
        if stage.prepare is not None:
            state = self.executor.call(_prepare, stage, self.config, io, n_parts,
                                       sd.uri("_prepare"), num_gpus=res.num_gpus)
        if state is None and getattr(stage, "output", None) is None:
            state = {"schema": out_schema}   # a stage whose columns depend on its upstream
        sizes = None if specs is not None else {
            p: self.stage_dir(io.ancestors[0]).part_counts(p)["rows"] for p in pending}
        work = Work(io, stage, self.config, state, res, work_items(pending, sizes, rows), specs,
                    out_schema)
        bar, in_rows = self._progress(name, pending, node)
        try:
            self.executor.parts(work, Committer(sd, on_commit=lambda p, c: bar.update(
                c["rows"] if in_rows else 1)))
        finally:
            bar.close()

    def finalize(self, stage: type[Stage], sd: StageDir, counts: list[dict]) -> dict:
        if stage.finalize is None:
            return {}
        tmp = Path(storage.local_path(sd.tmp)) / "finalize" if storage.is_local(sd.tmp) else \
            Path(tempfile.mkdtemp(prefix=f"vlcurate-{sd.name}-"))   # a local scratch folder
        tmp.mkdir(parents=True, exist_ok=True)
        ctx = FinalizeCtx(counts=counts, read=TableReader(str(self.run_dir),
                                                          tuple(self.roots.items())),
                          map=self.executor.map, tmp_dir=tmp,
                          root=Path(sd.root) if storage.is_local(sd.root) else sd.root)
        try:
            with pinned_threads(self.config.run.intra_op_threads):
                return stage.finalize(self.config, ctx) or {}
        finally:
            if not storage.is_local(sd.tmp):
                shutil.rmtree(tmp, ignore_errors=True)

    def manifest(self, name: str, fp: str, upstream: dict, stage: type[Stage], counts: list[dict],
                 reused: int, t0: float, started: str) -> dict:
        total = functools.reduce(add_counts, counts, empty_counts())
        return {
            "stage": name, "status": "complete", "fingerprint": fp, "upstream": upstream,
            "config": json.dumps(storage.redact_tree(stage_config(stage, self.config)),
                                 sort_keys=True),
            "parts": len(counts), "parts_reused": reused, "rows": total["rows"],
            "rows_in": total["rows_in"], "rows_kept": total["rows_kept"],
            "rows_rejected": total["rows_rejected"], "reason_counts": total["reason_counts"],
            "wall_s": round(time.time() - t0, 3), "started_at": started, "finished_at": now(),
            "versions": versions()}


def _with_notes(info: dict, notes: list[str]) -> dict:
    """Stage notes plus whatever its finalize reported as skipped (a missing spaCy pipeline)."""
    all_notes = list(notes) + [n for n in info.get("skipped", []) or [] if n not in notes]
    return {**info, "notes": all_notes} if all_notes else dict(info)


def run(config: C.Config, dag: Optional[list[Node]] = None, executor: str = "ray",
        only: Optional[set[str]] = None, log: Callable[[str], None] = print) -> list[StageResult]:
    return Runner(config, dag, executor, log).run(only)
