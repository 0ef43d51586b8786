"""Stage ``positives``: the positives table (FFF Eq. 1 false negatives + HELIP duplicates).

Why a stage of its own, after ``hpm``, rather than more columns of ``hpm``:

* it runs after noise removal, so (with ``hpm.noise_action: drop``) noise pairs are neither
  given positives nor named as anyone's positive: the trainer's multi-positive labels only
  point at rows that survived;
* its table is exactly the positives table (sample_id, ids, captions, relations, scores, count),
  which the trainer reads on its own; changing an FFF threshold reruns this stage, not HPM.

Candidates (one neighbour pass serves both stages): when hpm ran its neighbour pass (hpm.method
exact, blocks or auto), a row's candidates are its ``hpm_pair_ids``, every pair the pass found
above hpm's floors (positives.candidates.image/text/cross, in the spaces this rule judges: the
cross-modal one when there is one); this stage only applies the rule to them, with exact
similarities, and searches nothing. The floors must not be above the thresholds, which the
preflight checks (``floor_problems``). With an exhaustive pass (exact, or auto up to
hpm.engine.exact_max_n rows) the result is then exact Eq. 1 (tested), short only of pairs
positives.candidates.max_pairs cut (counted in the summary). A partial pass routes each row on the
joint HELIP vector, which alone misses pairs near in one space only (an image with an unrelated
caption: 53-63% found, tests/benchmarks/bench_one_space_pairs.py), so it also searches one-space
layouts (stages/mining/engine/spaces.py, hpm.engine.pair_probe clusters per row and space): with the
default 8, 0.99-1.0 of those planted pairs are found. With hpm.engine.pair_probe 0, hpm.method fast
or no hpm stage in the DAG, this stage runs its own search, exact blockwise or per-space IVF-PQ
(``use_fast``). Sec. 4.3's recaptions join after hpm, so a pair whose only link is a recaption is
found only if one of the pass's floors fires on it too (positives.candidates.cross = 0.24 below p1
= 0.27 leaves a margin).

Vectors (stored once): with hpm's pass as the candidates, the global step collects
ids and positions only, and the rule reads hpm's vectors, sorted by cluster in hpm's
``_prepare/pass/``, at each row's sorted position (``sorted_rows.npy``, through
store.Gathered; the runner hands the step hpm's state: ``read.prepared``). On an object store
the actors fetch hpm's files once per node. Without hpm's state (no hpm upstream, FastHPM, a
run directory from before, or files deleted) it collects its own vectors, with the same result.

The rule (fff.py): with ``embed.cross_model`` set, FFF's full Eq. 1 on the cross-modal
embeddings, and with recaptions (stage ``recaption_embed``, ``positives.recaptions`` > 0) over
images x k captions (sec. 4.3); without one, only S_ii > p2 or S_tt > p3 on HELIP's unimodal
encoders, which the run summary says plainly. The method (exact blockwise or per-space IVF-PQ),
device, seed and the duplicate threshold come from the ``hpm`` section, so the two stages agree on
what a duplicate is. Positives cut by ``positives.max_positives`` are counted per row
(``positive_count``) and in total (the stage's info and a summary note).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import pyarrow as pa
from vlcurate.schemas import F
from vlcurate.schemas import embed as E
from vlcurate.schemas import mining as M
from vlcurate.schemas import recaption as RC
from vlcurate.foundation.params import DataError, Params, at_least, doc, positive, within
from vlcurate.stages.base import Finding, GlobalStage, Resources, reasons_array

from . import engine, fff, hpm
from .hpm_stage import EMBED, HpmState, set_threads, use_fast
from .pass_io import pass_dir, pass_params
from vlcurate.stages.arrow import masked_lists, spread
from .store import Gathered, Store, StoreMeta, collect, vectors

if TYPE_CHECKING:
    from vlcurate.stages.base import Prepared

log = logging.getLogger(__name__)

CROSS = (E.CROSS_IMAGE_EMB_NAME, E.CROSS_TEXT_EMB_NAME)
RECAPTIONS = "recaption_embed"     # the recaptions' cross-modal embeddings, by stage name


HPM = "hpm"


def uses_pass(config: Any, names: Sequence[str], n: Optional[int] = None) -> bool:
    """Candidates from hpm's pass: its table has the pair lists, hpm ran the pass, and (given
    ``n``, the rows mined) the pass is exhaustive or also searched its one-space layouts
    (hpm.engine.pair_probe > 0): the joint routing alone misses pairs close in one space only (an
    image with an unrelated caption: FFF's main case)."""
    if config.hpm.method == "fast" or M.PAIR_IDS.name not in names:
        return False
    if n is None:
        return True
    p = pass_params(config, n)
    return p.probe >= p.clusters(n) or p.space_probe > 0


SOURCE = "candidates.txt"      # the global step's word on where the candidates came from


def source(config: Any, n: int, names: Sequence[str], pairs: bool, fast: bool,
           ran: Optional[engine.PassParams] = None) -> str:
    """Where this run's candidate pairs come from (``pairs``: hpm's pass over ``n`` rows, with
    the parameters it ran with when known (``ran``: its calibrated probe), ``fast``: IVF-PQ),
    for the stage's info and the run summary."""
    h = config.hpm
    if pairs:
        p = ran or pass_params(config, n)
        how = ("exhaustive" if p.probe >= p.clusters(n) else
               f"partial: {p.probe} of {p.clusters(n)} joint clusters and "
               f"{p.space_probe} per one-space layout per row")
        return f"hpm's neighbour pass ({how}): its hpm_pair_ids, no search of its own"
    if not n:
        return "none: no row to search"
    why = ("hpm.method is fast" if h.method == "fast" else
           "no hpm_pair_ids upstream" if M.PAIR_IDS.name not in names else
           f"hpm's pass is partial and hpm.engine.pair_probe is 0: {n} rows, hpm.method "
           f"{h.method}, hpm.engine.exact_max_n {h.engine.exact_max_n}")
    return f"its own {'per-space IVF-PQ' if fast else 'exact'} search ({why})"


def floor_problems(config: Any) -> list[tuple[str, str]]:
    """(key, message) for each FFF threshold below the hpm floor that keeps its candidates (the
    pass would not keep every pair the rule needs)."""
    h, p = config.hpm, config.positives
    c, at = p.candidates, "positives.candidates."
    need = [("positives.p2", p.p2, at + "image", c.image),
            ("positives.p3", p.p3, at + "text", c.text)]
    if cross(config):
        need.append(("positives.p1", p.p1, at + "cross", c.cross))
    if p.duplicates and h.dup_threshold is not None:
        need += [("hpm.dup_threshold", h.dup_threshold, at + "image", c.image),
                 ("hpm.dup_threshold", h.dup_threshold, at + "text", c.text)]
    return [(key, f"{key} = {v} is below {floor} = {f}: hpm's pass keeps only the pairs above "
                  f"{floor} as the positives' candidates, so the pairs between them would be "
                  f"missed; lower {floor} to at most {v} (or raise {key})")
            for key, v, floor, f in need if v < f and config.hpm.method != "fast"]


def cross(config: Any) -> bool:
    return config.embed.cross_model is not None


def columns(config: Any) -> tuple[str, ...]:
    return (E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME) + (CROSS if cross(config) else ())


def rule(config: Any) -> fff.Rule:
    p = config.positives
    return fff.Rule(p1=p.p1, p1_text=p.p1_text, p2=p.p2, p3=p.p3, dup=config.hpm.dup_threshold,
                    cross=cross(config), duplicates=p.duplicates)


# recaptions left out of sec. 4.3's k captions: no text, or the same text as a better beam
# (truncated or repetitive ones still describe the image, and the trainer uses them)
SKIP_FLAGS = (RC.FLAG_EMPTY, RC.FLAG_DUPLICATE)


def part_recaptions(t: pa.Table, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row in the part, caption number, vector) of the recaptions sec. 4.3 uses, row by row:
    each row's first ``limit`` recaptions, less SKIP_FLAGS (vectorised: no Python per value)."""
    col = t.column(E.RECAPTION_CROSS_EMB_NAME).combine_chunks()
    sizes = col.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = col.flatten()
    d = col.type.value_type.list_size
    vec = vectors(flat) if len(flat) else np.zeros((0, d), np.float32)
    row = np.repeat(np.arange(len(sizes)), sizes)
    pos = np.arange(len(row)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    keep = np.ones(len(row), bool)
    if RC.RECAPTION_FLAGS.name in t.column_names:
        fl = t.column(RC.RECAPTION_FLAGS.name).combine_chunks().flatten()
        if len(fl) == len(row):
            keep = ~np.isin(fl.fill_null("").to_numpy(zero_copy_only=False), SKIP_FLAGS)
    kept = np.cumsum(keep)                                     # rank among the row's kept ones
    rank = kept - np.repeat(np.concatenate([[0], kept])[np.cumsum(sizes) - sizes], sizes)
    keep &= rank <= limit
    return row[keep], (pos[keep] + 1).astype(np.int8), hpm.normalize(vec[keep])


def gather_recaptions(read: Callable[[int], pa.Table], n_parts: int, store: Store,
                      limit: int, workdir: str) -> Optional[dict]:
    """FFF sec. 4.3's texts: per stored row, its caption then its first ``limit`` recaptions
    (less SKIP_FLAGS), written part by part, row by row, to ``workdir`` files (bounded memory).
    None when no row has any."""
    base = store.vec[E.CROSS_TEXT_EMB_NAME]
    owners, numbers, m, extra = [], [], 0, 0
    path = os.path.join(workdir, "captions.f32")
    with open(path, "wb") as fh:
        for part in range(n_parts):
            t = read(part)
            if E.RECAPTION_CROSS_EMB_NAME not in t.column_names:
                return None
            g = store.locate(np.full(t.num_rows, part), t.column(F.ROW.name).to_numpy())
            row, num, vec = part_recaptions(t, limit)
            ok = g[row] >= 0
            s, c = store.meta.starts[part], store.meta.counts[part]
            local = g[row[ok]] - s                              # stored rows are in row order
            size = 1 + np.bincount(local, minlength=c)
            first = np.concatenate([[0], np.cumsum(size)])
            block = np.empty((first[-1], base.shape[1]), np.float32)
            number = np.zeros(first[-1], np.int8)
            block[first[:-1]] = base[s:s + c]
            at = first[local] + 1 + (np.arange(len(local)) - np.searchsorted(local, local))
            block[at], number[at] = vec[ok], num[ok]
            fh.write(block.tobytes())
            owners.append(np.repeat(np.arange(s, s + c), size))
            numbers.append(number)
            m, extra = m + first[-1], extra + len(local)
    if not extra:
        return None
    paths = {"emb": path, "m": int(m), "dim": int(base.shape[1])}
    for k, v in (("owner", np.concatenate(owners)), ("number", np.concatenate(numbers))):
        paths[k] = os.path.join(workdir, f"captions.{k}.npy")
        np.save(paths[k], v)
    return paths


def hpm_pass(config: Any, read: Any) -> Optional["Prepared"]:
    """hpm's global step, when its pass gives this stage its candidates (exhaustive, or with
    one-space layouts) and its vectors: the rule then reads hpm's sorted copy through ``Gathered``,
    and this stage collects ids only (vectors stored once). None: hpm is not upstream,
    ran FastHPM, or its state (or one an older vlcurate wrote) or files are gone; this
    stage then collects its own vectors."""
    prepared = getattr(read, "prepared", None)      # a plain function in a direct call
    try:
        hp = prepared(HPM) if prepared else None
    except (ModuleNotFoundError, AttributeError) as e:  # a state pickled by an older vlcurate
        log.info("positives: hpm's state in this run was written by another vlcurate (%s); "
                 "collecting the vectors here (same pairs, slower)", e)
        return None
    done = hp.state.pass_state if hp is not None and isinstance(hp.state, HpmState) else None
    if done is None or config.hpm.method == "fast" or not os.path.isdir(pass_dir(hp.workdir.local)):
        return None
    p = done.params
    return hp if p.probe >= p.clusters(done.n) or p.space_probe > 0 else None


SORTED = {E.IMAGE_EMB_NAME: "img", E.TEXT_EMB_NAME: "txt", E.CROSS_IMAGE_EMB_NAME: "ximg",
          E.CROSS_TEXT_EMB_NAME: "xtxt"}       # hpm's sorted vector files (engine.NAMES)


@dataclass(frozen=True)
class SortedSource:
    """Where this stage's rows are in hpm's sorted vectors: hpm's Workdir, its pass folder, its
    rows, and the file of each of our rows' sorted position."""
    workdir: Any
    dir: str
    n: int
    rows_file: str


@dataclass(frozen=True)
class PositivesState:
    """What the global step hands every actor (pickled; paths, no arrays): the collected rows,
    where the candidates come from (``pass_pairs``: hpm's pass's pairs; ``fast``: this stage's
    own IVF-PQ ``indexes``, {space: (file, nprobe)}; neither: an exact search), hpm's sorted
    vectors when read from there, and the recaptions' files (gather_recaptions')."""
    store: StoreMeta
    pass_pairs: bool = False
    fast: bool = False
    sorted: Optional[SortedSource] = None
    captions: Optional[dict] = None
    indexes: dict = field(default_factory=dict)


def sorted_source(meta: StoreMeta, hp: "Prepared", workdir: str) -> SortedSource:
    """Where this stage's rows are in hpm's sorted vectors. Our rows are hpm's less its noise.
    Paths come from hpm's workdir as it is now, never from its state (a run directory copied
    elsewhere, or fetched to another node, would point at the old place)."""
    home = hp.workdir.local
    hpm_rows = Store(dataclasses.replace(hp.state.store, dir=home))
    parts = np.repeat(np.arange(len(meta.counts)), meta.counts)
    at = hpm_rows.locate(parts, np.load(os.path.join(meta.dir, "rows.npy")))
    if (at < 0).any():
        raise RuntimeError(f"positives: {int((at < 0).sum())} kept rows are not among hpm's")
    path = os.path.join(workdir, "sorted_rows.npy")
    np.save(path, np.asarray(engine.load_layout(pass_dir(home))[1])[at])
    return SortedSource(hp.workdir, pass_dir(home), hp.state.pass_state.n, path)


def open_store(meta: StoreMeta, src: Optional[SortedSource]) -> Store:
    """The collected rows, with hpm's sorted vectors in their order when ``src``."""
    store = Store(meta)
    if src is not None:
        src.workdir.fetch()                  # an actor on another node: hpm's files, once
        v, at = engine.load_vectors(src.dir, src.n), np.load(src.rows_file, mmap_mode="r")
        store.vec.update({c: Gathered(getattr(v, x), at) for c, x in SORTED.items()
                          if getattr(v, x) is not None})
    return store


def _features(config: Any, store: Store, captions: Optional[dict], device: Optional[str]
              ) -> fff.Features:
    v = store.vec
    x = [v[c] for c in CROSS] if cross(config) else [None, None]
    own = num = None
    if captions:
        x[1] = np.memmap(captions["emb"], np.float32, "r", shape=(captions["m"], captions["dim"]))
        own, num = (np.load(captions[k], mmap_mode="r") for k in ("owner", "number"))
    return fff.features(v[E.IMAGE_EMB_NAME], v[E.TEXT_EMB_NAME], rule(config), *x, own, num,
                        device)


def _build_indexes(config: Any, f: fff.Features, workdir: str) -> dict:
    """The fast method's per-space IVF-PQ indexes: {space: (file, nprobe)}."""
    out = {}
    for key, (base, _, _) in fff.index_sources(f).items():
        prm = hpm.auto_params(len(base), base.shape[1], nbits=config.hpm.fast.pq_nbits,
                              nprobe=config.positives.nprobe)
        path = os.path.join(workdir, f"{key}.ivfpq")
        hpm.save_index(hpm.build_ivfpq(np.asarray(base, np.float32), prm, config.hpm.engine.seed), path)
        out[key] = (path, prm.nprobe)
    return out


@dataclass(frozen=True)
class Candidates(Params):
    """The floors above which hpm's pass keeps a pair as a candidate for this stage
    (``positives.candidates``); X_*: on the cross-modal model."""
    image: float = within(0.9, -1, 1, doc="S_ii or X_ii above this keeps a pair (at most p2)")
    text: float = within(0.9, -1, 1, doc="S_tt or X_tt above this keeps a pair (at most p3)")
    cross: float = within(0.24, -1, 1, doc=(
        "S_it above this keeps a pair (cross-modal embeddings only; at most p1)"))
    max_pairs: int = positive(256, doc=(
        "candidate pairs kept per row, highest max(S_ii, S_tt, S_it, X_ii, X_tt) first; the "
        "rest are counted in hpm_pairs_cut and the run summary"))


@dataclass(frozen=True)
class PositivesParams(Params):
    """FFF Eq. 1 positives (+ HELIP duplicates): stage ``positives``."""
    p1: float = within(0.27, -1, 1, doc="FFF Eq. 1: S_it > p1 makes a positive (needs "
                                        "embed.cross_model)")
    p1_text: float = within(0.24, -1, 1, doc="p1': a text-text positive also needs S_it > p1'")
    p2: float = within(0.92, -1, 1, doc="S_ii > p2 makes a positive")
    p3: float = within(0.99, -1, 1, doc="S_tt > p3 makes a positive")
    duplicates: bool = doc(True, "list HELIP duplicates (above hpm.dup_threshold) as positives")
    max_positives: int = positive(64, doc=(
        "positives kept per row, best relation first, then highest similarity; the rest are cut "
        "and counted (positive_count, the run summary)"))
    recaptions: int = at_least(5, 0, doc=(
        "FFF sec. 4.3: recaptions per image that join its caption as the k captions (needs "
        "embed.cross_model); 0: sec. 4.1 on the original captions only"))
    candidates: Candidates = doc(Candidates(), "the candidate pairs hpm's pass keeps for this "
                                               "stage")
    k_prime: int = positive(64, doc=(
        "its own search (no candidates from hpm's pass), IVF-PQ above hpm.engine.exact_max_n rows: "
        "candidates per modality"))
    nprobe: Optional[int] = positive(None, doc=(
        "its own IVF-PQ search: lists probed; null: max(64, nlist / 16) (hpm.auto_params)"))
    resources: Resources = Resources()


class PositivesStage(GlobalStage):
    name = "positives"
    version = "3"        # candidates from hpm's pass (hpm_pair_ids)
    Params = PositivesParams
    reads = ("hpm", "embed")   # hpm: the search and duplicate settings; embed: cross_model
    inputs = {EMBED: ()}
    output = M.POSITIVES
    resources = Resources(num_cpus=1, batch_size=0)
    on_actors = True
    wants_position = True
    device_keys = ("hpm.device",)

    @classmethod
    def preflight(cls, config: Any, stages: frozenset[str]) -> list[Finding]:
        """The FFF thresholds against the hpm floors that keep their candidates."""
        if "hpm" not in stages:
            return []
        return [Finding(False, text) for _, text in floor_problems(config)]

    @classmethod
    def input_columns(cls, upstream: str, schema: Optional[pa.Schema], config: Any) -> list[str]:
        if upstream == EMBED:
            return list(columns(config))
        names = schema.names if schema is not None else []
        if upstream == HPM:
            return [M.PAIR_IDS.name] if uses_pass(config, names) else []
        if upstream == RECAPTIONS and cross(config) and config.positives.recaptions:
            return [E.RECAPTION_CROSS_EMB_NAME] if E.RECAPTION_CROSS_EMB_NAME in names else []
        if upstream == "recaption" and cross(config) and config.positives.recaptions:
            return [RC.RECAPTION_FLAGS.name] if RC.RECAPTION_FLAGS.name in names else []
        return []

    @classmethod
    def notes(cls, config: Any) -> list[str]:
        out = [] if cross(config) else [
            "positives: no cross-modal model (embed.cross_model is null), so FFF Eq. 1's "
            "main clause S_it > p1 is OFF and S_tt > p3 is not gated by S_it > p1': positives "
            "come only from S_ii > p2 or S_tt > p3 on HELIP's unimodal encoders (and HELIP "
            "duplicates). Set embed.cross_model (a CLIP) for the full rule."]
        if config.hpm.method == "fast":
            out.append("positives: hpm.method is fast (FastHPM finds no candidate pairs), so "
                       "positives runs a second search of its own (per-space IVF-PQ above "
                       "hpm.engine.exact_max_n rows, exact below)")
        return out

    @classmethod
    def prepare(cls, config: Any, read: Callable[[int], pa.Table], n_parts: int,
                workdir: str) -> PositivesState:
        h, p = config.hpm, config.positives
        set_threads(h.build_threads)
        hp = hpm_pass(config, read)
        meta = collect(read, n_parts, workdir, columns(config), write=hp is None)
        pairs = bool(n_parts) and (hp is not None or uses_pass(config, meta.names, meta.n))
        problems = floor_problems(config) if pairs else []
        if problems:
            raise DataError(problems[0][1])
        fast = not pairs and use_fast(h, meta.n) and meta.n > 1
        src = sorted_source(meta, hp, workdir) if hp else None
        done = hp.state.pass_state if hp else None
        with open(os.path.join(workdir, SOURCE), "w") as fh:
            fh.write(source(config, done.n if done else meta.n, meta.names, pairs, fast,
                            done.params if done else None)
                     + ("; vectors: hpm's sorted copy" if hp else "; vectors: its own collect"))
        store = open_store(meta, src)
        captions = gather_recaptions(read, n_parts, store, p.recaptions, workdir) if (
            cross(config) and p.recaptions) else None
        indexes = _build_indexes(config, _features(config, store, captions, None),
                                 workdir) if fast else {}
        return PositivesState(meta, pairs, fast, src, captions, indexes)

    @classmethod
    def finalize(cls, config: Any, ctx: Any) -> dict:
        """How many positives max_positives cut, in the stage's info and the run summary."""
        found = kept = rows_cut = 0
        for part in range(len(ctx.counts)):
            t = ctx.read(PositivesStage.name, part, [M.POSITIVE_IDS.name, M.POSITIVE_COUNT.name])
            n = np.asarray(t.column(M.POSITIVE_COUNT.name).fill_null(0).to_numpy(), np.int64)
            k = np.asarray([len(x or []) for x in t.column(M.POSITIVE_IDS.name).to_pylist()],
                           np.int64)
            found, kept, rows_cut = found + int(n.sum()), kept + int(k.sum()), \
                rows_cut + int((n > k).sum())
        info: dict = {"positives_found": found, "positives_kept": kept,
                      "positives_cut": found - kept, "rows_cut": rows_cut,
                      "max_positives": config.positives.max_positives, "cross_modal": cross(config)}
        path = os.path.join(ctx.workdir, SOURCE)
        if os.path.exists(path):
            with open(path) as fh:
                info["candidates"] = fh.read()
        if found > kept:
            info["skipped"] = [f"positives: positives.max_positives = "
                               f"{config.positives.max_positives} cut {found - kept} of {found} "
                               f"positives, on {rows_cut} rows (positive_count has each row's "
                               "total); raise it to keep them"]
        return info

    def setup(self) -> None:
        config, state = self.config, self.state
        self.device = hpm.resolve_device(config.hpm.device)
        self.rule = rule(config)
        self.store = open_store(state.store, state.sorted)
        self.search = None
        if state.pass_pairs:           # the pass's candidates: exact dots, no index
            f = _features(config, self.store, state.captions, None)
            self.search = fff.Candidates(f, device=self.device)
        elif not state.fast:           # the base on the device once (on the CPU: the memmaps)
            self.features = _features(config, self.store, state.captions, self.device)
        else:
            f = _features(config, self.store, state.captions, None)
            indexes = {k: hpm.load_index(path, nprobe, self.device)
                       for k, (path, nprobe) in state.indexes.items()}
            self.search = fff.FastPositives(indexes, f, device=self.device)

    def find(self, gidx: np.ndarray, batch: pa.Table) -> fff.Positives:
        p, h = self.config.positives, self.config.hpm
        if self.state.pass_pairs:
            return self.search.score(gidx, self.candidates(batch), self.rule, p.max_positives)
        if self.search is not None:
            return self.search.query(gidx, self.rule, p.max_positives, p.k_prime)
        return fff.search(self.features, self.rule, p.max_positives, gidx, h.engine.block_size,
                          h.engine.query_block, self.device)

    def candidates(self, batch: pa.Table) -> np.ndarray:
        """[rows, C] the rows' hpm pair lists as this stage's rows (-1: padding, or a row not kept
        any more, e.g. a noise pair)."""
        col = batch.column(M.PAIR_IDS.name).combine_chunks()
        sizes = col.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        g = self.store.lookup(col.flatten())
        out = np.full((len(sizes), max(int(sizes.max(initial=0)), 1)), -1, np.int64)
        row = np.repeat(np.arange(len(sizes)), sizes)
        out[row, np.arange(len(row)) - np.repeat(np.cumsum(sizes) - sizes, sizes)] = g
        return out

    def __call__(self, batch: pa.Table) -> pa.Table:
        gidx = self.store.locate(batch.column(F.PART.name).to_numpy(),
                                 batch.column(F.ROW.name).to_numpy())
        present = gidx >= 0
        r = self.find(gidx[present], batch.filter(pa.array(present)))
        ok = r.idx >= 0
        rel = np.array(fff.CODES, dtype=object)[np.where(ok, r.code, 0)]
        return pa.table({
            F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
            M.POSITIVE_IDS.name: spread(self.store.id_lists(r.idx), present),
            M.POSITIVE_CAPTIONS.name: spread(masked_lists(r.caption, ok, pa.int8()), present),
            M.POSITIVE_RELATIONS.name: spread(masked_lists(rel, ok, pa.string()), present),
            M.POSITIVE_SCORES.name: spread(masked_lists(r.score, ok, pa.float32()), present),
            M.POSITIVE_COUNT.name: spread(pa.array(r.count, pa.int32()), present),
            F.REASONS.name: reasons_array([[] for _ in range(batch.num_rows)]),
            F.REASON_DETAIL.name: pa.array([None] * batch.num_rows, pa.string()),
        }, schema=self.output)
