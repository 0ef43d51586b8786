"""The hpm stage's neighbour pass on disk: run it over the collected rows, keep what it found by
global row in the stage's workdir (memory-mapped by every part's actor), read it back.

Files in ``<workdir>/pass/`` (global row g = the store's order: part by part, row by row):
``idx.npy`` [N, k] int64 hard rows (-1 padded, best first), ``score.npy`` [N, k] float32,
``support.npy`` [N] int64, ``certified.npy`` [N] bool, and the candidate pairs in CSR form:
``offsets.npy`` [N + 1] int64, ``pair_j.npy``, ``pair_sii.npy``, ``pair_stt.npy``,
``pair_sit.npy`` (row g's pairs are entries offsets[g]:offsets[g+1], sorted by j; S_it is NaN
without cross-modal vectors). The stage copies each part's share into its committed table
(schemas/mining.py PAIR_*), which is what the positives stage reads.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
from vlcurate.schemas import embed as E

from . import blocks, hpm
from .store import Store

FIELDS = ("idx", "score", "support", "certified", "offsets", "pair_j", "pair_sii", "pair_stt",
          "pair_sit")


def small_data_error(k: int, n: int, max_support: int) -> str:
    """Issue 12: the message when no kept row can have k supporting pairs."""
    return (f"hpm.k = {k} cannot be supported by the {n} rows kept for mining: every row would "
            f"be flagged as a noise pair (the best-supported row has {max_support} pairs "
            f"scoring > 0). Set hpm.k to at most {max_support} (and > 0), or mine more rows.")


def pass_params(cfg: Any, n: int) -> blocks.PassParams:
    """hpm config -> pass parameters; method exact (or auto up to exact_max_n rows) probes
    every cluster: the pass is then exhaustive, i.e. exact HPM."""
    exact = cfg.method == "exact" or (cfg.method == "auto" and n <= cfg.exact_max_n)
    c = blocks.PassParams(cfg.k, cfg.tau_image, cfg.tau_text, n_clusters=cfg.clusters).clusters(n)
    return blocks.PassParams(
        k=cfg.k, tau_i=cfg.tau_image, tau_t=cfg.tau_text, dup=cfg.dup_threshold,
        floor_i=cfg.pair_image, floor_t=cfg.pair_text, floor_x=cfg.pair_cross,
        n_clusters=c, probe=c if exact else cfg.probe, seed=cfg.seed, query_block=cfg.query_block,
        block_size=cfg.block_size, max_pairs=cfg.max_pairs)


def runner(cfg: Any, device: str, vec_dir: str):
    """In the global step's process, or on hpm.pass_actors Ray actors when Ray is running
    (never more actors than the free CPUs can hold: an actor that cannot be placed would
    never take its share of the units)."""
    if cfg.pass_actors <= 0:
        return None
    import ray
    if not ray.is_initialized():
        return None
    free = ray.available_resources().get("CPU", 0.0)
    actors = max(1, min(cfg.pass_actors, int(free // cfg.pass_cpus)))
    return blocks.ray_units(actors, cfg.pass_cpus, 1 if device == "cuda" else 0, device, vec_dir)


def run_pass(store: Store, p: blocks.PassParams, workdir: str, cfg: Any) -> dict:
    device = hpm.resolve_device(cfg.device)
    v = store.vec
    cross = E.CROSS_IMAGE_EMB_NAME in v
    img, txt = v[E.IMAGE_EMB_NAME], v[E.TEXT_EMB_NAME]
    lay = blocks.build_layout(img, txt, p, device)
    vec_dir = os.path.join(workdir, "sorted")
    blocks.save_vectors(vec_dir, lay, {"img": img, "txt": txt,
                                       "ximg": v.get(E.CROSS_IMAGE_EMB_NAME),
                                       "xtxt": v.get(E.CROSS_TEXT_EMB_NAME)})
    vec = blocks.load_vectors(vec_dir, store.n)
    run = runner(cfg, device, vec_dir) or (lambda *a: blocks.run_units(*a, device=device))
    r = blocks.gather(lay, p.k, (p.tau_i, p.tau_t), run(lay, vec, p, range(lay.n_clusters)),
                      p.max_pairs)
    if not (r.support >= p.k).any():
        raise ValueError(small_data_error(p.k, store.n, int(r.support.max())))
    out = os.path.join(workdir, "pass")
    os.makedirs(out, exist_ok=True)
    for f in FIELDS:
        np.save(os.path.join(out, f"{f}.npy"), getattr(r, f))
    info = {"pairs_cut": r.cut, "max_pairs": cfg.max_pairs, "clusters": lay.n_clusters,
            "probe": min(p.probe, lay.n_clusters), "certified": float(r.certified.mean())}
    with open(os.path.join(out, INFO), "w") as fh:
        json.dump(info, fh)
    return {"dir": out, "cross": cross, **info}


INFO = "info.json"


def pass_info(workdir: str) -> dict:
    """What the pass reported (``run_pass``) for the run summary: the pairs hpm.max_pairs cut
    (a note when any), clusters, probe, the certified fraction; {} when no pass ran."""
    path = os.path.join(workdir, "pass", INFO)
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        info = json.load(fh)
    if info["pairs_cut"]:
        info["notes"] = [
            f"hpm: {info['pairs_cut']} candidate pairs (S_ii/S_tt/S_it above hpm.pair_*) were cut "
            f"by hpm.max_pairs = {info['max_pairs']} per row (each row keeps its highest "
            f"max(S_ii, S_tt, S_it)); the positives stage never sees them: raise hpm.max_pairs "
            f"to keep them"]
    return info


@dataclass
class Stored(blocks.Found):
    """The pass's results as the stage stored them, memory-mapped."""
    cross: bool

    def rows_pairs(self, gidx: np.ndarray) -> dict:
        """The candidate pairs of rows ``gidx``, as list offsets over those rows."""
        a, b = self.offsets[gidx], self.offsets[gidx + 1]
        take = np.concatenate([np.arange(x, y) for x, y in zip(a, b)]) if len(gidx) else \
            np.zeros(0, np.int64)
        take = take.astype(np.int64)
        offsets = np.concatenate([[0], np.cumsum(b - a)])
        return {"offsets": offsets, "j": self.pair_j[take], "sii": self.pair_sii[take],
                "stt": self.pair_stt[take], "sit": self.pair_sit[take], "cross": self.cross}


def load_result(state: dict) -> Stored:
    arrays = {f: np.load(os.path.join(state["dir"], f"{f}.npy"), mmap_mode="r") for f in FIELDS}
    return Stored(**arrays, cross=state["cross"])
