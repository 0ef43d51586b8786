"""Routing: each query goes to the ``probe`` clusters ranked best for its vector (its own
cluster first), scored by its precision (precision.Precision.route_top), and the
certificate's bound m_out over the clusters it does not search."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from .core import Vectors, _take
from .kernels import ROUTE_SPREAD, _bias, _first, spread  # noqa: F401  (routing.spread, ...)
from .layout import Layout, joint_t
from .precision import get

if TYPE_CHECKING:
    from .units import Queries


SLACK = 1e-5          # fp32 rounding of <q, mu> + r: the certificate's bound is raised by this


def route_step(lay: Layout) -> int:
    """Queries routed at a time: ~4M scores held, whatever the number of clusters."""
    return max(256, (1 << 22) // max(lay.n_clusters, 1))


def route(lay: Layout, vec: "Vectors", pos: np.ndarray, probe: int, device: str = "cpu",
          precision: str = "fp32", qc: Optional["Queries"] = None
          ) -> tuple[np.ndarray, np.ndarray]:
    """For the queries at sorted positions ``pos``: their ``probe`` best non-empty clusters by
    ``mean_scores`` (their own among them; equal scores by the lower cluster; ascending), and
    m_out = max over the other non-empty clusters of <q, mu_c> + r_c (+ SLACK, and the screen's
    margin with a low ``precision``; -inf when none), the certificate's bound. Routed
    route_step queries at a time (a row's routing is its own). ``qc``: Queries holding every
    row of ``pos``, whose compact copy is read instead of N rows."""
    step = route_step(lay)
    parts = [_route(lay, vec, pos[a:a + step], probe, device, precision, qc)
             for a in range(0, max(len(pos), 1), step)]
    return np.concatenate([t for t, _ in parts]), np.concatenate([m for _, m in parts])


def _route(lay: Layout, vec: "Vectors", pos: np.ndarray, probe: int, device: str,
           precision: str, qc: Optional["Queries"] = None) -> tuple[np.ndarray, np.ndarray]:
    probe = min(probe, lay.n_clusters)
    x = joint_t(*(qc.full_rows(pos, x) if qc else _take(getattr(vec, x), pos, device)
                  for x in ("img", "txt")))
    own = lay.cluster_of(pos)
    reach = lay.cached("reach", device, "fp32", lambda: lay.radius - ROUTE_SPREAD * spread(lay))
    # its own cluster first (+inf); the others' best <q, mu_c> + r_c: the certificate's bound
    (top, m_out), err = get(precision).route_top(lay, x, probe, own, reach)
    m_out = np.where(np.isfinite(m_out), m_out + (SLACK + err), -np.inf).astype(np.float32)
    return top, m_out


def mean_scores(lay: Layout, x: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """[n, C] fp32 routing scores <x_i, mu_c> + ROUTE_SPREAD spread_c of query vectors x
    against every cluster's member mean (joint vectors, or one space's: spaces.py), -inf for
    an empty cluster: one GEMM with the spreads (and the empty clusters) as its bias."""
    return routing_scores(lay, x, precision)[0]


def routing_scores(lay: Layout, x: torch.Tensor, precision="fp32") -> tuple:
    """(``mean_scores``, the largest |score - fp32 score| of each row: a float, or per row).
    With a low ``precision`` the GEMM's operands are in its type (precision.Precision's
    routing_scores: bf16 within its margin of fp32, ~3x fp32's rate on 1 thread of a CPU with
    AVX512-BF16; int8 with each row's error bounded). Routing decides only where to search,
    never a score, and ``_route`` widens m_out by the error."""
    return get(precision).routing_scores(lay, x)


