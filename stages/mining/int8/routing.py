"""int8's layout and routing GEMMs: k-means assignment (``nearest``: no bound needed, it only
decides where rows sit) and routing scores from int8 sums (``int8_top``: each row's error
bounded, which widens the certificate's m_out as bf16's margin does)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .. import native
from ..engine.kernels import _bias, _first, assignment_step
from ..engine.layout import Layout
from ..hpm import as_tensor
from . import kernels, q8


FUSED_ROWS = 1 << 15    # rows assigned at a time where kernels.int_argmax holds no sums


def nearest(x: torch.Tensor, cent: torch.Tensor) -> torch.Tensor:
    """engine.layout.nearest by int8 GEMMs (hpm.engine.precision int8): the centroids quantized with one scale,
    each row with its own (a row's positive scale changes no argmax), int32 sums. ~2.6x the
    bf16 assignment's speed on this machine (131k rows x 3,906 centroids: 1.45 s against
    3.8), and nearer fp32's choice (99.1% of rows against bf16's 98.4%)."""
    step = FUSED_ROWS if kernels.fused_argmax(x) else assignment_step(cent)
    out = torch.empty(len(x), dtype=torch.long, device=x.device)
    c8 = q8.scaled(cent, cent.abs().max())
    for a in range(0, len(x), step):
        xa = x[a:a + step]
        rows = xa if xa.dtype == torch.int8 else assigned(xa)
        got = kernels.int_argmax(rows, c8)        # AMX: the sums reduced as they are made
        if got is None:
            torch.argmax(q8.int_mm(rows, c8), 1, out=out[a:a + step])
        else:
            out[a:a + step] = got
    return out


def _rows8(x: torch.Tensor) -> torch.Tensor:
    """Rows quantized for an int8 assignment, each with its own scale."""
    return q8.scaled(x, q8.abs_max(x)[:, None])


def assigned(x: torch.Tensor) -> torch.Tensor:
    """The rows k-means assigns, as ``nearest`` reads them: int8 rows quantized once for
    every iteration (the same values each time; a few rows at a time: bounded temporaries)."""
    return torch.cat([_rows8(x[a:a + 4096]) for a in range(0, len(x), 4096)] +
                     [torch.zeros((0, x.shape[1]), dtype=torch.int8, device=x.device)])


def low_means(lay: Layout, device) -> q8.Q8:
    """The member means in int8, one scale for all (q8.shared), made once per device."""
    return lay.kept(("low_means", str(device), "int8"),
                    lambda: q8.shared(as_tensor(lay.means, device)))


def _int8_routing(lay: Layout, x: torch.Tensor, q: Optional[q8.Q8] = None) -> tuple:
    """int8 routing's parts: (int32 sums [n, C], each row's fp32 scale, the bias, the error
    bound); the scores are fp32(sums) * scale + bias (``_scores``). q: x's rows already
    quantized (q8.rows(x): each row's own, so any slice of them is the slice's)."""
    q, c = q8.rows(x) if q is None else q, low_means(lay, x.device)
    scale = torch.as_tensor(q.scale * c.scale[0], dtype=torch.float32, device=x.device)
    return (q8.int_mm(q.values, c.values), scale, _bias(lay, x.device),
            q8.bound(q.err, q.norm, c.err[0], c.norm[0], x.shape[1]))


def int8_top(lay: Layout, x: torch.Tensor, probe: int, own: Optional[np.ndarray] = None,
             reach: Optional[torch.Tensor] = None, q: Optional[q8.Q8] = None) -> tuple:
    """(native.top_columns' answer on int8 routing scores, the rows' error bound): each row's
    probe best clusters, own[i] first when given (+inf; None: the one-space layouts'), and
    with reach the best score + reach over the others. The scores are formed and selected row
    by row in C from the GEMM's sums (no [n, C] float copy), else in torch: the same answer.
    q: x's rows already quantized (``_int8_routing``)."""
    sums, scale, bias, err = _int8_routing(lay, x, q)
    got = native.route_columns(sums, scale, bias, own, probe, reach)
    if got is None:
        got = native.top_columns(_first(_scores(sums, scale, bias), own), probe, reach)
    return got, err


def _scores(sums: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    # exact while |sums| < 127^2 d < 2^24 (d <= 1040); beyond, within the bound's d 2^-23
    return sums.float().mul_(scale[:, None]).add_(bias)
