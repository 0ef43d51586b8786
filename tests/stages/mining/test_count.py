"""complete's count-only last step (count.py) against the search of every cluster left, which it
replaces for rows that stay short: the same bytes in every field of the pass's result, and the
noise flags and support of exact HPM (brute force, float64), on clustered data of uneven sizes
with a tail of isolated and mismatched rows."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from vlcurate.stages.mining import engine as E
from vlcurate.stages.mining.engine import core, count, passes
from vlcurate.stages.mining.int8 import kernels

from .shapes import exact_scores, exact_support, uneven

TAU, DUP = 0.3, 0.98
FIELDS = [f.name for f in dataclasses.fields(passes.Found)] + ["bound", "cut"]


def search_every_cluster_left(lay, vec, pos, r, rows, searched, p, device):
    """The last step as a search of every cluster the rows have not searched (no count)."""
    rest = np.where(searched | (np.diff(lay.bounds) == 0), -1,
                    np.arange(lay.n_clusters)[None, :])
    passes._search(lay, vec, pos, r, rows, rest, np.full(len(rows), -np.inf, np.float32), p,
                   device)


@pytest.fixture(scope="module")
def data():
    img, txt, _ = uneven(1200, 24, seed=11, clusters=30, alpha=1.5, spread=(0.5, 1.3),
                            isolated=0.05, mismatched=0.03)
    return img, txt, exact_support(img, txt, TAU, TAU, DUP)


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("k", [10, 50])
def test_last_step_keeps_every_byte_and_exact_noise(data, k, precision, monkeypatch):
    """int8 counts (fp32 searches every cluster left: its scores are read off GEMMs whose last
    bits follow their shapes)."""
    img, txt, support = data
    p = core.PassParams(k=k, tau_i=TAU, tau_t=TAU, dup=DUP, n_clusters=30, probe=2,
                        precision=precision)
    lay, vec, _ = E.prepare(img, txt, p)
    pos = lay.positions()
    reached = []
    real_count = count.count

    def spy(*a, **kw):                         # the real count, its answers recorded
        got = real_count(*a, **kw)
        reached.append(got[0])
        return got

    monkeypatch.setattr(passes, "count", spy)
    new = passes.PassResult.concat([E.mine(lay, vec, pos[a:a + 500], p)
                                    for a in range(0, len(pos), 500)])
    monkeypatch.setattr(passes, "_last_step", search_every_cluster_left)
    old = passes.PassResult.concat([E.mine(lay, vec, pos[a:a + 500], p)
                                    for a in range(0, len(pos), 500)])
    if precision == "fp32":
        assert not reached
    else:
        reached = np.concatenate(reached)
        assert reached.any() and not reached.all()      # both of the last step's ways taken
    assert new.everywhere == old.everywhere > 0
    for f in FIELDS:
        assert getattr(new, f).tobytes() == getattr(old, f).tobytes(), f
    want = support < k
    np.testing.assert_array_equal(new.noise, want)
    np.testing.assert_array_equal(new.support[want], support[want])
    assert new.certified[want].all()
    cert = new.certified                       # their top-k is exact HPM's (float64)
    np.testing.assert_allclose(new.score[cert], exact_scores(img, txt, k, TAU, DUP)[cert], atol=2e-6)


def test_count_stops_at_need_and_lists_every_supporting_cluster(data):
    """count alone, on every cluster: a row reaches its need only when its exact support does
    (nearly every such row does: sure supporters are MARGIN above the thresholds), and a row not
    reached lists every cluster holding one of its supporters."""
    img, txt, support = data
    p = core.PassParams(k=10, tau_i=TAU, tau_t=TAU, dup=DUP, n_clusters=30, probe=2,
                        precision="int8")
    lay, vec, _ = E.prepare(img, txt, p)
    pos = lay.positions()                      # global row i at sorted position pos[i]
    done = np.zeros((len(pos), lay.n_clusters), bool)
    need = np.full(len(pos), 10)
    reached, possible = count.count(lay, vec, pos, done, need, p)
    assert not (reached & (support < 10)).any()
    assert reached.sum() >= 0.99 * (support >= 10).sum() > 0
    a, b = img.astype(np.float64), txt.astype(np.float64)
    ok = (a @ a.T > TAU) & (b @ b.T > TAU) & (a @ a.T <= DUP) & (b @ b.T <= DUP)
    np.fill_diagonal(ok, False)
    cluster = lay.cluster_of(pos)               # each global row's cluster
    for i in np.flatnonzero(~reached):
        assert possible[i, cluster[np.flatnonzero(ok[i])]].all()


amx = pytest.mark.skipif(not kernels.amx(), reason="no AMX (or no C compiler) here: count "
                                                   "screens cluster by cluster")


@amx
@pytest.mark.parametrize("nq, rows, d", [(57, 300, 64), (1, 33, 128), (70, 31, 384), (0, 5, 64),
                                         (33, 0, 64)])
def test_count_hits_lists_the_pairs_above_each_cluster_s_threshold(nq, rows, d):
    """kernels.count_hits (AMX) against NumPy's integer sums: a range starting and ending
    inside clusters (an empty one among them), values at int8's ends, thresholds at int32's
    ends and near the sums, query and member tails (not multiples of 32), and a room so
    small that it stops and goes on where it stopped."""
    rng = np.random.default_rng(nq + rows + d)
    m = rng.integers(-128, 128, (rows + 40, d), dtype=np.int8)
    q = rng.integers(-128, 128, (nq, d), dtype=np.int8)
    bounds = np.array([0, 7, 20, 20, 20 + rows // 2, rows + 25, rows + 40])
    a, b = 10, rows + 30
    sums = q.astype(np.int64) @ m.astype(np.int64).T
    width = -(-nq // 32) * 32
    lim = np.full((len(bounds) - 1, width), 2 ** 31 - 1, np.int32)
    mid = int(np.median(sums)) if sums.size else 0
    lim[:, :nq] = mid + rng.integers(-3 * d, 300 * d, (len(bounds) - 1, nq))
    if nq > 2:
        lim[1, 0], lim[4, 1] = -(2 ** 31), 2 ** 31 - 1
    cl = np.searchsorted(bounds, np.arange(len(m)), side="right") - 1
    want = sums > lim[cl, :nq].T
    want[:, :a] = want[:, b:] = False
    got, at, calls = np.zeros_like(want), a, 0
    while at < b or not calls:
        r, j, at = kernels.count_hits(q, m, at, b, bounds, 0, lim, 32 * width + 40)
        assert not got[r, j].any()              # each pair once
        got[r, j] = True
        calls += 1
    assert np.array_equal(got, want)
    assert nq * rows < 2 or 0 < want.sum() < want.size
    assert calls > 1 or b - a <= 32 or want.sum() <= 40     # stopped when the room ran out


@amx
@pytest.mark.parametrize("k", [10, 50])
def test_count_by_range_answers_as_cluster_by_cluster(k, monkeypatch):
    """count on AMX (whole ranges, Precision.space_count) against count cluster by cluster
    (VNNI or torch per block): the same rows reach their need and the rows that do not list
    the same clusters; and so every PassResult field of the pass is the same bytes. 128
    dimensions (AMX's multiple of 64), a small RANGE and CAP: several ranges and stops."""
    from vlcurate.stages.mining.int8.precision import Int8
    img, txt, _ = uneven(1500, 128, seed=3, clusters=24, alpha=1.5, spread=(0.5, 1.3),
                         isolated=0.05, mismatched=0.03)
    support = exact_support(img, txt, TAU, TAU, DUP)
    p = core.PassParams(k=k, tau_i=TAU, tau_t=TAU, dup=DUP, n_clusters=24, probe=2,
                        precision="int8")
    lay, vec, _ = E.prepare(img, txt, p)
    pos = lay.positions()
    monkeypatch.setattr(count, "RANGE", 256)
    monkeypatch.setattr(count, "ROWS", 64)
    monkeypatch.setattr(count, "CAP", 32 * 64 + 100)
    done = np.random.default_rng(1).random((len(pos), lay.n_clusters)) < 0.1
    need = np.full(len(pos), k)
    answers, results, calls = [], [], []
    real = kernels.count_hits
    monkeypatch.setattr(kernels, "count_hits", lambda *a: calls.append(1) or real(*a))
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(Int8, "space_count", lambda *a: None)
        answers.append(count.count(lay, vec, pos, done, need, p))
        results.append(passes.PassResult.concat([E.mine(lay, vec, pos[a:a + 500], p)
                                                 for a in range(0, len(pos), 500)]))
    assert len(calls) > 2 * len(pos) / 256        # AMX ran, range by range
    (reached, possible), (reached_c, possible_c) = answers
    np.testing.assert_array_equal(reached, reached_c)
    assert reached.any() and not reached.all()
    np.testing.assert_array_equal(possible[~reached], possible_c[~reached])
    new, old = results
    assert new.everywhere > 0
    for f in FIELDS:
        assert getattr(new, f).tobytes() == getattr(old, f).tobytes(), f
    np.testing.assert_array_equal(new.noise, support < k)
