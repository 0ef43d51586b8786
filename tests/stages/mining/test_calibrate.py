"""hpm.engine.probe null: the probe calibrated on a sample's exact neighbours (calibrate.py),
checked against brute-force HPM in float64 on that sample."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from vlcurate.stages.mining import engine as E
from vlcurate.stages.mining.engine import core, layout, persist
from vlcurate.stages.mining import calibrate

from .shapes import uneven

TAU, DUP, K = 0.3, 0.98, 20


def exact_top(img, txt, rows, k):
    """Each row's exact top-k (score > 0) as sets of global rows, float64."""
    a, b = img.astype(np.float64), txt.astype(np.float64)
    si, st = a[rows] @ a.T, b[rows] @ b.T
    s = np.where((si > TAU) & (st > TAU) & (si <= DUP) & (st <= DUP), si * st, 0.0)
    s[np.arange(len(rows)), rows] = 0.0
    top = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return [set(t[s[i, t] > 0]) for i, t in enumerate(top)]


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_the_calibrated_probe_is_the_smallest_that_reaches_the_recall(precision):
    img, txt, _ = uneven(3000, 24, seed=7, clusters=40)
    p = core.PassParams(k=K, tau_i=TAU, tau_t=TAU, dup=DUP, n_clusters=40, probe=5,
                     precision=precision, exact_noise=False)
    lay = layout.build_layout(img, txt, p)
    vec = persist.sorted_vectors(lay, img, txt, precision=precision)
    target, sample = 0.95, 300
    probe = calibrate.probe_for(lay, vec, p, target, sample=sample)
    pos = np.sort(np.random.default_rng(p.seed + 1).choice(len(img), sample, replace=False))
    rows = lay.order[pos]

    def recalls(probe_):
        got = E.mine(lay, vec, pos, dataclasses.replace(p, probe=probe_)).idx
        out = []
        for k in (10, K):
            want = exact_top(img, txt, rows, k)
            hit = sum(len(w & set(g[:k])) for w, g in zip(want, got))
            out.append(hit / sum(map(len, want)))
        return out

    assert 1 < probe < lay.n_clusters
    assert min(recalls(probe)) >= target
    assert min(recalls(probe - 1)) < target
