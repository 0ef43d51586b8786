"""The hpm stage's neighbour pass on disk: the layout its global step builds once, and what each
worker loads to mine the rows of its parts.

Files in ``<workdir>/pass/``: the layout (``means``, ``radius``, ``order``, ``bounds``,
``positions``: persist.save_layout) and the vectors sorted by cluster (``img.f32``, ``txt.f32``
and, with cross-modal embeddings, ``ximg.f32``, ``xtxt.f32``; with hpm.engine.precision bf16 also
their bf16 copies ``img.bf16``, ...; with int8 their int8 copies ``img.int8``, ... and each
cluster's scale and bounds ``img.int8.npy``, ...: persist.save_vectors), all memory-mapped by
every worker;
when the pass is partial, also each one-space layout and its sorted vectors in
``space_<name>/`` (spaces.py).
The store's own vector files are deleted once these are written (store.drop_vectors).
Nothing of the pass's output is stored here: each part's rows are
mined where the part is computed, and their hard pairs, support, certificate and candidate
pairs go straight into the part's committed table (schemas/mining.py), which is what the
positives stage and the run summary read.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from vlcurate.schemas import embed as E
from vlcurate.foundation.params import DataError

from . import calibrate, engine, hpm
from .engine import layout, persist, precision, spaces
from .engine.core import NAMES, PassParams, Vectors
from .engine.screen import low_rows
from .store import Store

RAN = "ran.json"          # the pass's precision and probe, for the run summary
GUARD_SAMPLE = 512      # rows whose support the global step checks before any part is mined


def small_data_error(k: int, n: int, max_support: int, sampled: int = 0) -> str:
    """The message when no kept row (or none of ``sampled`` rows) can have k
    supporting pairs."""
    who = (f"the best-supported row has {max_support}" if not sampled else
           f"the best-supported of {sampled} rows sampled has {max_support}")
    return (f"hpm.k = {k} cannot be supported by the {n} rows kept for mining: "
            f"{'every' if not sampled else 'nearly every'} row would be flagged as a noise pair "
            f"({who} pairs scoring > 0). Set hpm.k to at most {max_support} (and > 0), or mine "
            f"more rows.")


# hpm.engine.clusters / probe null: clusters of ~256 rows, 60 of them probed, in both precisions.
# Routing by <q, mu_c> + routing.ROUTE_SPREAD spread_c finds at probe 60 (18.9k rows
# scored per target) what probe 80 found by <q, mu_c> (23.6k rows); bf16 at 1M, 2 one-thread
# workers: 274 us per target and recall@10/50/100 0.994 / 0.995 / 0.995. Clusters of ~128 rows
# at probe 64 score 11.7k rows at the same recall but are no faster per target (483 against
# 501 us on 1 thread, interleaved: routing against twice the means and smaller GEMMs) and
# their layout takes 142 s instead of ~95.
# Finer clusters score fewer rows for the same recall (1M synthetic, 300 exact targets:
# ~256 rows / probe 80 score 23.6k rows per target at recall@10/50/100 0.991 / 0.995 / 0.995,
# ~512 / 60 score 35.0k at 0.995 / 0.995 / 0.996, ~1,024 / 30 35.3k at 0.984 / 0.989 / 0.991),
# and with chunks spanning parts (32,768 rows) and small units run stacked, their units are
# not bound by per-call costs. Interleaved rounds of 16,384 targets (this machine's rounds
# differ by up to 1.6x): fp32 0.48-0.60 ms per target against 0.56-0.87 for the earlier code
# at its fp32 default ~512 / 60; bf16 0.48-0.58 against 0.70-0.85 at the former bf16 default
# ~2,048 / 40 (82k rows scored).
AUTO = (256, 60)


def resolve_precision(precision_name: str, device: str) -> str:
    """hpm.engine.precision ``auto``: int8 where ``device`` has int8 GEMMs in hardware and the int8
    package is here, else fp32 (the same pairs either way: the screens are proven); any other
    value as it is, when available (else a ConfigError: engine/precision.py)."""
    return precision.resolve(precision_name, device).name


def pass_params(config: Any, n: int, device: Optional[str] = None) -> PassParams:
    """The run's config (``hpm`` and its ``engine``; ``positives.candidates``: the candidate
    pairs' floors) -> pass parameters; method exact (or auto up to engine.exact_max_n rows) probes
    every cluster: the pass is then exhaustive, i.e. exact HPM. hpm.engine.precision auto is
    resolved for ``device`` (None: hpm.device's)."""
    cfg, cand = config.hpm, config.positives.candidates
    e = cfg.engine
    exact = cfg.method == "exact" or (cfg.method == "auto" and n <= e.exact_max_n)
    rows, probe = AUTO
    c = PassParams(cfg.k, cfg.tau_image, cfg.tau_text, n_clusters=e.clusters,
                          cluster_rows=rows).clusters(n)
    return PassParams(
        k=cfg.k, tau_i=cfg.tau_image, tau_t=cfg.tau_text, dup=cfg.dup_threshold,
        floor_i=cand.image, floor_t=cand.text, floor_x=cand.cross,
        n_clusters=c, probe=c if exact else (e.probe or probe), seed=e.seed,
        query_block=e.query_block, block_size=e.block_size, max_pairs=cand.max_pairs,
        precision=resolve_precision(e.precision, device or hpm.resolve_device(cfg.device)),
        space_probe=0 if exact else e.pair_probe, cluster_rows=rows,
        exact_noise=e.noise_count == "exact")


@dataclass(frozen=True)
class PassState:
    """What the global step hands every worker: where the layout and sorted vectors are."""
    dir: str
    n: int
    params: PassParams


def pass_dir(workdir: str) -> str:
    """Where the pass's layout and sorted vectors are, in hpm's workdir."""
    return os.path.join(workdir, "pass")


def prepare_pass(store: Store, p: PassParams, workdir: str, device: str,
                 recall: Optional[float] = None,
                 siblings: Optional[np.ndarray] = None) -> PassState:
    """Lay the kept rows out once (k-means, sort by cluster), write the sorted vectors, with
    ``recall`` calibrate the probe (calibrate.py), and stop with small_data_error when no row
    of a seeded sample (every row, up to GUARD_SAMPLE) has k supporters (its agreeing
    ``siblings`` counted: engine/siblings.py)."""
    v = store.vec
    img, txt = v[E.IMAGE_EMB_NAME], v[E.TEXT_EMB_NAME]
    lay = layout.build_layout(img, txt, p, device)
    out = pass_dir(workdir)
    persist.save_layout(out, lay)
    persist.save_vectors(out, lay, {"img": img, "txt": txt,
                                   "ximg": v.get(E.CROSS_IMAGE_EMB_NAME),
                                   "xtxt": v.get(E.CROSS_TEXT_EMB_NAME)}, p.precision)
    if recall is not None and p.probe < lay.n_clusters:
        probe = calibrate.probe_for(lay, persist.load_vectors(out, store.n), p, recall, device)
        p = dataclasses.replace(p, probe=probe)
    with open(os.path.join(out, RAN), "w") as f:     # the run summary's (pass_info)
        json.dump({"precision": p.precision, "probe": p.probe}, f)
    if p.space_probe and p.probe < lay.n_clusters:     # partial: one-space layouts too
        spaces.build(out, persist.load_vectors(out, store.n), p, device)
    state = PassState(out, store.n, p)
    miner = Miner(state, device)
    rows = np.arange(store.n) if store.n <= GUARD_SAMPLE else np.sort(
        np.random.default_rng(p.seed).choice(store.n, GUARD_SAMPLE, replace=False))
    r = miner.mine(rows)
    support = r.support + (0 if siblings is None else siblings[rows])
    if not (support >= p.k).any():
        raise DataError(small_data_error(p.k, store.n, int(support.max()),
                                          0 if len(rows) == store.n else len(rows)))
    return state


class Miner:
    """A worker's view of the pass: the layout and sorted vectors memory-mapped once; ``mine``
    any global rows (results in their order)."""

    def __init__(self, state: PassState, device: str) -> None:
        self.lay, self.pos = persist.load_layout(state.dir)
        self.vec = resident(persist.load_vectors(state.dir, state.n), device)
        self.params, self.device = state.params, device
        self.spaces = spaces.load(state.dir, state.n)

    def mine(self, gidx: np.ndarray) -> engine.PassResult:
        return engine.mine(self.lay, self.vec, self.pos[np.asarray(gidx, np.int64)],
                           self.params, self.device, self.spaces)


GPU_SHARE = 0.25       # the sorted vectors move to a GPU once when they fit in this share of it


def resident(vec: Vectors, device: str) -> Vectors:
    """On a GPU, the sorted vectors once on the device when they fit in GPU_SHARE of its memory
    (every unit then reads them there); else, and on the CPU, the memory-mapped files, a unit's
    slices copied as it needs them. The same code reads either."""
    arrays = [getattr(vec, x) for x in NAMES]
    low = vec.low or {}
    size = sum(a.nbytes for a in [*arrays, *low.values()] if a is not None)
    if not device.startswith("cuda"):
        return vec
    import torch
    if size > GPU_SHARE * torch.cuda.get_device_properties(torch.device(device)).total_memory:
        return vec
    return Vectors(*(None if a is None else hpm.as_tensor(a, device) for a in arrays),
                          low={x: a.to(device) if hasattr(a, "block") else
                               low_rows(a, slice(0, len(a)), device)
                               for x, a in low.items()} or None)


def ran_in(workdir: str) -> dict:
    """The precision and probe the pass in hpm's ``workdir`` ran with ({}: no pass there)."""
    path = os.path.join(pass_dir(workdir), RAN)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def pass_info(config: Any, certified: np.ndarray, cut: np.ndarray, ran: Optional[dict] = None
              ) -> dict:
    """The run summary's figures from the committed parts (``certified``: every mined row's
    flag, ``cut``: the pass's rows' hpm_pairs_cut): clusters and probe (the pass), the
    precision it ran in (``ran``: ``ran_in``'s), the certified fraction, and the pairs
    positives.candidates.max_pairs cut (a note when any)."""
    info: dict = {"certified": float(certified.mean()) if len(certified) else 1.0}
    if config.hpm.method == "fast" or not len(certified):
        return info
    p = pass_params(config, len(certified), "cpu")
    ran = ran or {}
    info.update(clusters=p.clusters(len(certified)),
                probe=min(ran.get("probe", p.probe), p.clusters(len(certified))),
                precision=ran.get("precision", p.precision),
                pair_probe=p.space_probe, pairs_cut=int(cut.sum()), max_pairs=p.max_pairs)
    if info["pairs_cut"]:
        info["notes"] = [
            f"hpm: {info['pairs_cut']} candidate pairs (S_ii/S_tt/S_it above "
            f"positives.candidates) were cut by positives.candidates.max_pairs = "
            f"{p.max_pairs} per row (each row keeps its highest max(S_ii, S_tt, S_it, X_ii, "
            f"X_tt); hpm_pairs_cut counts them per row); the "
            f"positives stage never sees them: raise positives.candidates.max_pairs to keep them"]
    return info


__all__ = ["Miner", "PassState", "pass_dir", "pass_info", "pass_params", "prepare_pass", "ran_in",
           "resolve_precision",
           "small_data_error"]
