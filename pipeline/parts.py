"""Per-part mechanics shared by both executors (Ray Data and in-process): read a part's inputs,
call a stage on the rows still kept, write fragments, and commit whole parts (on the driver).

Nothing here imports ray; ``executors/`` wires these functions into ``map_batches``.
"""
from __future__ import annotations

import base64
import contextlib
import json
import sys
import zlib
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from vlcurate.schemas import F, conform, tables
from vlcurate.stages.arrow import spread
from vlcurate.schemas import reasons as R
from vlcurate.stages.images import image_pass

from . import homes
from .rundir import StageDir

ACTIVE = F.ACTIVE
INTERNAL = (F.PART.name, F.ROW.name, F.PART_ROWS.name, ACTIVE.name, F.WANTED.name,
            F.FLAG_LEVEL.name)

# The committed kept mask. Each stage commits, per part, every row's flag level after it and all
# its ancestors: KEPT (no reason yet), FLAGGED, or MANDATORY (an ingest reason: never computed,
# whatever run.compute_on_flagged says). A stage reads the levels of its frontier (the ancestors
# no other ancestor descends from: one record in a chain) instead of every ancestor's reasons.
KEPT, FLAGGED, MANDATORY = 0, 1, 2


class AlignmentError(RuntimeError):
    pass


@dataclass(frozen=True)
class PartIO:
    """Everything a worker needs to read and write one stage's parts (picklable)."""
    run_dir: str
    stage: str
    stage_root: Optional[str]               # None: <run_dir>/<stage>
    ancestors: tuple[str, ...]              # every upstream stage, in DAG order
    frontier: tuple[str, ...] = ()          # the ancestors that no other ancestor descends from
    columns: dict = field(default_factory=dict)  # upstream -> [column names to read]
    all_rows: bool = False                  # the stage sees every row (export)
    all_reasons: bool = False               # add F.ALL_REASONS: every upstream stage's reasons
    compute_on_flagged: bool = False
    source_cfg: Any = None                  # source stages only
    read_source: Any = None                 # source stages only: fn(source_cfg, spec) -> table
    preprocess: Any = None                  # the stage's CPU-side preprocess(table) -> table
    done: frozenset = frozenset()           # parts committed already: read (a spanning chunk's
                                            # context), never written again
    groups_from: Optional[str] = None       # a per-image stage: the stage holding image_group
    images: Any = None                      # a per-image stage's image pass (homes.ImagesIO)
    funnel: bool = True                     # compute every row of a kept row's image group

    def dir(self, stage: Optional[str] = None) -> StageDir:
        if stage is None or stage == self.stage:
            return StageDir(self.run_dir, self.stage, self.stage_root)
        return StageDir(self.run_dir, stage)


def _with_position(t: pa.Table, part: int, active: np.ndarray, levels: np.ndarray,
                   wanted: Optional[np.ndarray] = None) -> pa.Table:
    n = t.num_rows
    return (t.append_column(F.PART.name, pa.array(np.full(n, part, np.int64)))
             .append_column(F.ROW.name, pa.array(np.arange(n, dtype=np.int64)))
             .append_column(F.PART_ROWS.name, pa.array(np.full(n, n, np.int64)))
             .append_column(ACTIVE.name, pa.array(active, pa.bool_()))
             .append_column(F.WANTED.name, pa.array(active if wanted is None else wanted,
                                                    pa.bool_()))
             .append_column(F.FLAG_LEVEL.name, pa.array(levels, pa.int8())))


def group_rows(groups: list, wanted: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """The rows a per-image stage computes: every row of an image group that has a wanted row
    (never one an ingest reason rejected: it has no image)."""
    keep = {g for g, w in zip(groups, wanted) if w and g is not None}
    return wanted | (np.array([g in keep for g in groups], bool) & (levels < MANDATORY))


def flag_levels(reasons: list) -> np.ndarray:
    """Each row's level from its reasons in one stage."""
    return np.array([MANDATORY if any(r.startswith(R.MANDATORY_PREFIX) for r in rs or ()) else
                     FLAGGED if rs else KEPT for rs in reasons], np.int8)


def pack_levels(levels: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(levels.astype(np.int8).tobytes(), 6)).decode()


def unpack_levels(text: str) -> np.ndarray:
    return np.frombuffer(zlib.decompress(base64.b64decode(text)), np.int8)


def read_inputs(io: PartIO, part: int, spec: Optional[dict] = None, lo: int = 0,
                hi: Optional[int] = None) -> pa.Table:
    """Rows [lo, hi) of part ``part`` of every input, zipped by row (co-partitioned tables), plus
    position columns and ``_active``: the row is still kept (no upstream stage flagged it)."""
    t = _read(io, part, spec)
    if lo or (hi is not None and hi < t.num_rows):
        t = t.slice(lo, (t.num_rows if hi is None else hi) - lo)
    return io.preprocess(t) if io.preprocess is not None and t.num_rows else t


def read_item(io: PartIO, ranges, specs=None) -> pa.Table:
    """The rows of one work item (``executors.Work.items``: ranges (part, lo, hi)), in order;
    ``specs[part]``: a source part's spec. An empty part yields no rows: the driver commits it
    (nothing is committed in a worker)."""
    out = [read_inputs(io, p, specs[p] if specs else None, lo, hi) for p, lo, hi in ranges]
    nonempty = [t for t in out if t.num_rows] or out[:1]
    return pa.concat_tables(nonempty) if len(nonempty) > 1 else nonempty[0]


def batch_rows(batch_size: Optional[int], chunk_rows: int) -> int:
    """``resources.batch_size`` rounded up to a whole number of chunks (0: a whole part)."""
    return -(-batch_size // chunk_rows) * chunk_rows if batch_size else 0


def chunks(batch: pa.Table, size: int) -> list[tuple[int, int]]:
    """The batch's slices [lo, hi), one per chunk of ``size`` rows of one part, aligned to the
    part's first row. A batch must hold whole chunks: a cut chunk would change the numerics."""
    part = batch.column(F.PART.name).to_numpy()
    row = batch.column(F.ROW.name).to_numpy()
    if not len(row):
        return []
    cut = np.flatnonzero((np.diff(part) != 0) | (np.diff(row // size) != 0) | (np.diff(row) != 1))
    n = batch.column(F.PART_ROWS.name).to_numpy()
    out = list(zip(np.r_[0, cut + 1].tolist(), np.r_[cut + 1, len(row)].tolist()))
    for lo, hi in out:
        first, last = int(row[lo]), int(row[hi - 1]) + 1
        if first % size or (last % size and last != n[lo]):
            raise AlignmentError(f"part {part[lo]}: rows [{first}, {last}) cut a chunk of {size} "
                                 "rows: batches must hold whole chunks")
    return out


def spanning_chunk(batch: pa.Table, size: int) -> list[tuple[int, int]]:
    """A ``spans_parts`` stage's batch as its one chunk (executors.spanning_items), checked: at
    most ``size`` rows, consecutive in (part, row) order across parts."""
    part, row = (batch.column(c.name).to_numpy() for c in (F.PART, F.ROW))
    n = batch.column(F.PART_ROWS.name).to_numpy()
    same = (np.diff(part) == 0) & (np.diff(row) == 1)
    turn = (np.diff(part) > 0) & (row[1:] == 0) & (row[:-1] == n[:-1] - 1)
    if len(row) > size or not (same | turn).all():
        raise AlignmentError(f"a batch of {len(row)} rows is not one chunk of at most {size} "
                             "consecutive rows")
    return [(0, len(row))]


@contextlib.contextmanager
def pinned_threads(n: int):
    """Run with ``n`` intra-op threads (torch, BLAS, OpenMP): reductions split across threads
    round differently, so the thread count is fixed by config, never by the machine or Ray."""
    from threadpoolctl import threadpool_limits
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        torch.set_num_threads(n)
    try:
        with threadpool_limits(limits=n):
            yield
    finally:
        if torch is not None:
            torch.set_num_threads(before)


def _read(io: PartIO, part: int, spec: Optional[dict]) -> pa.Table:
    if io.read_source is not None:
        t = io.read_source(io.source_cfg, spec)
        return _with_position(t, part, np.ones(t.num_rows, bool), np.zeros(t.num_rows, np.int8))
    levels = None if io.all_reasons else _committed_levels(io, part)
    table, levels = _read_ancestors(io, part, levels)
    top = MANDATORY if io.compute_on_flagged else FLAGGED
    active = np.ones(table.num_rows, bool) if io.all_rows else levels < top
    if io.groups_from is None or io.all_rows or (io.images is None and (
            active.all() or not io.funnel)):
        return _with_position(table, part, active, levels)
    groups = io.dir(io.groups_from).read(part, columns=[F.IMAGE_GROUP.name]).column(0).to_pylist()
    computed = group_rows(groups, active, levels) if io.funnel else active
    t = _with_position(table, part, computed, levels, active)
    return t if io.images is None else homes.attach(io, part, t, groups)


def computed_groups(io: PartIO, part: int) -> list[str]:
    """The distinct image groups a per-image stage computes in ``part`` (``group_rows``), in
    order: what ``homes.plan`` reads of each part."""
    t = _read(replace(io, columns={}, preprocess=None, images=None), part, None)
    if not t.num_rows:
        return []
    groups = io.dir(io.groups_from).read(part, columns=[F.IMAGE_GROUP.name]).column(0).to_pylist()
    active = t.column(ACTIVE.name).to_numpy(zero_copy_only=False)
    return list(dict.fromkeys(g for g, a in zip(groups, active) if a and g is not None))


def _committed_levels(io: PartIO, part: int) -> Optional[np.ndarray]:
    """The rows' levels after every ancestor, from the frontier's commit records (each folds in
    its own ancestors); None when a record predates them (an older run directory)."""
    out = None
    for up in io.frontier:
        text = (io.dir(up).record(part) or {}).get(F.MK.FLAG_LEVELS)
        if text is None:
            return None
        lv = unpack_levels(text)
        if out is not None and len(lv) != len(out):
            raise AlignmentError(f"part {part}: the committed flag levels of {io.frontier} hold "
                                 f"{len(lv)} and {len(out)} rows: rerun those stages")
        out = lv if out is None else np.maximum(out, lv)
    return out


def _read_ancestors(io: PartIO, part: int, levels: Optional[np.ndarray]
                    ) -> tuple[pa.Table, np.ndarray]:
    """The columns the stage reads, zipped by row (co-partitioned tables); the ancestors'
    reasons too when the levels are not committed or the stage wants every reason."""
    with_reasons = levels is None
    ids, cols, all_reasons = None, {}, []
    for up in io.ancestors:
        want = [c for c in io.columns.get(up, ()) if c not in (F.SAMPLE_ID.name, F.REASONS.name)]
        if ids is not None and not want and not with_reasons:
            continue
        t = io.dir(up).read(part, columns=[F.SAMPLE_ID.name,
                                           *([F.REASONS.name] if with_reasons else []), *want])
        if ids is None:
            ids = t.column(F.SAMPLE_ID.name)
            all_reasons = [[] for _ in range(t.num_rows)]
            levels = np.zeros(t.num_rows, np.int8) if with_reasons else levels
        elif not t.column(F.SAMPLE_ID.name).equals(ids):
            raise AlignmentError(f"{up} part {part} is not row-aligned with {io.ancestors[0]}: "
                                 "rerun that stage (its table does not match the ingest order)")
        if with_reasons:
            rs = t.column(F.REASONS.name).to_pylist()
            levels = np.maximum(levels, flag_levels(rs))
            for mine, r in zip(all_reasons, rs):
                mine.extend(r or ())
        for c in want:
            cols[c] = t.column(c)
    if len(levels) != len(ids):
        raise AlignmentError(f"part {part}: the committed flag levels of {io.frontier} hold "
                             f"{len(levels)} rows for {len(ids)}: rerun those stages")
    table = pa.table({F.SAMPLE_ID.name: ids, **cols})
    if io.all_reasons:
        table = table.append_column(F.ALL_REASONS.name, pa.array(all_reasons, F.ALL_REASONS.type))
    return table, levels


class StageCall:
    """Wraps a stage for ``map_batches``: the stage is called once per chunk (``run.chunk_rows``,
    or the stage's own ``chunk_rows``, rows of one part, aligned to its first row; a stage that
    ``spans_parts``: the batch, one chunk over parts) with
    ``run.intra_op_threads`` threads, so what it computes never depends on the batch size, the
    concurrency or the executor. Only rows still kept reach the stage; the rows it did not see
    come back with null columns and no reasons, so every input row has an output row."""

    def __init__(self, stage_cls: type, cfg: Any, state: Any = None,
                 schema: Optional[pa.Schema] = None) -> None:
        self.chunk_rows, self.threads = stage_cls.chunk_rows(cfg), cfg.run.intra_op_threads
        self.schema = schema if schema is not None else stage_cls.output
        with pinned_threads(self.threads):
            self.stage = stage_cls(cfg, state, self.schema)
            self.stage.setup()
        self.wants_position, self.spans = stage_cls.wants_position, stage_cls.spans_parts
        self.counts_images = stage_cls.image_homes

    def __call__(self, batch: pa.Table) -> pa.Table:
        bounds = (spanning_chunk(batch, self.chunk_rows) if self.spans
                  else chunks(batch, self.chunk_rows)) or [(0, 0)]
        with pinned_threads(self.threads):
            outs = [self.call_chunk(batch.slice(lo, hi - lo)) for lo, hi in bounds]
        return outs[0] if len(outs) == 1 else pa.concat_tables(outs, promote_options="default")

    def call_chunk(self, batch: pa.Table) -> pa.Table:
        active = batch.column(ACTIVE.name).to_numpy(zero_copy_only=False)
        passes = [c for c in (F.IMAGE_HOME.name, F.IMAGE_VALUE.name) if c in batch.column_names]
        drop = [c for c in INTERNAL if not (self.wants_position and c in (F.PART.name, F.ROW.name))]
        sub = batch.drop_columns(drop + passes)
        if not active.all():
            sub = sub.filter(pa.array(active))
        home = F.IMAGE_HOME.name in passes
        replay = homes.replay_of(batch, active) if F.IMAGE_VALUE.name in passes else None
        with image_pass(sub.num_rows, replay, record=home) as ctx:
            out = self.stage(sub) if sub.num_rows else self.schema.empty_table()
        if out.num_rows != sub.num_rows:
            raise RuntimeError(f"{type(self.stage).__name__} returned {out.num_rows} rows for "
                               f"{sub.num_rows}: a stage must return one row per input row")
        if F.SAMPLE_ID.name in sub.column_names and not out.column(F.SAMPLE_ID.name).equals(
                sub.column(F.SAMPLE_ID.name)):
            raise RuntimeError(f"{type(self.stage).__name__} reordered or changed sample_ids")
        # a per-image stage's rows joined to a kept row's image get no reasons of their own
        wanted = batch.column(F.WANTED.name).to_numpy(zero_copy_only=False) & active
        if not wanted.all():
            out = scatter(out, active, batch.column(F.SAMPLE_ID.name), wanted)
        for c in INTERNAL:
            out = out.append_column(c, batch.column(c))
        if self.counts_images:
            computed = np.zeros(out.num_rows, np.int64)
            computed[:1] = ctx.computed
            out = out.append_column(F.IMAGES, pa.array(computed))
        if home:
            out = out.append_column(F.IMAGE_HOME, batch.column(F.IMAGE_HOME.name)).append_column(
                F.IMAGE_VALUE, homes.values_of(batch.column(F.IMAGE_HOME.name), active, ctx))
        return out


def scatter(out: pa.Table, active: np.ndarray, ids: pa.ChunkedArray,
            flags: Optional[np.ndarray] = None) -> pa.Table:
    """Spread the rows computed for ``active`` back over every row; the others get nulls. Only
    the rows in ``flags`` (default: ``active``) keep their reasons."""
    full = spread(out, active)
    full = full.set_column(full.schema.get_field_index(F.SAMPLE_ID.name), F.SAMPLE_ID, ids)
    i = full.schema.get_field_index(F.REASONS.name)
    if i >= 0:
        empty = pa.scalar([], F.REASONS.type)
        keep = active if flags is None else flags
        full = full.set_column(i, F.REASONS, pc.if_else(pa.array(keep), full.column(i), empty))
    return full


def write_fragments(batch: pa.Table, io: PartIO) -> pa.Table:
    """Write each contiguous run of rows of each part as a fragment; return one record each."""
    if io.done and batch.num_rows:
        batch = batch.filter(pa.array(~np.isin(batch.column(F.PART.name).to_numpy(),
                                               np.fromiter(io.done, np.int64))))
    if batch.num_rows == 0:
        return pa.table({"record": pa.array([], pa.string())})
    order = pc.sort_indices(batch, [(F.PART.name, "ascending"), (F.ROW.name, "ascending")])
    batch = batch.take(order)
    part = batch.column(F.PART.name).to_numpy()
    row = batch.column(F.ROW.name).to_numpy()
    breaks = np.flatnonzero((np.diff(part) != 0) | (np.diff(row) != 1)) + 1
    sd = io.dir()
    records = []
    for lo, hi in zip(np.r_[0, breaks], np.r_[breaks, len(part)]):
        frag = batch.slice(lo, hi - lo)
        p, r0, r1 = int(part[lo]), int(row[lo]), int(row[hi - 1]) + 1
        if F.IMAGE_HOME.name in frag.column_names:
            frag = homes.spill(frag, io.images.root, p, r0).select(
                [c for c in (F.SAMPLE_ID.name, *INTERNAL, F.IMAGES.name) if c in frag.column_names])
        counts = fragment_counts(frag)
        rejects = rejects_of(frag, io.stage)
        data = frag.drop_columns([c for c in (*INTERNAL, F.IMAGES.name) if c in frag.column_names])
        sd.write_fragment(p, r0, r1, data, rejects)
        records.append(json.dumps({"part": p, F.MK.ROWS: r1 - r0, "part_rows":
                                   int(frag.column(F.PART_ROWS.name)[0].as_py()), **counts,
                                   F.MK.FIRST_ROW: r0,
                                   F.MK.FLAG_LEVELS: pack_levels(levels_after(frag))}))
    return pa.table({"record": pa.array(records, pa.string())})


def levels_after(frag: pa.Table) -> np.ndarray:
    """The rows' flag levels after this stage: the input's, raised by this stage's reasons."""
    before = frag.column(F.FLAG_LEVEL.name).to_numpy(zero_copy_only=False)
    if F.REASONS.name not in frag.column_names:
        return before
    return np.maximum(before, flag_levels(frag.column(F.REASONS.name).to_pylist()))


def _flagged_active(frag: pa.Table) -> tuple[np.ndarray, list]:
    active = frag.column(F.WANTED.name).to_numpy(zero_copy_only=False)
    reasons = frag.column(F.REASONS.name).to_pylist() if F.REASONS.name in frag.column_names \
        else [[]] * frag.num_rows
    flagged = np.array([bool(r) for r in reasons], bool) & active
    return flagged, reasons


def fragment_counts(frag: pa.Table) -> dict:
    flagged, reasons = _flagged_active(frag)
    active = frag.column(F.WANTED.name).to_numpy(zero_copy_only=False)
    rc = Counter(r for i in np.flatnonzero(flagged) for r in reasons[i])
    images = frag.column(F.IMAGES.name) if F.IMAGES.name in frag.column_names else None
    return {F.MK.ROWS_IN: int(active.sum()), F.MK.ROWS_KEPT: int((active & ~flagged).sum()),
            F.MK.ROWS_REJECTED: int(flagged.sum()), F.MK.REASON_COUNTS: dict(rc),
            **({F.MK.IMAGES: int(pc.sum(images).as_py() or 0)} if images is not None else {})}


def rejects_of(frag: pa.Table, stage: str) -> Optional[pa.Table]:
    flagged, _ = _flagged_active(frag)
    if not flagged.any():
        return None
    t = frag.filter(pa.array(flagged))
    t = t.select([c for c in (F.SAMPLE_ID.name, F.REASONS.name, F.REASON_DETAIL.name)
                  if c in t.column_names])
    t = t.append_column(F.STAGE.name, pa.array([stage] * t.num_rows, pa.string()))
    return conform(t, tables.REJECTS)


_COUNTS = (F.MK.ROWS, F.MK.ROWS_IN, F.MK.ROWS_KEPT, F.MK.ROWS_REJECTED, F.MK.IMAGES)


def empty_counts() -> dict:
    return {**{k: 0 for k in _COUNTS}, F.MK.REASON_COUNTS: {}}


def add_counts(a: dict, b: dict) -> dict:
    rc = Counter(a.get(F.MK.REASON_COUNTS, {}))
    rc.update(b.get(F.MK.REASON_COUNTS, {}))
    return {**{k: a.get(k, 0) + b.get(k, 0) for k in _COUNTS}, F.MK.REASON_COUNTS: dict(rc)}


class Committer:
    """Driver side: collects fragment records and commits each part once all its rows are in;
    ``finish`` commits, empty, the parts that yielded no rows."""

    def __init__(self, sd: StageDir, on_commit=None) -> None:
        self.sd = sd
        self.acc: dict[int, dict] = {}
        self.on_commit = on_commit
        self.committed: list[int] = []
        self.levels: dict[int, dict[int, np.ndarray]] = {}

    def add(self, record: str | dict) -> None:
        rec = json.loads(record) if isinstance(record, str) else record
        p = rec["part"]
        acc = self.acc[p] = add_counts(self.acc.get(p, empty_counts()), rec)
        self.levels.setdefault(p, {})[rec[F.MK.FIRST_ROW]] = unpack_levels(rec[F.MK.FLAG_LEVELS])
        if acc[F.MK.ROWS] == rec["part_rows"]:
            pieces = self.levels.pop(p)
            levels = np.concatenate([pieces[r] for r in sorted(pieces)])
            self.sd.commit(p, {**acc, F.MK.FLAG_LEVELS: pack_levels(levels)})
            del self.acc[p]
            self.committed.append(p)
            if self.on_commit:
                self.on_commit(p, acc)
        elif acc[F.MK.ROWS] > rec["part_rows"]:
            raise RuntimeError(f"{self.sd.name}: part {p} received {acc[F.MK.ROWS]} rows for "
                               f"{rec['part_rows']}")

    def finish(self, parts: list[int], schema: pa.Schema) -> None:
        """After the executor: a part with no record had no rows (an empty source part, or one
        whose rows all come from an empty upstream part); one with some records but not all its
        rows is an error."""
        if self.acc:
            p = min(self.acc)
            raise RuntimeError(f"{self.sd.name}: part {p} received {self.acc[p][F.MK.ROWS]} rows, "
                               "not all of them")
        done = set(self.committed)
        for p in parts:
            if p not in done:
                self.sd.write_fragment(p, 0, 0, schema.empty_table(), None)
                self.sd.commit(p, {**empty_counts(),
                                   F.MK.FLAG_LEVELS: pack_levels(np.zeros(0, np.int8))})
                self.committed.append(p)
                if self.on_commit:
                    self.on_commit(p, empty_counts())


def write_null_part(io: PartIO, part: int, schema: pa.Schema, committer: Committer) -> None:
    """Commit ``part`` for a stage that has no row left to compute (every row was flagged
    upstream): every row gets null columns and no reasons, as the stage would have given the
    rows it skips, without building the stage (no model load, no actor)."""
    t = _read(io, part, None)
    if t.num_rows == 0:
        return                       # committed empty by committer.finish
    active = t.column(ACTIVE.name).to_numpy(zero_copy_only=False)
    out = scatter(schema.empty_table(), np.zeros(t.num_rows, bool), t.column(F.SAMPLE_ID.name))
    for c in INTERNAL:
        out = out.append_column(c, t.column(c))
    assert not active.any(), f"{io.stage}: part {part} has rows to compute"
    for rec in write_fragments(out, io).column("record").to_pylist():
        committer.add(rec)
