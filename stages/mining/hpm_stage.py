"""Stage ``hpm``: HELIP hard pairs and noise pairs for every row still kept.

Global step (``prepare``, once): the image/text (and cross-modal, when embed wrote them)
embeddings of every kept row go to files in the stage's workdir (store.py, the one collect of
mining: positives reads the sorted copy). Methods exact/blocks/auto: the neighbour pass's layout (k-means of the joint vectors,
rows sorted by cluster: blocks.py, pass_io.py); ``fast``: FastHPM's pool and IVF-PQ index
(legacy). Before any part is mined it stops with an actionable error naming ``hpm.k`` when no
row of a seeded sample (every row, on small data) can have k supporting pairs (every
row would be a noise pair). The state it returns is paths.

Per part (``on_actors``: each actor memory-maps the layout and vectors, or loads the index,
once): the part's rows are mined there, chunk by chunk, so the pass runs on the stage's actor
pool (CPU or GPU, as many actors as the cluster gives it) and commits part by part, and no
process ever holds the whole pass's output. They get their hard ids and scores,
support, noise flag, certificate and (pass only) their candidate pairs with exact similarities
(``hpm_pair_*``), which the positives stage can read.

``finalize`` hands the run summary the pass's figures (``_info.json``), from the committed
parts: the candidate pairs that ``hpm.max_pairs`` cut (a NOTE when any: no silent
cap), clusters, probe, the certified fraction.

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
from typing import Any, Callable, Literal, Optional

import numpy as np
import pyarrow as pa
from vlcurate.schemas import F
from vlcurate.schemas import embed as E
from vlcurate.schemas import mining as M
from vlcurate.schemas import reasons as R
from vlcurate.pipeline.params import DataError, Params, at_least, positive, unit, within
from vlcurate.stages.base import GlobalStage, Resources, reasons_array

from . import blocks, hpm
from .pass_io import Miner, pass_info, pass_params, prepare_pass, ran_in, small_data_error
from vlcurate.stages.arrow import list_array, masked_lists, spread

from .store import Store, collect, drop_vectors

EMBED = "embed"
COLUMNS = (E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME)
CROSS = (E.CROSS_IMAGE_EMB_NAME, E.CROSS_TEXT_EMB_NAME)


def set_threads(n: Optional[int]) -> None:
    """Threads for a global build step (one Ray task that the whole stage waits on)."""
    import faiss
    import torch
    n = n or os.cpu_count() or 1
    torch.set_num_threads(n)
    faiss.omp_set_num_threads(n)


def use_fast(cfg: Any, n: int) -> bool:
    """The positives stage's own search: IVF-PQ above exact_max_n (hpm's method aside)."""
    return cfg.method == "fast" or (cfg.method != "exact" and n > cfg.exact_max_n)


def columns(read: Callable[[int], pa.Table], n_parts: int) -> tuple[str, ...]:
    """The joint embeddings, plus the cross-modal ones when the upstream tables have them."""
    names = read(0).column_names if n_parts else []
    return COLUMNS + (CROSS if all(c in names for c in CROSS) else ())


CHUNK_ROWS = 32768      # hpm.chunk_rows' default: rows per call, across parts


@dataclass(frozen=True)
class HpmParams(Params):
    """HELIP hard-pair mining (stage ``hpm``); ``positives`` reads its method/search settings."""
    k: int = positive(100)        # hard pairs per target (HELIP's released code; Table 9 uses 500)
    tau_image: float = unit(0.5)  # HELIP sec. 4.1: tau = 0.5; similarities <= tau count as 0
    tau_text: float = unit(0.5)
    # a pair with S_I or S_T above it is a duplicate: a positive, never a hard pair; null = off
    dup_threshold: Optional[float] = unit(0.98)
    # drop: flag noise pairs with hpm.noise_pair (export drops them, later stages skip them);
    # mark: only the hpm_is_noise column, no reason
    noise_action: Literal["drop", "mark"] = "drop"
    # exact: a row the pass finds with fewer than k supporters is searched again, wider and then
    # everywhere, until its count is exact (HELIP's rule: no good row flagged on a partial
    # count; a true noise row then costs what exact HPM costs for it). probed: decide on the
    # probed clusters' count: much faster where many rows are noise pairs, but a good row near
    # the threshold can be flagged (blocks.complete)
    noise_count: Literal["exact", "probed"] = "exact"
    # blocks: one neighbour pass in dense blocks (each cluster x the rows routed to it, exact GEMM);
    # exact: the same pass probing every cluster; auto: exact up to exact_max_n rows, then
    # blocks; fast: FastHPM (FAISS IVF-PQ, legacy: finds no FFF candidate pairs)
    method: Literal["auto", "exact", "blocks", "fast"] = "auto"
    exact_max_n: int = positive(50_000)
    # blocks: k-means clusters; null = about n / 256 (pass_io.AUTO: finer clusters score fewer
    # rows per target for the same recall)
    clusters: Optional[int] = positive(None)
    # blocks: clusters searched per row (best by routing); null = calibrated in the global step:
    # the smallest probe whose recall@k (and @10, @50, @100 up to k) on a seeded sample's exact
    # neighbours reaches hpm.recall (stages/mining/calibrate.py; the run summary says which)
    probe: Optional[int] = positive(None)
    recall: float = within(0.995, 0, 1)    # the calibrated probe's target (hpm.probe null)
    # candidate pairs kept for the positives stage, which reads them instead of searching (its
    # thresholds must not be below these: the preflight checks); X_*: on the cross-modal model
    pair_image: float = within(0.9, -1, 1)    # S_ii or X_ii > pair_image
    pair_text: float = within(0.9, -1, 1)     # S_tt or X_tt > pair_text
    pair_cross: float = within(0.24, -1, 1)   # S_it > pair_cross (cross-modal embeddings only)
    max_pairs: int = positive(256)      # per row, highest max(S_ii, S_tt, S_it, X_ii, X_tt) first
    # a partial pass (blocks above exact_max_n) also lays out each space the positives rule
    # judges on its own (clusters of ~512 rows) and searches this many of its clusters per row
    # for pairs above the floors (stages/mining/spaces.py: pairs near in one space only); 0:
    # none, and positives then runs its own search above exact_max_n
    pair_probe: int = at_least(8, 0)
    # the pass's GEMMs: fp32, or bf16 screening the pairs with a proven margin, then an fp32
    # re-score of those that pass (stages/mining/screen.py): the same pairs, similarities equal
    # to fp32's up to their last bits. bf16 also runs the GEMMs that only decide where to
    # search in bf16 (the layout's k-means and assignment, each row's routing; the
    # certificate's bound is widened by the screen's margin), so the clusters and routes
    # differ a little from fp32's; the one-space searches screen in bf16 too, each hit
    # accepted on its fp32 dot product (spaces.py). For GPU tensor cores and CPUs with AMX
    # or AVX512-BF16 (see deploy/SIZING.md); a CPU without native bf16 GEMMs emulates them,
    # slower than fp32. int8 screens the joint blocks by int8 GEMMs instead, with a bound
    # proven per row (stages/mining/q8.py): ~1.6-2x bf16's rate with AVX512-VNNI, AMX or GPU
    # tensor cores, the same pairs; its layout, routing (each row's bound widens the
    # certificate) and one-space searches in int8 too
    # auto: int8 where the device has int8 GEMMs in hardware (a GPU with int8 tensor cores, a
    # CPU with AVX512-VNNI or AMX: pass_io.int8_native), else fp32; the same pairs either way,
    # the run summary's hpm.precision says which ran
    precision: Literal["auto", "fp32", "bf16", "int8"] = "auto"
    # rows mined per call (null: CHUNK_ROWS): chunks of this many consecutive input rows,
    # across parts (the stage spans_parts; a call mines the chunk's kept rows). A chunk's rows
    # are routed together, so its units (a cluster x the rows routed to it) hold ~kept rows x
    # probe / clusters queries; per target at 1M rows (fp32 defaults, 2 threads): 2.2 ms for
    # ~400 kept rows (a 1,024-row chunk of one part), 1.05
    # ms for 1,024, 0.70 ms for 8,192 to 12,800, 0.63 ms for 32,768. On an H100: 65,536 with
    # query_block 8192 and block_size 16384. Memory per actor grows with it (+0.42 GB peak for
    # 32,768 kept rows at 1M; pairs add up to ~0.3 GB). A numerics key (in the fingerprint): a
    # row's similarities may differ in their last bits with it.
    chunk_rows: Optional[int] = positive(None)
    pool_size: Optional[int] = positive(None)   # FastHPM candidate pool C (uniform, seeded); null = all
    nlist: Optional[int] = positive(None)       # IVF lists; null = auto (power of 2 near sqrt(C))
    pq_m: Optional[int] = positive(None)        # PQ sub-quantizers of the joint vector; null = dim / 2
    pq_nbits: int = within(4, 1, 16)    # 4: FAISS fast-scan codes (CPU); 8: plain IVF-PQ (GPU)
    nprobe: Optional[int] = positive(None)      # null = auto (max(64, nlist / 16))
    k_prime: Optional[int] = positive(None)     # candidates re-scored per target; null = 4 k
    # search uncertified targets again with k' x 4 up to k_prime_max (null = 4 k'): `noise`
    # only those about to be flagged as noise pairs, `all` every uncertified one, `off` none
    widen: Literal["noise", "all", "off"] = "noise"
    k_prime_max: Optional[int] = positive(None)
    train_size: Optional[int] = positive(None)  # IVF-PQ training sample; null = auto
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"    # torch matmuls and the FAISS index
    block_size: int = positive(8192)    # exact and the pass: member rows per score block
    query_block: int = positive(1024)   # exact and the pass: targets per score block
    # threads of the global step (k-means layout, FastHPM's index build); null = all. Mining
    # itself runs per part on the stage's actors (hpm.resources), with run.intra_op_threads
    build_threads: Optional[int] = positive(None)
    resources: Resources = Resources()


class HpmStage(GlobalStage):
    name = "hpm"
    version = "15"       # hard pairs, exact support (short rows searched again), noise flag,
                         # certificate and candidate pairs of the pass; history: CHANGELOG.md
    Params = HpmParams
    speed_only = ("build_threads",)   # threads of the global step
    inputs = {EMBED: ()}              # embedding fields depend on the models: see input_columns
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
        return config.hpm.chunk_rows or CHUNK_ROWS

    @classmethod
    def input_columns(cls, upstream: str, schema: Optional[pa.Schema], config: Any) -> list[str]:
        if upstream != EMBED:
            return []
        cross = [c for c in CROSS if schema is not None and c in schema.names]
        return list(COLUMNS) + (cross if len(cross) == len(CROSS) else [])

    @classmethod
    def prepare(cls, config: Any, read: Callable[[int], pa.Table], n_parts: int, workdir: str) -> dict:
        """Collect the kept rows' vectors once; then the neighbour pass's layout (method
        exact/blocks: the rows are mined in chunks across parts, on the actors) or FastHPM's index."""
        cfg = config.hpm
        set_threads(cfg.build_threads)
        meta = collect(read, n_parts, workdir, columns(read, n_parts))
        if 0 < meta.n <= cfg.k:                      # no row can have k supporters
            raise DataError(small_data_error(cfg.k, meta.n, meta.n - 1))
        state: dict = {"store": meta, "fast": cfg.method == "fast" and meta.n > 1}
        if state["fast"]:
            state.update(_build_fast(cfg, meta, workdir))
        elif meta.n:
            device = hpm.resolve_device(cfg.device)
            state["pass"] = prepare_pass(Store(meta), pass_params(cfg, meta.n, device), workdir,
                                         device, None if cfg.probe else cfg.recall)
            state["store"] = drop_vectors(meta)     # the pass's sorted copy is the only one
        return state

    @classmethod
    def finalize(cls, config: Any, ctx: Any) -> dict:
        """The pass's figures for the run summary (``_info.json``), from the committed parts:
        pairs cut by hpm.max_pairs (with a note when any), clusters, probe, certified fraction."""
        cols = (M.CERTIFIED.name, M.PAIRS_CUT.name)
        tables = [ctx.read(cls.name, part, list(cols)) for part in range(len(ctx.counts))]
        cert, cut = ([np.asarray(t.column(c).drop_null().to_numpy(zero_copy_only=False), dtype)
                      for t in tables] for c, dtype in zip(cols, (bool, np.int64)))
        cat = lambda xs, dtype: np.concatenate(xs) if xs else np.zeros(0, dtype)  # noqa: E731
        return pass_info(config.hpm, cat(cert, bool), cat(cut, np.int64), ran_in(ctx.workdir))

    def setup(self) -> None:
        config, state = self.config, self.state
        self.cfg = config.hpm
        self.device = hpm.resolve_device(self.cfg.device)
        self.store = Store(state["store"])
        self.fast = self.miner = None
        if state["fast"]:
            img, txt = self.store.vec[E.IMAGE_EMB_NAME], self.store.vec[E.TEXT_EMB_NAME]
            pool = np.load(state["pool"])
            index = hpm.load_index(state["index"], state["params"].nprobe, self.device)
            sub = (img, txt) if len(pool) == self.store.n else (img[pool], txt[pool])
            self.fast = hpm.FastHPM(index, pool, *sub, self.device)
        elif self.store.n:
            self.miner = Miner(state["pass"], self.device)

    def mine(self, gidx: np.ndarray) -> tuple[hpm.TopK, Optional[blocks.PassResult]]:
        """Hard pairs of global rows ``gidx`` (and, from the pass, their candidate pairs)."""
        c = self.cfg
        if self.fast is not None:
            v = self.store.vec
            return self.fast.query(v[E.IMAGE_EMB_NAME][gidx], v[E.TEXT_EMB_NAME][gidx], gidx,
                                   c.k, c.tau_image, c.tau_text, c.dup_threshold, c.k_prime,
                                   c.k_prime_max, c.widen), None
        r = self.miner.mine(gidx)
        return hpm.TopK(r.idx, r.score, r.support, r.certified), r

    def __call__(self, batch: pa.Table) -> pa.Table:
        gidx = self.store.locate(batch.column(F.PART.name).to_numpy(),
                                 batch.column(F.ROW.name).to_numpy())
        present = gidx >= 0                    # rows without embeddings are not mined: nulls
        r, found = self.mine(gidx[present])
        noise = r.noise
        keep = (r.idx >= 0) & ~noise[:, None]  # Alg. 1: a noise pair's hard set is empty
        flag = np.zeros(len(gidx), bool)
        flag[present] = noise & (self.cfg.noise_action == "drop")
        support = spread(pa.array(r.support, pa.int32()), present)
        return pa.table({
            F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
            M.HARD_IDS.name: spread(self.store.id_lists(np.where(keep, r.idx, -1)), present),
            M.HARD_SCORES.name: spread(masked_lists(r.score, keep, pa.float32()), present),
            M.SUPPORT.name: support,
            M.IS_NOISE.name: spread(pa.array(noise, pa.bool_()), present),
            M.CERTIFIED.name: spread(pa.array(r.certified, pa.bool_()), present),
            **self.pair_columns(found, present),
            F.REASONS.name: reasons_array([[R.HPM_NOISE] if f else [] for f in flag]),
            F.REASON_DETAIL.name: pa.array(
                [f"{s} pairs support it, fewer than k={self.cfg.k}" if f else None
                 for f, s in zip(flag, support.to_pylist())], pa.string()),
        }, schema=self.output)

    def pair_columns(self, found: Optional[blocks.PassResult], present: np.ndarray) -> dict:
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


def _build_fast(cfg: Any, meta, workdir: str) -> dict:
    """FastHPM's pool and IVF-PQ index of its joint vectors (hpm.method: fast)."""
    store = Store(meta)
    img, txt = store.vec[E.IMAGE_EMB_NAME], store.vec[E.TEXT_EMB_NAME]
    pool = hpm.sample_pool(meta.n, cfg.pool_size, cfg.seed)
    params = hpm.auto_params(len(pool), img.shape[1] + txt.shape[1], cfg.nlist, cfg.pq_m,
                             cfg.pq_nbits, cfg.nprobe, cfg.train_size)
    sub = (img, txt) if len(pool) == meta.n else (img[pool], txt[pool])
    index = hpm.build_ivfpq(hpm.JointView(*sub), params, cfg.seed)
    hpm.save_index(index, os.path.join(workdir, "joint.ivfpq"))
    np.save(os.path.join(workdir, "pool.npy"), pool)
    return dict(params=params, index=os.path.join(workdir, "joint.ivfpq"),
                pool=os.path.join(workdir, "pool.npy"))
