"""Runs the DAG over a run directory, stage by stage, part by part, resumably.

A stage is skipped when its manifest's fingerprint matches (its config, its code version and
every upstream fingerprint); a changed parameter therefore reruns that stage and everything
downstream. Within a stage, parts committed by an interrupted attempt are kept and only the rest
run. The runner dispatches on each stage's ``kind`` (``stages/base.py``); where parts run is an
executor's business (``executors/``: ``ray`` or ``local``), with the per-part code they share
in ``parts.py``; every commit happens here, on the driver.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import pickle
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pyarrow as pa
from tqdm.auto import tqdm

from vlcurate.stages.base import Kind, Stage, StageConfig
from vlcurate.schemas import F

from . import config as C
from . import executors, guards, homes
from vlcurate.foundation import storage
from .dag import Node, ancestors, default_dag, frontier, select, topo_order
from .executors import Work, spanning_items, work_items
from .executors.tasks import TableReader, Upstream, Workdir, prepare_step, workdir_for
from vlcurate.foundation.params import DEFAULT_RESOURCES, Resources
from .parts import Committer, PartIO, add_counts, batch_rows, computed_groups, empty_counts, \
    pinned_threads, write_null_part
from .rundir import StageDir, fingerprint, manifests_table, now, read_json, write_json, write_table
from vlcurate.foundation.versions import versions

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


def resources(stage: type[Stage], config: Any) -> Resources:
    """The stage's resources: its section's ``resources`` over the stage's defaults over
    DEFAULT_RESOURCES, field by field."""
    sec = section_of(stage, config, stage.name) if stage.name in stage.sections() else None
    over = sec.resources if sec is not None else Resources()
    return over.over(stage.resources).over(DEFAULT_RESOURCES)


def _groups_from(stage: type[Stage], ups: tuple[str, ...], schemas: dict) -> Optional[str]:
    """A per-image stage's funnel decides per image group: the upstream stage holding the
    rows' ``image_group`` (``ids``), if it ran."""
    if not (stage.per_image or stage.image_homes):
        return None
    return next((u for u in ups if F.IMAGE_GROUP.name in schemas.get(u, pa.schema([])).names),
                None)


def stage_sections(stage: type[Stage]) -> tuple[str, ...]:
    """The config sections a stage sees: those it owns, then those it reads."""
    return tuple(dict.fromkeys((*stage.sections(), *(r.split(".")[0] for r in stage.reads))))


def read_fields(stage: type[Stage]) -> dict[str, set[str]]:
    """{section: the only fields of it the stage reads}, for reads naming fields
    (``reads = ("concepts.teacher",)``); a section read whole is not in it."""
    whole = {r for r in stage.reads if "." not in r}
    out: dict[str, set[str]] = {}
    for r in stage.reads:
        sec, _, name = r.partition(".")
        if name and sec not in whole:
            out.setdefault(sec, set()).add(name)
    return out


def section_of(stage: type[Stage], config: Any, name: str) -> Any:
    """Section ``name`` of ``config``; a section the stage owns that a config composed without
    it lacks is its defaults (such a config could not have set it: that is an unknown key)."""
    if name in {f.name for f in dataclasses.fields(config)}:
        return config.section(name)
    if name in stage.sections():
        return stage.sections()[name]()
    raise RunError(f"stage {stage.name!r} reads config section {name!r}, which no stage of this "
                   "DAG owns")


def stage_view(stage: type[Stage], config: Any) -> StageConfig:
    """What an instance of ``stage`` sees of ``config``: ``run`` and its sections."""
    return StageConfig(config.run, tuple((s, section_of(stage, config, s))
                                         for s in stage_sections(stage)))


def build_stage(stage: type[Stage], config: Any, state: Any = None,
                upstream: Optional[dict] = None) -> Stage:
    """An instance of ``stage`` as a worker builds it (its config view, its output schema, its
    ``setup()``), minus the per-chunk wrapping of ``parts.StageCall``: for calling one stage
    directly (unit tests, notebooks)."""
    view = stage_view(stage, config)
    instance = stage(view, state, stage.output_schema(upstream or {}, view))
    instance.setup()
    return instance


def stage_config(stage: type[Stage], config: Any, speed: Optional[dict] = None) -> dict:
    """The sections that shape the stage's output, as they enter its fingerprint: without
    ``resources``, ``out_dir`` and the speed-only fields; a section left empty is omitted."""
    speed = C.speed_only() if speed is None else speed
    out, only = {}, read_fields(stage)
    for sec in stage_sections(stage):
        params = section_of(stage, config, sec)
        d = C.to_dict(params)
        d = {k: v for k, v in d.items() if k in only[sec]} if sec in only else d
        unset = [f.name for f in dataclasses.fields(params) if f.name in
                 params.fingerprint_when_set and getattr(params, f.name) == f.default]
        for key in ("resources", "out_dir", *speed.get(sec, ()), *unset):
            d.pop(key, None)       # speed, never output: no rerun when they change
        if d:
            out[sec] = d
    return out


@dataclass
class FinalizeCtx:
    """What a stage's ``finalize`` gets: the parts' counts, a reader of committed parts, a
    parallel ``map`` (Ray tasks), the stage's folder (``root``, a path or a URI), a scratch
    folder beside it that workers see (``tmp_dir``), and its global step's files on this node
    (``workdir``, a local path)."""
    counts: list[dict]
    read: TableReader
    map: Callable
    root: str
    tmp_dir: str
    workdir: str
    state: Any = None     # what the stage's global step returned (has_prepare), else None

    def uri(self, name: str) -> str:
        return storage.join(self.root, name)

    def write_bytes(self, name: str, data: bytes) -> str:
        storage.write_bytes(self.uri(name), data)
        return self.uri(name)

    def publish(self, local_file: str, name: str) -> str:
        """Copy a local file (from ``workdir``) into the stage's folder, as ``name``."""
        with open(local_file, "rb") as fh:
            return self.write_bytes(name, fh.read())


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
        self.speed = C.speed_only(self.dag)
        self.images: dict[str, dict] = {}    # per-image stages: distinct images, home pass's count

    @property
    def executor(self) -> Any:
        if self._executor is None:
            self._executor = executors.make(self.executor_name, self.config.ray,
                                            self.config.run.intra_op_threads)
        return self._executor

    def view(self, stage: type[Stage]) -> StageConfig:
        return stage_view(stage, self.config)

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
                  F.MK.STARTED: now(), "versions": versions()}
        with RunLock(self.run_dir):
            if meta == self.run_dir:       # first, so that a run in progress can be inspected
                write_json(storage.join(meta, "run.json"), record)
            results: dict[str, StageResult] = {}
            for node in self.dag:
                results[node.name] = self.run_stage(node, results, only)
                stop = guards.stop_reason(results[node.name].manifest,
                                          self.config.run.max_reject_fraction, self.dag)
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
        upstream = {a: results[a].manifest[F.MK.FINGERPRINT] for a in ups}
        extra: dict = {}
        view = self.view(stage)
        if stage.kind == Kind.SOURCE:
            extra["source_signature"] = stage.signature(view)
        elif len(ups) > 1:  # which rows are still kept can depend on it (conservatively)
            extra["compute_on_flagged"] = self.config.run.compute_on_flagged
        env = stage.environment(view)   # e.g. which spaCy pipeline / OCR backend is installed
        if env:
            extra["environment"] = env
        run = C.to_dict(self.config.run)
        extra.update({k: run[k] for k, default in _NUMERICS.items() if run[k] != default})
        # (only when changed: default fingerprints stay)
        return fingerprint(node.name, stage.version, stage_config(stage, self.config, self.speed),
                           upstream, extra), upstream

    def _progress(self, name: str, pending: list[int], node: Node) -> tuple[Any, bool]:
        """A bar in rows (rows/s and ETA), counted from the source's committed parts; a source
        stage, whose part sizes are not known before it reads them, counts parts."""
        ups = ancestors(self.dag, node)
        off = not self.config.run.progress
        if not ups:
            return tqdm(total=len(pending), desc=name, unit="part", disable=off, leave=False), False
        source = self.stage_dir(ups[0])
        total = sum(source.part_counts(p)[F.MK.ROWS] for p in pending)
        return tqdm(total=total, desc=name, unit="row", unit_scale=True, disable=off, leave=False,
                    smoothing=0.1), True

    def _nothing_to_compute(self, node: Node, results: dict[str, StageResult]) -> bool:
        """Every row was flagged upstream (an ancestor kept none of the rows it saw, and nothing
        it did not see is left), and this stage computes only kept rows."""
        stage = node.stage
        if stage.kind == Kind.SOURCE or stage.all_rows or self.config.run.compute_on_flagged:
            return False
        return any(results[a].manifest[F.MK.ROWS_KEPT] == 0 for a in ancestors(self.dag, node))

    def run_stage(self, node: Node, results: dict[str, StageResult],
                  only: Optional[set[str]]) -> StageResult:
        stage, name = node.stage, node.name
        sd = self.stage_dir(name)
        fp, upstream = self.fingerprint(node, results)
        m, notes = sd.manifest(), stage.notes(self.view(stage))
        complete = bool(m) and m.get(F.MK.FINGERPRINT) == fp and m.get("status") == "complete"
        redo = self.to_redo(node, sd, m["parts"], results) if complete else set()
        if complete and not redo:
            self.log(f"[{name}] up to date ({m[F.MK.ROWS]} rows, fingerprint {fp}): skipped")
            info = sd.read_json("_info.json") or {}
            return StageResult(m, "skipped", _with_notes(info, notes))
        if only is not None and name not in only:
            raise RunError(f"stage {name!r} is not up to date with this config, and only "
                           f"{sorted(only)} may run here: run `vlcurate run` first")
        if complete:
            self.log(f"[{name}] up to date, but parts {sorted(redo)[:10]} are damaged or depend "
                     f"on redone upstream parts: redoing {len(redo)} of {m['parts']} parts")
            started = m.get(F.MK.STARTED) or now()
        else:
            att = sd.attempt()
            if not att or att.get(F.MK.FINGERPRINT) != fp:
                if m or att:     # an earlier run's output that no longer matches: say why
                    self.log(f"[{name}] recomputing: its config, code version or an upstream "
                             f"stage changed since the last run (fingerprint "
                             f"{(m or att).get(F.MK.FINGERPRINT)} -> {fp})")
                sd.reset()
            started = (att or {}).get(F.MK.STARTED) or now()
        t0 = time.time()
        n_parts, specs = self.plan(node, sd, results)
        if not complete and sd.committed():   # resuming: the committed parts must be sound too
            redo = self.to_redo(node, sd, n_parts, results)
        sd.uncommit(redo)
        sd.begin({F.MK.FINGERPRINT: fp, "parts": n_parts, F.MK.STARTED: started})
        before = set(sd.committed())
        pending = [p for p in range(n_parts) if p not in before]
        if pending:
            self.compute(node, sd, n_parts, pending, specs, results)
        missing = sorted(set(range(n_parts)) - set(sd.committed()))
        if missing:
            raise RunError(f"[{name}] parts {missing[:10]} did not commit; rerun to resume")
        counts = [sd.part_counts(p) for p in range(n_parts)]
        info = _with_notes(self.finalize(stage, sd, counts), notes)
        if name in self.images:
            seen = self.images[name]
            info["images"] = {"distinct": seen["distinct"], "computed": seen["home_pass"] + sum(
                c.get(F.MK.IMAGES, 0) for c in counts)}
        manifest = self.manifest(name, fp, upstream, stage, counts, len(before), t0, started)
        warn = guards.warning(manifest, self.config.run.warn_reject_fraction, self.dag)
        if warn:
            info["warnings"] = [warn]
            self.log(f"[{name}] WARNING: {warn}")
        sd.write_json("_info.json", info)   # what finalize said, for later up-to-date runs
        sd.finish(manifest)
        self.log(f"[{name}] done: {manifest[F.MK.ROWS_IN]} in, {manifest[F.MK.ROWS_KEPT]} kept, "
                 f"{manifest[F.MK.ROWS_REJECTED]} rejected in {manifest[F.MK.WALL_S]:.1f}s "
                 f"({manifest[F.MK.ROWS_IN] / max(manifest[F.MK.WALL_S], 1e-3):,.0f} rows/s)"
                 + (f" ({len(before)} parts reused)" if before else ""))
        status = "repaired" if complete else "resumed" if before else "ran"
        return StageResult(manifest, status, info, frozenset(pending))

    def to_redo(self, node: Node, sd: StageDir, n_parts: int,
                results: dict[str, StageResult]) -> set[int]:
        """Parts to recompute: the damaged ones (``StageDir.damaged``), and those an upstream
        stage redid in this run. A stage with a global step (``prepare``) depends on every upstream
        part (one that ``spans_parts``, on its chunks' neighbours), so any redone upstream part
        redoes all of it (and so export's finalize reruns)."""
        redone = set().union(*(results[u].redone for u in ancestors(self.dag, node)))
        if redone and (node.stage.has_prepare(self.view(node.stage)) or node.stage.spans_parts
                       or (node.stage.image_homes and homes.spanned(sd.uri("_homes")))):
            return set(range(n_parts))
        return {p for p in redone if p < n_parts} | set(sd.damaged(n_parts))

    def plan(self, node: Node, sd: StageDir, results: dict[str, StageResult]
             ) -> tuple[int, Optional[list[dict]]]:
        """How many parts (and, for the source, each part's spec)."""
        if node.stage.kind == Kind.SOURCE:
            if storage.is_local(sd.root):
                storage.makedirs(sd.root)
            specs = node.stage.plan(self.view(node.stage), sd.uri("_plan.parquet"))
            return len(specs), specs
        return results[ancestors(self.dag, node)[0]].manifest["parts"], None

    def part_io(self, node: Node, specs: Optional[list[dict]]) -> tuple[PartIO, dict]:
        stage, ups, view = node.stage, ancestors(self.dag, node), self.view(node.stage)
        schemas = {u: self.stage_dir(u).schema() for u in ups}
        schemas = {u: s for u, s in schemas.items() if s is not None}
        source = stage.kind == Kind.SOURCE
        io = PartIO(run_dir=str(self.run_dir), stage=node.name,
                    stage_root=self.roots.get(node.name), ancestors=ups,
                    frontier=frontier(self.dag, ups),
                    columns={u: stage.input_columns(u, schemas.get(u), view) for u in ups},
                    all_rows=stage.all_rows, all_reasons=stage.all_reasons,
                    compute_on_flagged=self.config.run.compute_on_flagged,
                    source_cfg=view if source else None,
                    read_source=stage.read_part if source else None,
                    preprocess=functools.partial(stage.preprocess, view),
                    groups_from=_groups_from(stage, ups, schemas), funnel=stage.per_image)
        return io, schemas

    def compute(self, node: Node, sd: StageDir, n_parts: int, pending: list[int],
                specs: Optional[list[dict]], results: dict[str, StageResult]) -> None:
        stage, name, view = node.stage, node.name, self.view(node.stage)
        io, schemas = self.part_io(node, specs)
        out_schema = stage.output_schema(schemas, view)
        res = resources(stage, self.config)
        rows = batch_rows(res.batch_size, stage.chunk_rows(view))
        batch = f"chunks of {stage.chunk_rows(view)} rows across parts" if stage.spans_parts \
            else f"batch={rows or 'part'}"
        self.log(f"[{name}] {n_parts} parts" + (f", {n_parts - len(pending)} already committed"
                                                 if len(pending) < n_parts else "")
                 + f" · {self.executor_name} · cpus={res.num_cpus} gpus={res.num_gpus} {batch}")
        if self._nothing_to_compute(node, results):
            self.log(f"[{name}] no row is left to compute: null columns written, stage not run")
            committer = Committer(sd)
            for p in pending:
                write_null_part(io, p, out_schema, committer)
            committer.finish(pending, out_schema)
            return
        state, state_uri = self.global_step(node, sd, io, n_parts, res)
        io = self.image_homes(node, sd, io, n_parts, pending, res, rows, out_schema)
        io, items = self.items(node, io, n_parts, pending, rows, specs is None)
        work = Work(io, stage, view, state, state_uri,
                    self.workdir(sd) if stage.kind == Kind.GLOBAL else None, res,
                    items, specs, out_schema)
        bar, in_rows = self._progress(name, pending, node)
        committer = Committer(sd, on_commit=lambda p, c: bar.update(c[F.MK.ROWS] if in_rows else 1))
        try:
            self.executor.parts(work, committer)
            committer.finish(pending, out_schema)
        finally:
            bar.close()

    def image_homes(self, node: Node, sd: StageDir, io: PartIO, n_parts: int, pending: list[int],
                    res: Resources, rows: int, schema: pa.Schema) -> PartIO:
        """A per-image stage's plan and home pass (``homes.py``): each image whose rows lie in
        several parts computed once, in its home part; the io of the stage's pass replays it."""
        if io.groups_from is None or not node.stage.image_homes:
            return io
        root = sd.uri("_homes")
        if len(pending) == n_parts:          # nothing of this attempt to resume
            storage.delete(root)
        distinct, spanning = homes.plan(functools.partial(computed_groups, io), n_parts,
                                        self.executor.map, root)
        self.images[node.name] = {"distinct": distinct, "home_pass": 0}
        if not spanning:
            return io
        scratch = StageDir(self.run_dir, node.name, root)
        scratch.begin({F.MK.FINGERPRINT: (sd.attempt() or {}).get(F.MK.FINGERPRINT)})
        todo = sorted(set(homes.home_parts(root, n_parts)) - set(scratch.committed()))
        self.log(f"[{node.name}] {spanning} of {distinct} images have rows in several parts: "
                 f"each computed once, in the first ({len(todo)} home parts to compute)")
        if todo:
            hio = dataclasses.replace(io, stage_root=root, images=homes.ImagesIO("home", root))
            sizes = {p: self.stage_dir(io.ancestors[0]).part_counts(p)[F.MK.ROWS] for p in todo}
            work = Work(hio, node.stage, self.view(node.stage), None, None, None, res,
                        work_items(todo, sizes, rows), None, schema)
            committer = Committer(scratch)
            self.executor.parts(work, committer)
            committer.finish(todo, schema)
        self.images[node.name]["home_pass"] = sum(scratch.part_counts(p).get(F.MK.IMAGES, 0)
                                                  for p in homes.home_parts(root, n_parts))
        return dataclasses.replace(io, images=homes.ImagesIO("replay", root))

    def items(self, node: Node, io: PartIO, n_parts: int, pending: list[int], rows: int,
              sized: bool) -> tuple[PartIO, list]:
        """The work items (executors.Work.items) over the pending parts; for a stage that
        ``spans_parts``, also the parts its chunks read without writing (``PartIO.done``)."""
        if not sized:                    # a source: its parts' sizes are known once read
            return io, work_items(pending, None, rows)
        rows_of = self.stage_dir(io.ancestors[0]).part_counts
        if not node.stage.spans_parts:
            return io, work_items(pending, {p: rows_of(p)[F.MK.ROWS] for p in pending}, rows)
        sizes = [rows_of(p)[F.MK.ROWS] for p in range(n_parts)]
        done = frozenset(range(n_parts)) - frozenset(pending)
        return (dataclasses.replace(io, done=done),
                spanning_items(pending, sizes, node.stage.chunk_rows(self.view(node.stage))))

    def global_step(self, node: Node, sd: StageDir, io: PartIO, n_parts: int, res: Resources
                    ) -> tuple[Any, Optional[str]]:
        """A global stage's prepare (one Ray task, with the stage's GPUs), and where its state
        is kept for workers: beside the stage's tables, not in _tmp, so that an actor still
        starting when the stage finishes finds it (the next attempt replaces it)."""
        if not node.stage.has_prepare(self.view(node.stage)):
            return None, None
        kinds = {n.name: n.stage.kind for n in self.dag}
        ups = [self.stage_dir(a) for a in ancestors(self.dag, node) if kinds[a] == Kind.GLOBAL]
        read = Upstream(io, self.executor.name, self.config.run.intra_op_threads,
                        sd.uri("_tmp/prepare"),
                        tuple((u.name, u.uri("_state.pkl"), self.workdir(u)) for u in ups))
        state = self.executor.call(prepare_step, node.stage, self.view(node.stage), read, n_parts,
                                   self.workdir(sd), num_gpus=res.num_gpus)
        uri = sd.uri("_state.pkl")
        storage.write_bytes(uri, pickle.dumps(state))
        return state, uri

    def state_of(self, stage: type[Stage], sd: StageDir) -> Any:
        """The global step's state this attempt kept beside the stage's tables (global_step)."""
        uri = sd.uri("_state.pkl")
        if not stage.has_prepare(self.view(stage)) or not storage.exists(uri):
            return None
        return pickle.loads(storage.read_bytes(uri))

    def workdir(self, sd: StageDir) -> Workdir:
        return workdir_for(str(sd.root), (sd.attempt() or {}).get(F.MK.FINGERPRINT, "none"))

    def finalize(self, stage: type[Stage], sd: StageDir, counts: list[dict]) -> dict:
        tmp = sd.uri("_tmp/finalize")
        if storage.is_local(tmp):
            storage.makedirs(tmp)
        workdir = self.workdir(sd)
        ctx = FinalizeCtx(counts=counts, read=TableReader(str(self.run_dir),
                                                          tuple(self.roots.items())),
                          map=self.executor.map, root=str(sd.root), tmp_dir=tmp,
                          workdir=workdir.fetch() if stage.kind == Kind.GLOBAL else workdir.local,
                          state=self.state_of(stage, sd))
        with pinned_threads(self.config.run.intra_op_threads):
            return stage.finalize(self.view(stage), ctx) or {}

    def manifest(self, name: str, fp: str, upstream: dict, stage: type[Stage], counts: list[dict],
                 reused: int, t0: float, started: str) -> dict:
        total = functools.reduce(add_counts, counts, empty_counts())
        return {
            "stage": name, "status": "complete", F.MK.FINGERPRINT: fp, "upstream": upstream,
            "config": json.dumps(storage.redact_tree(stage_config(stage, self.config, self.speed)),
                                 sort_keys=True),
            "parts": len(counts), F.MK.PARTS_REUSED: reused, F.MK.ROWS: total[F.MK.ROWS],
            F.MK.ROWS_IN: total[F.MK.ROWS_IN], F.MK.ROWS_KEPT: total[F.MK.ROWS_KEPT],
            F.MK.ROWS_REJECTED: total[F.MK.ROWS_REJECTED], F.MK.REASON_COUNTS: total[F.MK.REASON_COUNTS],
            F.MK.WALL_S: round(time.time() - t0, 3), F.MK.STARTED: started, F.MK.FINISHED: now(),
            "versions": versions()}


def _with_notes(info: dict, notes: list[str]) -> dict:
    """Stage notes plus whatever its finalize reported as skipped (a missing spaCy pipeline)."""
    all_notes = list(notes) + [n for n in info.get("skipped", []) or [] if n not in notes]
    return {**info, "notes": all_notes} if all_notes else dict(info)


def run(config: C.Config, dag: Optional[list[Node]] = None, executor: str = "ray",
        only: Optional[set[str]] = None, log: Callable[[str], None] = print) -> list[StageResult]:
    return Runner(config, dag, executor, log).run(only)
