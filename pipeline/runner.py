"""Runs the DAG over a run directory, stage by stage, part by part, resumably.

A stage is skipped when its manifest's fingerprint matches (its config, its code version and
every upstream fingerprint); a changed parameter therefore reruns that stage and everything
downstream. Within a stage, parts committed by an interrupted attempt are kept and only the rest
run. Two executors share the per-part code in ``parts.py``: ``ray`` (Ray Data ``map_batches``,
the stage as a callable class on an actor pool) and ``local`` (the same objects, in-process).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm.auto import tqdm

from vlcurate.stages.base import Resources as StageResources
from vlcurate.stages.base import Stage

from . import config as C
from . import guards
from .dag import Node, ancestors, default_dag, select, topo_order
from .parts import (Committer, PartIO, StageCall, add_counts, commit_empty, empty_counts,
                    read_inputs, write_fragments, write_null_part)
from .rundir import StageDir, fingerprint, manifests_table, now, read_json, write_json
from .worker import TableReader, _apply, _prepare, _RayStageCall, _read_batch, _stage_task
from .versions import versions

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


class RunError(RuntimeError):
    pass


@dataclass
class StageResult:
    manifest: dict
    status: str                 # ran | resumed | skipped
    info: dict = field(default_factory=dict)


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
class LocalExecutor:
    """The same stage objects and part functions, called in this process (no Ray)."""
    name = "local"

    def parts(self, io: PartIO, stage: type[Stage], config: C.Config, state: Any,
              res: StageResources, pending: list[int], specs: Optional[list[dict]],
              schema: pa.Schema, committer: Committer) -> None:
        call = StageCall(stage, config, state)
        for p in pending:
            t = read_inputs(io, p, specs[p] if specs else None)
            if t.num_rows == 0:
                commit_empty(io, p, schema)
                committer.committed.append(p)
                continue
            bs = res.batch_size or t.num_rows
            for off in range(0, t.num_rows, bs):
                for rec in write_fragments(call(t.slice(off, bs)), io).column("record").to_pylist():
                    committer.add(rec)

    def call(self, fn: Callable, *args: Any, num_gpus: float = 0) -> Any:
        return fn(*args)

    def map(self, fn: Callable, items: list) -> list:
        return [fn(x) for x in items]


class RayExecutor:
    """Ray Data: read (tasks) -> stage (callable class on an actor pool) -> write (tasks)."""
    name = "ray"

    def __init__(self, rc: C.RayConfig) -> None:
        from .ray_env import init_ray
        self.ray = init_ray(rc)
        import ray.data
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = rc.ray_progress_bars
        ctx.print_on_execution_start = False
        ctx.verbose_stats_logs = False
        if not rc.ray_progress_bars:
            logging.getLogger("ray.data").setLevel(logging.ERROR)

    def parts(self, io: PartIO, stage: type[Stage], config: C.Config, state: Any,
              res: StageResources, pending: list[int], specs: Optional[list[dict]],
              schema: pa.Schema, committer: Committer) -> None:
        ray = self.ray
        from ray.data import ActorPoolStrategy
        items = [{"part": p, "spec": json.dumps(specs[p]) if specs else ""} for p in pending]
        state_path = None
        if state is not None:
            # beside the stage's tables, not in _tmp: an actor still starting when the stage
            # finishes must find it (it is replaced by the next attempt of this stage)
            state_path = str(io.dir().root / "_state.pkl")
            with open(state_path, "wb") as fh:
                pickle.dump(state, fh)
        bs = res.batch_size or None
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        if not getattr(stage, "heavy_init", False):
            # read -> stage -> write with equal resources: Ray Data fuses them into one task
            cpus = {"num_cpus": res.num_cpus, "num_gpus": res.num_gpus or None}
            ds = ds.map_batches(_read_batch, fn_kwargs={"io": io, "schema": schema}, batch_size=1,
                                batch_format="pyarrow", **cpus)
            ds = ds.map_batches(_stage_task, fn_kwargs={"stage_cls": stage, "config": config,
                                                        "state_path": state_path},
                                batch_size=bs, batch_format="pyarrow", **cpus)
            ds = ds.map_batches(write_fragments, fn_kwargs={"io": io}, batch_size=None,
                                batch_format="pyarrow", **cpus)
        else:
            total = ray.cluster_resources()
            if res.num_gpus:
                most = max(1, int(total.get("GPU", 0) // res.num_gpus))
            else:
                most = max(1, int(total.get("CPU", 1) // max(res.num_cpus, 0.01)))
            compute = (ActorPoolStrategy(size=res.concurrency) if res.concurrency
                       else ActorPoolStrategy(min_size=1, max_size=min(most, len(pending))))
            ds = ds.map_batches(_read_batch, fn_kwargs={"io": io, "schema": schema}, batch_size=1,
                                batch_format="pyarrow", num_cpus=0.1)
            ds = ds.map_batches(_RayStageCall, fn_constructor_kwargs={
                "stage_cls": stage, "config": config, "state_path": state_path},
                batch_size=bs, batch_format="pyarrow", compute=compute,
                num_cpus=res.num_cpus, num_gpus=res.num_gpus or None)
            ds = ds.map_batches(write_fragments, fn_kwargs={"io": io}, batch_size=None,
                                batch_format="pyarrow", num_cpus=0.1)
        for b in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            for rec in b.column("record").to_pylist():
                committer.add(rec)

    def call(self, fn: Callable, *args: Any, num_gpus: float = 0) -> Any:
        """A global step as one Ray task, with the stage's GPUs (a teacher model, an index)."""
        task = self.ray.remote(num_cpus=1, num_gpus=min(1.0, num_gpus) if num_gpus else 0)(fn)
        return self.ray.get(task.remote(*args))

    def map(self, fn: Callable, items: list) -> list:
        task = self.ray.remote(num_cpus=1)(_apply)
        return self.ray.get([task.remote(fn, x) for x in items])


@dataclass
class FinalizeCtx:
    counts: list[dict]
    read: TableReader
    map: Callable
    root: Path
    tmp_dir: Path


# --- the run ----------------------------------------------------------------------------------------
class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / ".lock"

    def __enter__(self) -> "RunLock":
        other = read_json(self.path)
        if other and other.get("pid") != os.getpid() and _alive(other.get("pid")):
            raise RunError(f"{self.path.parent} is in use by another vlcurate run (pid "
                           f"{other['pid']}); wait for it or remove {self.path} if it is stale")
        write_json(self.path, {"pid": os.getpid(), "since": now()})
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


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
        self.run_dir = Path(config.run.run_dir)
        self.roots = {"export": config.export.out_dir} if config.export.out_dir else {}

    @property
    def executor(self) -> Any:
        if self._executor is None:
            self._executor = RayExecutor(self.config.ray) if self.executor_name == "ray" \
                else LocalExecutor()
        return self._executor

    def stage_dir(self, name: str) -> StageDir:
        return StageDir(self.run_dir, name, self.roots.get(name))

    def run(self, only: Optional[set[str]] = None) -> list[StageResult]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # a re-export elsewhere (`vlcurate export --out DIR`) records itself in DIR: what the run
        # itself reports (its run.json and summary) never changes
        meta = Path(self.roots["export"]) if only and "export" in self.roots else self.run_dir
        meta.mkdir(parents=True, exist_ok=True)
        record = {"config": C.to_dict(self.config), "dag": [n.name for n in self.dag],
                  "started_at": now(), "versions": versions()}
        with RunLock(self.run_dir):
            if meta == self.run_dir:       # first, so that a run in progress can be inspected
                write_json(meta / "run.json", record)
            results: dict[str, StageResult] = {}
            for node in self.dag:
                results[node.name] = self.run_stage(node, results, only)
                stop = guards.stop_reason(results[node.name].manifest,
                                          self.config.run.max_reject_fraction)
                if stop:
                    raise RunError(stop)
            if meta != self.run_dir:       # after, since the export stage resets its folder
                write_json(meta / "run.json", record)
            ms = [r.manifest for r in results.values()]
            pq.write_table(manifests_table(ms), meta / "summary.parquet")
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
        m = sd.manifest()
        notes = stage.notes(self.config)
        if m and m.get("fingerprint") == fp and m.get("status") == "complete" \
                and len(sd.committed()) == m.get("parts"):
            self.log(f"[{name}] up to date ({m['rows']} rows, fingerprint {fp}): skipped")
            info = read_json(sd.root / "_info.json") or {}
            return StageResult(m, "skipped", _with_notes(info, notes))
        if only is not None and name not in only:
            raise RunError(f"stage {name!r} is not up to date with this config, and only "
                           f"{sorted(only)} may run here: run `vlcurate run` first")
        att = sd.attempt()
        if not att or att.get("fingerprint") != fp:
            sd.reset()
        t0, started = time.time(), (att or {}).get("started_at") or now()
        ups = ancestors(self.dag, node)
        specs = None
        if getattr(stage, "source", False):
            sd.root.mkdir(parents=True, exist_ok=True)
            specs = stage.plan(self.config.source, sd.root / "_plan.parquet")
            n_parts = len(specs)
        else:
            n_parts = results[ups[0]].manifest["parts"]
        sd.begin({"fingerprint": fp, "parts": n_parts, "started_at": started})
        before = set(sd.committed())
        pending = [p for p in range(n_parts) if p not in before]
        schemas = {u: self.stage_dir(u).schema() for u in ups}
        schemas = {u: s for u, s in schemas.items() if s is not None}
        io = PartIO(run_dir=str(self.run_dir), stage=name, stage_root=self.roots.get(name),
                    ancestors=ups, columns={u: stage.input_columns(u, schemas.get(u), self.config)
                                            for u in ups},
                    all_rows=stage.all_rows, all_reasons=stage.all_reasons,
                    compute_on_flagged=self.config.run.compute_on_flagged,
                    source_cfg=self.config.source if specs is not None else None,
                    read_source=stage.read_part if specs is not None else None,
                    preprocess=functools.partial(stage.preprocess, self.config)
                    if getattr(stage, "preprocess", None) else None)
        out_schema = stage.output_schema(schemas, self.config)
        res = resources(stage, self.config)
        self.log(f"[{name}] {n_parts} parts" + (f", {len(before)} already committed" if before else "")
                 + f" · {self.executor_name} · cpus={res.num_cpus} gpus={res.num_gpus} "
                 f"batch={res.batch_size or 'part'}")
        if pending and self._nothing_to_compute(node, results):
            self.log(f"[{name}] no row is left to compute: null columns written, stage not run")
            committer = Committer(sd)
            for p in pending:
                write_null_part(io, p, out_schema, committer)
        elif pending:
            state = None
            if stage.prepare is not None:
                state = self.executor.call(_prepare, stage, self.config, io, n_parts,
                                           str(sd.root / "_prepare"), num_gpus=res.num_gpus)
            if state is None and getattr(stage, "output", None) is None:
                state = {"schema": out_schema}   # a stage whose columns depend on its upstream
            bar, in_rows = self._progress(name, pending, node)
            committer = Committer(sd, on_commit=lambda p, c: bar.update(
                c["rows"] if in_rows else 1))
            try:
                self.executor.parts(io, stage, self.config, state, res, pending, specs, out_schema,
                                    committer)
            finally:
                bar.close()
        missing = sorted(set(range(n_parts)) - set(sd.committed()))
        if missing:
            raise RunError(f"[{name}] parts {missing[:10]} did not commit; rerun to resume")
        counts = [sd.part_counts(p) for p in range(n_parts)]
        info = {}
        if stage.finalize is not None:
            tmp = sd.tmp / "finalize"
            tmp.mkdir(parents=True, exist_ok=True)
            ctx = FinalizeCtx(counts=counts, read=TableReader(str(self.run_dir),
                                                              tuple(self.roots.items())),
                              map=self.executor.map, root=sd.root, tmp_dir=tmp)
            info = stage.finalize(self.config, ctx) or {}
        total = functools.reduce(add_counts, counts, empty_counts())
        manifest = {
            "stage": name, "status": "complete", "fingerprint": fp, "upstream": upstream,
            "config": json.dumps(stage_config(stage, self.config), sort_keys=True),
            "parts": n_parts, "parts_reused": len(before), "rows": total["rows"],
            "rows_in": total["rows_in"], "rows_kept": total["rows_kept"],
            "rows_rejected": total["rows_rejected"], "reason_counts": total["reason_counts"],
            "wall_s": round(time.time() - t0, 3), "started_at": started, "finished_at": now(),
            "versions": versions()}
        info = _with_notes(info, notes)
        warn = guards.warning(manifest, self.config.run.warn_reject_fraction)
        if warn:
            info["warnings"] = [warn]
            self.log(f"[{name}] WARNING: {warn}")
        write_json(sd.root / "_info.json", info)   # what finalize said, for later up-to-date runs
        sd.finish(manifest)
        self.log(f"[{name}] done: {manifest['rows_in']} in, {manifest['rows_kept']} kept, "
                 f"{manifest['rows_rejected']} rejected in {manifest['wall_s']:.1f}s "
                 f"({manifest['rows_in'] / max(manifest['wall_s'], 1e-3):,.0f} rows/s)"
                 + (f" ({len(before)} parts reused)" if before else ""))
        return StageResult(manifest, "resumed" if before else "ran", info)


def _with_notes(info: dict, notes: list[str]) -> dict:
    """Stage notes plus whatever its finalize reported as skipped (a missing spaCy pipeline)."""
    all_notes = list(notes) + [n for n in info.get("skipped", []) or [] if n not in notes]
    return {**info, "notes": all_notes} if all_notes else dict(info)


def run(config: C.Config, dag: Optional[list[Node]] = None, executor: str = "ray",
        only: Optional[set[str]] = None, log: Callable[[str], None] = print) -> list[StageResult]:
    return Runner(config, dag, executor, log).run(only)
