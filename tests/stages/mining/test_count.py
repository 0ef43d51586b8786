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
