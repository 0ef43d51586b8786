"""hpm.engine.probe null: the pass's probe follows a target recall (hpm.engine.recall), calibrated once in the
global step on a sample's exact neighbours, instead of a fixed number of clusters per row.

A seeded sample of rows is mined exhaustively (every cluster: their exact top-k) and routed as
the pass routes them (``routing.routing_scores`` in the pass's precision, a row's own cluster
first, equal scores by the lower cluster: top_columns' order); each exact pair needs the probe
that reaches its cluster's rank. The probe is the smallest that finds ``recall`` of the sample's
pairs (score > 0) at every k' of KS up to hpm.k and at k: data whose pairs lie in few clusters
gets a small probe, spread-out data a larger one. It is an estimate on the sample (the test set
is bench_mining.py's exact targets), not a proof; the noise decisions do not depend on it
(passes.complete). Its cost: the sample's exhaustive pass, ~SAMPLE / N of exact HPM's work."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from . import engine
from .engine import routing
from .engine.core import PassParams, Vectors, _take
from .engine.layout import Layout, joint_t

SAMPLE = 512          # rows whose exact neighbours calibrate the probe
KS = (10, 50, 100)    # prefixes whose recall must reach the target too (up to hpm.k)


def probe_for(lay: Layout, vec: Vectors, p: PassParams, recall: float,
              device: str = "cpu", sample: int = SAMPLE) -> int:
    """The smallest probe whose recall on the sample's exact top-k (and top-k' prefixes) is at
    least ``recall``; p.probe when the sample has no pair."""
    n, c = len(lay.order), lay.n_clusters
    pos = np.sort(np.random.default_rng(p.seed + 1).choice(n, min(sample, n), replace=False))
    every = dataclasses.replace(p, probe=c, floor_i=2.0, floor_t=2.0, floor_x=2.0,
                                exact_noise=False)
    top = engine.mine(lay, vec, pos, every, device).idx          # global rows, -1 padded
    need = np.full(top.shape, -1, np.int64)
    ok = top >= 0
    rank = ranks(lay, vec, pos, p.precision, device)
    rows = np.nonzero(ok)[0]
    need[ok] = rank[rows, lay.cluster_of(lay.positions()[top[ok]])] + 1
    probes = [_quantile(need[:, :k], recall) for k in sorted({*KS, p.k}) if k <= p.k]
    probes = [x for x in probes if x]
    return min(max(probes), c) if probes else p.probe


def _quantile(need: np.ndarray, recall: float) -> int:
    """The probe that reaches ``recall`` of the pairs (need > 0: a pair's needed probe)."""
    v = np.sort(need[need > 0])
    return int(v[max(math.ceil(recall * len(v)) - 1, 0)]) if len(v) else 0


def ranks(lay: Layout, vec: Vectors, pos: np.ndarray, precision: str,
          device: str) -> np.ndarray:
    """[rows, C] each cluster's place in the routing order of the rows at sorted positions
    ``pos`` (0: their own cluster)."""
    x = joint_t(*(_take(getattr(vec, x), pos, device) for x in ("img", "txt")))
    m = routing._first(routing.routing_scores(lay, x, precision)[0], lay.cluster_of(pos))
    order = torch.sort(m, dim=1, descending=True, stable=True).indices
    out = torch.empty_like(order)
    out.scatter_(1, order, torch.arange(m.shape[1], device=m.device).expand_as(order))
    return out.cpu().numpy()
