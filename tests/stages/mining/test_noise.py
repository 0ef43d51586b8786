"""The pass's noise decisions against exact HPM, brute force in float64 (HELIP Alg. 1: a row is a
noise pair when fewer than k pairs support it): a partial search undercounts the support, so the
pass completes the count of rows it finds short (passes.complete)."""
from __future__ import annotations

import numpy as np
import pytest
from vlcurate.stages.mining import engine as E
from vlcurate.stages.mining.engine import core

from .shapes import exact_scores, exact_support, uneven

TAU, DUP = 0.3, 0.98
SHAPES = {"uneven": dict(), "wide, long tail": dict(spread=(0.8, 1.4), isolated=0.15, alpha=2.0)}


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(request):
    img, txt, kind = uneven(2400, 24, seed=5, **SHAPES[request.param])
    return img, txt, kind, exact_support(img, txt, TAU, TAU, DUP)


def mined(img, txt, k, precision="fp32", exact_noise=True):
    p = core.PassParams(k=k, tau_i=TAU, tau_t=TAU, dup=DUP, n_clusters=30, probe=3,
                     precision=precision, exact_noise=exact_noise)
    return E.neighbour_pass(img, txt, p, rows=1000)[1]


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("k", [10, 50, 100])
def test_noise_flags_equal_exact_hpms(shape, k, precision):
    img, txt, kind, support = shape
    r = mined(img, txt, k, precision)
    want = support < k
    assert 0 < want.sum() < len(want)
    assert not (r.noise & ~want).any()                   # no false noise flag
    assert not (~r.noise & want).any()                   # every noise pair still flagged
    assert want[kind == 2].any() and r.noise[(kind == 2) & want].all()   # mismatched pairs
    np.testing.assert_array_equal(r.support[want], support[want])   # their count is exact
    assert (r.support <= support).all()
    # every certified row's top-k is exact: the completed rows (searched everywhere) among them
    cert = r.certified
    assert cert[want].all()
    np.testing.assert_allclose(r.score[cert], exact_scores(img, txt, k, TAU, DUP)[cert], atol=2e-6)


def test_without_completing_a_partial_pass_flags_good_rows(shape):
    """What the completion is for: the same pass, short rows left as found, flags rows whose
    exact support is k or more (at each k), and completing changes only those rows' flags."""
    img, txt, kind, support = shape
    for k in (10, 50, 100):
        plain, done = mined(img, txt, k, exact_noise=False), mined(img, txt, k)
        false = plain.noise & (support >= k)
        assert false.any()
        np.testing.assert_array_equal(plain.noise != done.noise, false)
        same = ~plain.noise                              # rows not short: untouched
        np.testing.assert_array_equal(plain.idx[same], done.idx[same])
        np.testing.assert_array_equal(plain.pair_j, done.pair_j)   # the pairs are the pass's
