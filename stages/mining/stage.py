"""Stage ``hpm``: HELIP hard pairs and noise pairs for every row still kept.

Global step (``prepare``, once): the image/text (and cross-modal, when embed wrote them)
embeddings of every kept row go to files in the stage's workdir (store.py, the one collect of
mining). Methods exact/blocks/auto: the neighbour pass (blocks.py, pass_io.py) mines every row
there, on an actor pool when ``hpm.pass_actors`` > 0 and Ray runs, and keeps its results by
global row in the workdir; ``fast``: FastHPM's pool and IVF-PQ index (legacy). Before any part
is written it stops with an actionable error naming ``hpm.k`` when no kept row can have k
supporting pairs (issue 12: every row would be a noise pair). The state it returns is paths.

Per part (``heavy_init``: each actor maps the results / loads the index once): the part's rows
get their hard ids and scores, support, noise flag, certificate and (pass only) their candidate
pairs with exact similarities (``hpm_pair_*``), which the positives stage can read.

``finalize`` hands the run summary the pass's figures (``_info.json``): the candidate pairs that
``hpm.max_pairs`` cut (a NOTE when any: issue 12, no silent cap), clusters, probe, certified.

Noise pairs: ``noise_action: drop`` sets the reason ``hpm.noise_pair`` (export then drops the row
under the default policy, and later stages skip it, as for any filter); ``mark`` only fills
``hpm_is_noise``, so the row stays in. Either way no row is removed here. A noise pair's hard set
is empty (Alg. 1). Hard sets are mined over every row still kept when hpm runs, in one pass as in
Alg. 1, so they can name rows that are noise pairs themselves or that a later filter drops: the
trainer skips hard ids that are not in its shards.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import numpy as np
import pyarrow as pa
from vlcurate.schemas import F
from vlcurate.schemas import embed as E
from vlcurate.schemas import mining as M
from vlcurate.schemas import reasons as R
from vlcurate.stages.base import Resources, Stage, reasons_array

from . import hpm
from .pass_io import load_result, pass_info, pass_params, run_pass, small_data_error
from .store import Store, collect, lists, with_nulls

EMBED = "embed"
COLUMNS = (E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME)
CROSS = (E.CROSS_IMAGE_EMB_NAME, E.CROSS_TEXT_EMB_NAME)
PREPARE = "_prepare"      # the runner's workdir for prepare (pipeline/runner.py), under the root


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


class HpmStage(Stage):
    name = "hpm"
    version = "2"
    config_sections = ("hpm",)
    inputs = {EMBED: ()}              # embedding fields depend on the models: see input_columns
    output = M.HARD_PAIRS
    resources = Resources(num_cpus=1, batch_size=0)
    heavy_init = True
    wants_position = True

    @classmethod
    def input_columns(cls, upstream: str, schema: Optional[pa.Schema], config: Any) -> list[str]:
        if upstream != EMBED:
            return []
        cross = [c for c in CROSS if schema is not None and c in schema.names]
        return list(COLUMNS) + (cross if len(cross) == len(CROSS) else [])

    @staticmethod
    def prepare(config: Any, read: Callable[[int], pa.Table], n_parts: int, workdir: str) -> dict:
        """Collect the kept rows' vectors once; then the neighbour pass (method exact/blocks:
        every row mined here, results by global row in ``workdir``) or FastHPM's index."""
        cfg = config.hpm
        set_threads(cfg.build_threads)
        meta = collect(read, n_parts, workdir, columns(read, n_parts))
        if 0 < meta.n <= cfg.k:                      # issue 12: no row can have k supporters
            raise ValueError(small_data_error(cfg.k, meta.n, meta.n - 1))
        state: dict = {"store": meta, "fast": cfg.method == "fast" and meta.n > 1}
        if state["fast"]:
            state.update(_build_fast(cfg, meta, workdir))
        elif meta.n:
            state["pass"] = run_pass(Store(meta), pass_params(cfg, meta.n), workdir, cfg)
        return state

    @staticmethod
    def finalize(config: Any, ctx: Any) -> dict:
        """The pass's figures for the run summary (``_info.json``): pairs cut by hpm.max_pairs
        (with a note when any), clusters, probe, certified fraction."""
        return pass_info(os.path.join(str(ctx.root), PREPARE))

    def __init__(self, config: Any, state: Any = None) -> None:
        super().__init__(config, state)
        self.cfg = config.hpm
        self.device = hpm.resolve_device(self.cfg.device)
        self.store = Store(state["store"])
        self.img = self.store.vec[E.IMAGE_EMB_NAME]
        self.txt = self.store.vec[E.TEXT_EMB_NAME]
        self.fast = self.found = None
        if state["fast"]:
            pool = np.load(state["pool"])
            index = hpm.load_index(state["index"], state["params"].nprobe, self.device)
            sub = (self.img, self.txt) if len(pool) == self.store.n else \
                (self.img[pool], self.txt[pool])
            self.fast = hpm.FastHPM(index, pool, *sub, self.device)
        elif self.store.n:
            self.found = load_result(state["pass"])

    def mine(self, gidx: np.ndarray) -> tuple[hpm.TopK, Optional[dict]]:
        c = self.cfg
        if self.fast is not None:
            return self.fast.query(self.img[gidx], self.txt[gidx], gidx, c.k, c.tau_image,
                                   c.tau_text, c.dup_threshold, c.k_prime, c.k_prime_max,
                                   c.widen), None
        f = self.found
        return hpm.TopK(f.idx[gidx], f.score[gidx], f.support[gidx], f.certified[gidx]), \
            f.rows_pairs(gidx)

    def __call__(self, batch: pa.Table) -> pa.Table:
        gidx = self.store.locate(batch.column(F.PART.name).to_numpy(),
                                 batch.column(F.ROW.name).to_numpy())
        present = gidx >= 0                    # rows without embeddings are not mined: nulls
        r, pairs = self.mine(gidx[present])
        noise = r.noise
        keep = (r.idx >= 0) & ~noise[:, None]  # Alg. 1: a noise pair's hard set is empty
        drop = self.cfg.noise_action == "drop"
        flag = np.zeros(len(gidx), bool)
        flag[present] = noise & drop
        k = self.cfg.k
        support = with_nulls(pa.array(r.support, pa.int32()), present).to_pylist()
        return pa.table({
            F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
            M.HARD_IDS.name: with_nulls(self.store.id_lists(np.where(keep, r.idx, -1)), present),
            M.HARD_SCORES.name: with_nulls(lists(r.score, keep, pa.float32()), present),
            M.SUPPORT.name: with_nulls(pa.array(r.support, pa.int32()), present),
            M.IS_NOISE.name: with_nulls(pa.array(noise, pa.bool_()), present),
            M.CERTIFIED.name: with_nulls(pa.array(r.certified, pa.bool_()), present),
            **self.pair_columns(pairs, present),
            F.REASONS.name: reasons_array([[R.HPM_NOISE] if f else [] for f in flag]),
            F.REASON_DETAIL.name: pa.array(
                [f"{s} pairs support it, fewer than k={k}" if f else None
                 for f, s in zip(flag, support)], pa.string()),
        }, schema=self.output)

    def pair_columns(self, pairs: Optional[dict], present: np.ndarray) -> dict:
        n = len(present)
        if pairs is None:                       # FastHPM: no candidate pairs
            return {f.name: pa.nulls(n, f.type) for f in (M.PAIR_IDS, M.PAIR_SII, M.PAIR_STT,
                                                          M.PAIR_SIT)}
        off = pa.array(pairs["offsets"].astype(np.int32))
        col = {M.PAIR_IDS.name: pa.ListArray.from_arrays(off, self.store.ids.take(
            pa.array(pairs["j"])))}
        for f, key in ((M.PAIR_SII, "sii"), (M.PAIR_STT, "stt"), (M.PAIR_SIT, "sit")):
            col[f.name] = pa.ListArray.from_arrays(off, pa.array(pairs[key], pa.float32()))
        if not pairs["cross"]:
            col[M.PAIR_SIT.name] = pa.nulls(int(present.sum()), M.PAIR_SIT.type)
        return {c: with_nulls(a, present) for c, a in col.items()}


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
