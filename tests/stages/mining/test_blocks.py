"""The neighbour pass in dense blocks (issue 15) against the naive loops and exact HPM."""
from __future__ import annotations

import numpy as np
import pytest
from vlcurate.stages.mining import blocks as B
from vlcurate.stages.mining import fff, hpm

from .naive import naive_fff, naive_hpm, pairs
from .test_hpm import assert_matches_naive

TAU = 0.3


def data(n=160, d=12, seed=3):
    img, txt = pairs(n, d, seed=seed, spread=0.8, n_clusters=6)
    img[7], txt[7] = img[3], txt[3]                      # an exact duplicate
    img[9] = img[4]                                      # an image duplicate only
    return img, txt


def params(k, c, probe=None, **kw):
    return B.PassParams(k=k, tau_i=TAU, tau_t=TAU, dup=0.98, n_clusters=c,
                        probe=probe or c, query_block=37, block_size=29,
                        **kw)


@pytest.mark.parametrize("c", [1, 5])
def test_exhaustive_pass_equals_naive_hpm(c):
    img, txt = data()
    k = 26
    lay, r = B.neighbour_pass(img, txt, params(k, c))
    assert lay.n_clusters == c and r.certified.all()
    assert_matches_naive(hpm.TopK(r.idx, r.score, r.support, r.certified),
                         naive_hpm(img, txt, k, TAU, TAU, 0.98), k)
    assert 0 < r.noise.sum() < len(img)
    assert 7 not in r.idx[3] and 3 not in r.idx[7]       # duplicates are not hard pairs


def brute_pairs(img, txt, fi, ft, ximg=None, xtxt=None, fx=2.0):
    si, st = img @ img.T, txt @ txt.T
    keep = (si > fi) | (st > ft)
    if ximg is not None:
        keep |= (ximg @ xtxt.T) > fx
    np.fill_diagonal(keep, False)
    return {(int(a), int(b)) for a, b in zip(*np.nonzero(keep))}


def test_exhaustive_pairs_are_every_pair_above_the_floors_with_exact_similarities():
    img, txt = data()
    rng = np.random.default_rng(1)
    ximg = hpm.normalize(img[:, :6] + 0.3 * rng.standard_normal((len(img), 6)))
    xtxt = hpm.normalize(img[:, :6] + 0.3 * rng.standard_normal((len(img), 6)))
    p = params(5, 4, floor_i=0.8, floor_t=0.85, floor_x=0.9)
    _, r = B.neighbour_pass(img, txt, p, ximg, xtxt)
    got = {(g, int(j)) for g in range(len(img)) for j in r.pair_j[r.offsets[g]:r.offsets[g + 1]]}
    assert got == brute_pairs(img, txt, 0.8, 0.85, ximg, xtxt, 0.9) and len(got) > 20
    q = np.repeat(np.arange(len(img)), np.diff(r.offsets))
    np.testing.assert_allclose(r.pair_sii, (img[q] * img[r.pair_j]).sum(1), atol=1e-5)
    np.testing.assert_allclose(r.pair_stt, (txt[q] * txt[r.pair_j]).sum(1), atol=1e-5)
    np.testing.assert_allclose(r.pair_sit, (ximg[q] * xtxt[r.pair_j]).sum(1), atol=1e-5)


@pytest.mark.parametrize("cross", [False, True])
def test_fff_eq1_on_the_pairs_equals_naive_eq1_and_the_duplicate_list(cross):
    """Eq. 1 (and HELIP's duplicates) applied to the persisted pairs = the naive loop over every
    pair, when the floors are at or below the rule's thresholds."""
    img, txt = data()
    rng = np.random.default_rng(2)
    ximg = hpm.normalize(img[:, :6] + 0.3 * rng.standard_normal((len(img), 6))) if cross else None
    xtxt = hpm.normalize(img[:, :6] + 0.3 * rng.standard_normal((len(img), 6))) if cross else None
    rule = fff.Rule(p1=0.9, p1_text=0.85, p2=0.85, p3=0.9, dup=0.98, cross=cross)
    p = params(5, 3, floor_i=0.85, floor_t=0.9, floor_x=0.85)
    _, r = B.neighbour_pass(img, txt, p, ximg, xtxt)
    import torch
    sit = torch.from_numpy(r.pair_sit) if cross else None
    code, score = fff.relate(torch.from_numpy(r.pair_sii), torch.from_numpy(r.pair_stt), sit, rule)
    q = np.repeat(np.arange(len(img)), np.diff(r.offsets))
    got = {(int(a), int(b)): (fff.CODES[c], s) for a, b, c, s in
           zip(q, r.pair_j, code.numpy(), score.numpy()) if c >= 0}
    ref = naive_fff(img, txt, 0.9, 0.85, 0.85, 0.9, 0.98, ximg, xtxt)
    want = {(i, j): v for i, row in ref.items() for j, v in row.items()}
    assert got.keys() == want.keys() and len(want) > 10
    for key, (rel, s) in want.items():
        assert got[key][0] == rel and abs(got[key][1] - s) < 1e-5
    dups = {key for key, (rel, _) in want.items() if rel == "duplicate"}
    assert {(3, 7), (7, 3), (4, 9), (9, 4)} <= dups


@pytest.mark.parametrize("k, probe, tau", [(5, 3, TAU), (500, 9, 0.5)])
def test_partial_probing_certificate_is_a_proof(k, probe, tau):
    """Issue 12: among certified targets, every top-k equals exact HPM's (precision 100%), at
    k = 5 and k = 500 (there: every row is a noise pair, certified only when no pair left out
    can score > 0), and at the prefixes k' <= k (certified_at) of the same pass."""
    img, txt = pairs(900, 16, seed=8, spread=0.5, n_clusters=12)
    p = B.PassParams(k=k, tau_i=tau, tau_t=tau, dup=0.98, n_clusters=12, probe=probe,
                     query_block=37, block_size=29)
    _, r = B.neighbour_pass(img, txt, p)
    ex = hpm.exact_hpm(img, txt, k, tau, tau, 0.98)
    exact_idx = B.canonical(ex.idx, ex.score)[0]
    assert (r.support <= ex.support).all()              # support among candidates: a lower bound
    for kk in sorted({5, 50, k} & set(range(1, k + 1))):
        cert = r.certified_at(kk)
        same = (r.idx[:, :kk] == exact_idx[:, :kk]).all(1)
        assert 0 < cert.sum() and (~cert).any()         # a real test: both kinds of targets
        assert same[cert].all()                         # every certified target is exact
    cert = r.certified                                  # k: the noise decision is exact too
    assert (r.noise[cert] == ex.noise[cert]).all()
    np.testing.assert_array_equal(r.certified, r.certified_at(k))


def test_gather_caps_pairs_per_row_by_similarity():
    img, txt = data()
    p = params(4, 2, floor_i=0.3, floor_t=0.3)
    _, full = B.neighbour_pass(img, txt, p)
    _, capped = B.neighbour_pass(img, txt, p, max_pairs=3)
    n_full = np.diff(full.offsets)
    assert (np.diff(capped.offsets) == np.minimum(n_full, 3)).all()
    assert capped.cut == int(np.maximum(n_full - 3, 0).sum()) > 0
    g = int(np.argmax(n_full))
    best = np.maximum(full.pair_sii, full.pair_stt)[full.offsets[g]:full.offsets[g + 1]]
    kept = np.maximum(capped.pair_sii, capped.pair_stt)[capped.offsets[g]:capped.offsets[g + 1]]
    np.testing.assert_allclose(np.sort(kept), np.sort(best)[-3:])


def test_actor_pool_equals_in_process(ray_local, tmp_path):
    img, txt = pairs(500, 16, seed=4, spread=0.6, n_clusters=8)
    p = params(5, 7, probe=3, floor_i=0.7, floor_t=0.7)
    _, local = B.neighbour_pass(img, txt, p)
    _, remote = B.neighbour_pass(img, txt, p, runner=B.ray_units(3, num_cpus=0.5))
    for f in ("idx", "support", "certified", "offsets", "pair_j"):
        np.testing.assert_array_equal(getattr(remote, f), getattr(local, f))
    for f in ("score", "pair_sii", "pair_stt"):
        np.testing.assert_allclose(getattr(remote, f), getattr(local, f), rtol=1e-6)
    assert local.certified.any() and (~local.certified).any()


def test_capping_as_units_arrive_equals_capping_once(monkeypatch):
    """gather caps the pairs it holds whenever they pass 2 n max_pairs (+ slack): with no slack
    it compacts after nearly every unit, and the result is the same as one cap at the end."""
    img, txt = data()
    p = params(4, 2, floor_i=0.3, floor_t=0.3)
    _, once = B.neighbour_pass(img, txt, p, max_pairs=3)
    monkeypatch.setattr(B, "COMPACT_SLACK", -2 * len(img) * 3)
    _, often = B.neighbour_pass(img, txt, p, max_pairs=3)
    for f in ("offsets", "pair_j", "pair_sii", "pair_stt", "pair_sit", "idx", "score"):
        np.testing.assert_array_equal(getattr(often, f), getattr(once, f))
    assert often.cut == once.cut > 0
