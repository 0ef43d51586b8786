"""The mining engine: one neighbour pass in dense blocks (HELIP hard pairs: Alg. 1's score and
thresholds; noise support; near-duplicates; FFF Eq. 1 candidate pairs with their exact
similarities), behind one entry point, ``mine``.

Modules, by responsibility:

* ``layout``: spherical k-means of the joint vectors, rows sorted by cluster (``Layout``);
* ``routing``: each query's ``probe`` clusters and the certificate's bound;
* ``units``, ``topk``, ``pairs``, ``screen``: the per-cluster work (a unit's blocks screened
  in the pass's precision, the top-k, the support, the capped candidate pairs);
* ``passes``: mining rows (units grouped and merged, ``complete``: the noise count made exact);
* ``spaces``: the one-space layouts' search, for the pairs near in one space only;
* ``siblings``: the other captions of a row's image as support in the noise rule;
* ``persist``: the layout and sorted vectors on disk, as the stage's actors read them;
* ``precision``: fp32, bf16 (and int8, from the ``stages/mining/int8`` package) as objects.

A worker mines rows with the layout and sorted vectors the global step wrote (pass_io.Miner:
``persist.load_layout``, ``persist.load_vectors``, ``spaces.load``), the tests and the
benchmark with the same laid out in memory (``prepare``)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from . import siblings
from . import spaces as _spaces
from .core import NAMES, PAIR_FIELDS, SIMS, PassParams, Vectors
from .layout import Layout, build_layout
from .passes import PassResult, mine_routed
from .persist import load_layout, load_vectors, save_layout, save_vectors, sorted_vectors


def mine(lay: Layout, vec: Vectors, pos: np.ndarray, p: PassParams, device: str = "cpu",
         spaces: Sequence = (), routed: Optional[tuple] = None) -> PassResult:
    """Mine the rows at sorted positions ``pos`` (``lay.positions()[global rows]``; results in
    that order): route each to its ``p.probe`` clusters (or take ``routed``: routing.route's
    answer), run the units (small ones stacked) in ``p.precision`` and merge; with
    p.exact_noise, complete the support of rows found short; then, with one-space layouts
    (``spaces``: spaces.layouts or spaces.load), add the pairs near in one space only.

    ``lay``, ``vec``: the layout and the vectors sorted by it (``prepare``, or
    persist.load_layout and persist.load_vectors). A row's result depends only on the layout
    and its own routing, never on the other rows mined with it; memory is bounded by len(pos),
    not N. This is the one path: the hpm stage's actors (pass_io.Miner), the global step's
    calibration, the tests and the benchmark all mine through it."""
    r, routes = mine_routed(lay, vec, np.asarray(pos, np.int64), p, device, routed)
    if spaces:
        return _spaces.add_pairs(r, list(spaces), lay, vec, np.asarray(pos, np.int64), routes,
                                 p, device)
    return r


def prepare(img, txt, p: PassParams, ximg=None, xtxt=None, device: str = "cpu") -> tuple:
    """In memory, what the global step writes: (layout, sorted vectors with the precision's
    low copies, one-space layouts when the pass is partial and p.space_probe > 0)."""
    lay = build_layout(img, txt, p, device)
    vec = sorted_vectors(lay, img, txt, ximg, xtxt, p.precision)
    partial = p.space_probe and p.probe < lay.n_clusters
    return lay, vec, _spaces.layouts(vec, p, device) if partial else []


def neighbour_pass(img, txt, p: PassParams, ximg=None, xtxt=None, device: str = "cpu",
                   max_pairs: Optional[int] = None, rows: int = 4096
                   ) -> tuple[Layout, PassResult]:
    """The whole pass in memory (tests, the benchmark): ``prepare``, then every row mined by
    ``mine``, ``rows`` at a time, by global row."""
    p = p if max_pairs is None else dataclasses.replace(p, max_pairs=max_pairs)
    lay, vec, sp = prepare(img, txt, p, ximg, xtxt, device)
    pos = lay.positions()
    return lay, PassResult.concat([mine(lay, vec, pos[a:a + rows], p, device, sp)
                                   for a in range(0, max(len(pos), 1), rows)])


__all__ = ["Layout", "siblings", "NAMES", "PAIR_FIELDS", "PassParams", "PassResult", "SIMS", "Vectors",
           "build_layout", "load_layout", "load_vectors", "mine", "neighbour_pass", "prepare",
           "save_layout", "save_vectors", "sorted_vectors"]
