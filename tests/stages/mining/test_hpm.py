"""HELIP HPM / FastHPM against the naive per-target loop of Alg. 1."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from vlcurate.stages.mining import hpm

from .naive import naive_hpm, pairs

TAU = 0.3


def assert_matches_naive(r: hpm.TopK, ref, k):
    for i, (hard, scores, support, noise) in enumerate(ref):
        assert r.support[i] == support, i
        assert r.noise[i] == noise, i
        got = [j for j in r.idx[i] if j >= 0] if not noise else []
        assert got == hard, i
        if not noise:
            np.testing.assert_allclose(r.score[i][:k], scores, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dup", [0.98, None])
def test_exact_equals_naive_loop(dup, device):
    img, txt = pairs(120, 12, seed=1, spread=1.2)
    k = 6
    ref = naive_hpm(img, txt, k, TAU, 0.35, dup)
    # small blocks: many query blocks and base blocks to merge
    r = hpm.exact_hpm(img, txt, k, TAU, 0.35, dup, block_size=37, query_block=23,
                      device=device)
    assert_matches_naive(r, ref, k)
    noise = sum(x[3] for x in ref)
    assert 0 < noise < len(ref)            # the data exercises both outcomes
    assert r.certified.all()


def test_exact_subset_of_queries_and_unnormalised_norms():
    img, txt = pairs(90, 8, seed=2)
    r_all = hpm.exact_hpm(img, txt, 5, TAU, TAU)
    q = np.array([3, 50, 7, 89])
    r = hpm.exact_hpm(img, txt, 5, TAU, TAU, queries=q, block_size=16)
    np.testing.assert_array_equal(r.idx, r_all.idx[q])
    np.testing.assert_array_equal(r.support, r_all.support[q])


def fast(img, txt, nlist, m, nprobe, pool=None, seed=0, nbits=8):
    p = hpm.auto_params(len(img) if pool is None else len(pool), img.shape[1] * 2, nlist, m,
                        nbits, nprobe)
    return hpm.FastHPM.build(img, txt, p, np.arange(len(img)) if pool is None else pool, seed)


def test_fast_with_whole_pool_and_exhaustive_probing_equals_exact():
    img, txt = pairs(300, 8, seed=3)
    k = 8
    ex = hpm.exact_hpm(img, txt, k, TAU, TAU)
    f = fast(img, txt, nlist=8, m=4, nprobe=8)
    assert f.exhaustive
    r = f.query(img, txt, np.arange(300), k, TAU, TAU, k_prime=300)
    np.testing.assert_array_equal(r.idx, ex.idx)
    np.testing.assert_allclose(r.score, ex.score, rtol=1e-6)
    np.testing.assert_array_equal(r.support, ex.support)
    assert r.certified.all()


def test_fast_widening_certifies_and_recovers_exact():
    """k' = k leaves most targets uncertified; widening up to the pool makes every target
    certified, and (1-d PQ sub-quantizers: estimates close to exact) equal to exact HPM."""
    img, txt = pairs(400, 4, seed=4, spread=0.4)
    k = 5
    ex = hpm.exact_hpm(img, txt, k, TAU, TAU)
    f = fast(img, txt, nlist=4, m=8, nprobe=4)
    narrow = f.query(img, txt, np.arange(400), k, TAU, TAU, k_prime=k, widen="off")
    assert narrow.certified.mean() < 0.5
    wide = f.query(img, txt, np.arange(400), k, TAU, TAU, k_prime=k, k_prime_max=400,
                   widen="all")
    assert wide.certified.all()
    np.testing.assert_array_equal(wide.idx, ex.idx)
    np.testing.assert_array_equal(wide.noise, ex.noise)
    # widen="noise": only targets about to be called noise pairs are searched again; their
    # decisions are exact, the other hard sets stay those of the narrow search
    some = f.query(img, txt, np.arange(400), k, TAU, TAU, k_prime=k, k_prime_max=400)
    np.testing.assert_array_equal(some.noise, ex.noise)
    assert narrow.noise.sum() > ex.noise.sum()              # the narrow search over-flags
    kept = ~narrow.noise
    np.testing.assert_array_equal(some.idx[kept], narrow.idx[kept])


def test_fast_pool_excludes_the_target_and_stays_in_the_pool():
    img, txt = pairs(300, 8, seed=5)
    pool = hpm.sample_pool(300, 120, seed=7)
    f = fast(img, txt, nlist=4, m=4, nprobe=4, pool=pool)
    q = np.arange(300)
    r = f.query(img, txt, q, 5, TAU, TAU, k_prime=120)
    assert set(r.idx[r.idx >= 0].tolist()) <= set(pool.tolist())
    assert not (r.idx == q[:, None]).any()
    # = exact HPM restricted to the pool (Eq. 5), for pool members and for the others
    sub = hpm.exact_hpm(img[pool], txt[pool], 5, TAU, TAU)
    inpool = np.searchsorted(pool, pool)
    np.testing.assert_array_equal(r.idx[pool], np.where(sub.idx >= 0, pool[sub.idx], -1)[inpool])


def test_same_seed_same_output_and_pool():
    img, txt = pairs(500, 8, seed=6)
    q = np.arange(500)
    a = fast(img, txt, 8, 4, 2, pool=hpm.sample_pool(500, 300, 11), seed=11)
    b = fast(img, txt, 8, 4, 2, pool=hpm.sample_pool(500, 300, 11), seed=11)
    ra = a.query(img, txt, q, 5, TAU, TAU, k_prime=20)
    rb = b.query(img, txt, q, 5, TAU, TAU, k_prime=20)
    for f in ("idx", "score", "support", "certified"):
        np.testing.assert_array_equal(getattr(ra, f), getattr(rb, f))
    np.testing.assert_array_equal(hpm.sample_pool(500, 300, 11), hpm.sample_pool(500, 300, 11))
    assert not np.array_equal(hpm.sample_pool(500, 300, 11), hpm.sample_pool(500, 300, 12))


# --- noise rule, thresholds, duplicates -----------------------------------------------------------
def unit(*rows):
    x = np.array(rows, np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_noise_pairs():
    # rows 0-3: one group (image and text similar, 0.6-0.8, not duplicates); row 4: its image
    # looks like the group's (0.89) but its caption is about something else (<= 0.45)
    img = unit([1, .5, 0], [1, 0, .5], [1, -.5, 0], [1, 0, -.5], [1, 0, 0])
    txt = unit([.5, 1, 0], [0, 1, .5], [-.5, 1, 0], [0, 1, -.5], [0, 0, 1])
    r = hpm.exact_hpm(img, txt, 3, 0.5, 0.5)
    np.testing.assert_array_equal(r.support, [3, 3, 3, 3, 0])
    np.testing.assert_array_equal(r.noise, [False] * 4 + [True])
    assert set(r.idx[0]) == {1, 2, 3} and (r.idx[4] == -1).all()
    r4 = hpm.exact_hpm(img, txt, 4, 0.5, 0.5)       # k = 4: the group has only 3 supporters
    assert r4.noise.all()


def test_threshold_is_strict_and_bound():
    si = torch.tensor([[0.5, 0.50001, 0.9, 0.99]])
    st = torch.tensor([[0.9, 0.9, 0.5, 0.9]])
    s = hpm.pair_scores(si.clone(), st.clone(), 0.5, 0.5, dup=0.98)
    np.testing.assert_allclose(s.numpy(), [[0.0, 0.50001 * 0.9, 0.0, 0.0]], rtol=1e-6)
    s = hpm.pair_scores(si.clone(), st.clone(), 0.5, 0.5, dup=None)
    np.testing.assert_allclose(s.numpy(), [[0.0, 0.50001 * 0.9, 0.0, 0.99 * 0.9]], rtol=1e-6)
    m = torch.tensor([0.2, 0.5, 0.51, 0.9])
    np.testing.assert_allclose(hpm.score_bound(m, 0.5, 0.5).numpy(), [0, 0, 0.51 ** 2, 0.81],
                               rtol=1e-6)


@pytest.mark.parametrize("dup", [0.98, None])
def test_sparse_scores_and_merge_equal_the_dense_rule_and_a_stable_sort(dup):
    """positive_pairs = pair_scores' positive entries (values at the thresholds and at dup
    included), and merge_pairs over blocks = a stable sort of every positive score (ties keep
    the lower column), while rows fill and once they are full."""
    g = torch.Generator().manual_seed(0)
    levels = torch.tensor([0.1, 0.5, 0.6, 0.7, 0.9, 0.98, 0.99])      # many exact ties
    si = levels[torch.randint(0, 7, (40, 300), generator=g)]
    st = levels[torch.randint(0, 7, (40, 300), generator=g)]
    own_r, own_c = torch.arange(0, 40, 3), torch.arange(0, 40, 3) * 7
    dense = hpm.pair_scores(si.clone(), st.clone(), 0.5, 0.5, dup)
    dense[own_r, own_c] = 0.0
    r, c, v = hpm.positive_pairs(si, st, 0.5, 0.5, dup, own_r, own_c)
    want_r, want_c = dense.nonzero(as_tuple=True)
    assert torch.equal(r, want_r) and torch.equal(c, want_c)
    assert torch.equal(v, dense[want_r, want_c])
    for k in (3, 200):          # 3: blocks after the first mostly fill nothing; 200: still filling
        best_s = torch.full((40, k), -1.0)
        best_j = torch.full((40, k), -1, dtype=torch.long)
        for b0 in range(0, 300, 64):
            sel = (c >= b0) & (c < b0 + 64)
            best_s, best_j = hpm.merge_pairs(best_s, best_j, r[sel], c[sel], v[sel], k)
        order = torch.sort(dense, dim=1, descending=True, stable=True).indices[:, :k]
        top = dense.gather(1, order)
        assert torch.equal(best_s.clamp(min=0), top)
        assert torch.equal(torch.where(top > 0, best_j, -1), torch.where(top > 0, order, -1))


def test_duplicates_are_neither_hard_pairs_nor_support():
    img = unit([1, 0, 0], [1, 0, 0], [1, 0.3, 0], [1, 0, 0.3])
    txt = unit([0, 1, 0], [0, 1, 0], [0.3, 1, 0], [0, 1, 0.3])
    r = hpm.exact_hpm(img, txt, 2, 0.5, 0.5, dup=0.98)        # rows 0 and 1 are duplicates
    assert set(r.idx[0]) == {2, 3} and r.support[0] == 2
    r = hpm.exact_hpm(img, txt, 2, 0.5, 0.5, dup=None)
    assert r.idx[0][0] == 1 and r.score[0][0] == pytest.approx(1.0) and r.support[0] == 3


# --- edge cases -------------------------------------------------------------------------------------
def test_one_row():
    r = hpm.exact_hpm(unit([1, 0]), unit([0, 1]), 3, 0.5, 0.5)
    assert r.support.tolist() == [0] and r.noise.tolist() == [True]
    assert (r.idx == -1).all() and r.idx.shape == (1, 3)


def test_k_at_least_n_is_noise_for_everyone():
    img, txt = pairs(6, 4, seed=8, spread=0.1, n_clusters=1)
    r = hpm.exact_hpm(img, txt, 6, 0.1, 0.1, dup=None)
    assert r.noise.all() and (r.support == 5).all()
    assert [x[3] for x in naive_hpm(img, txt, 6, 0.1, 0.1)] == [True] * 6
    f = fast(img, txt, 1, 2, 1)
    rf = f.query(img, txt, np.arange(6), 6, 0.1, 0.1, dup=None)
    assert rf.noise.all() and rf.certified.all() and (rf.support == 5).all()


def test_identical_vectors():
    img = np.tile(unit([1, 2, 3]), (5, 1))
    txt = np.tile(unit([3, 1, 0]), (5, 1))
    r = hpm.exact_hpm(img, txt, 2, 0.5, 0.5, dup=0.98)   # all duplicates: nothing supports
    assert r.noise.all() and (r.support == 0).all()
    r = hpm.exact_hpm(img, txt, 2, 0.5, 0.5, dup=None)   # all tie at 1.0
    assert (r.support == 4).all() and not r.noise.any()
    np.testing.assert_allclose(r.score, 1.0, rtol=1e-6)
    for i in range(5):                                   # equal scores: any 2 of the others
        assert len(set(r.idx[i])) == 2 and i not in r.idx[i] and (r.idx[i] >= 0).all()


def test_all_similarities_below_thresholds():
    img, txt = pairs(50, 16, seed=9, spread=3.0, n_clusters=50)
    r = hpm.exact_hpm(img, txt, 1, 0.99, 0.99, dup=None)
    assert (r.support == 0).all() and r.noise.all() and (r.idx == -1).all()


def test_auto_params():
    p = hpm.auto_params(1_000_000, 768)
    assert (p.nlist, p.m, p.nbits, p.nprobe, p.hnsw) == (1024, 384, 4, 64, False)
    assert p.train_size == 64 * 1024
    p = hpm.auto_params(65_000, 768)
    assert (p.nlist, p.nprobe, p.train_size) == (256, 64, 16384)
    assert hpm.auto_params(20_000_000, 768).hnsw
    p = hpm.auto_params(100, 10, nbits=8)
    assert p.nlist == 2 and p.m == 5 and p.train_size == 100 and p.nbits == 6
    with pytest.raises(ValueError, match="divide"):
        hpm.auto_params(100, 10, m=3)
    faiss = pytest.importorskip("faiss")
    assert isinstance(hpm.build_ivfpq(pairs(300, 8, 1)[0], hpm.auto_params(300, 8), 0),
                      faiss.IndexIVFPQFastScan)


def test_hnsw_quantizer_and_saved_index_give_the_same_hard_pairs(tmp_path):
    img, txt = pairs(400, 8, seed=10)
    q = np.arange(400)
    flat = hpm.IvfParams(nlist=16, m=8, nbits=4, nprobe=16, train_size=400)
    graph = hpm.IvfParams(nlist=16, m=8, nbits=4, nprobe=16, train_size=400, hnsw=True)
    a = hpm.FastHPM(hpm.build_ivfpq(hpm.JointView(img, txt), flat), q, img, txt)
    index = hpm.build_ivfpq(hpm.JointView(img, txt), graph)
    hpm.save_index(index, str(tmp_path / "j.ivfpq"))
    b = hpm.FastHPM(hpm.load_index(str(tmp_path / "j.ivfpq"), 16), q, img, txt)
    assert a.exhaustive and b.exhaustive
    ra = a.query(img, txt, q, 5, TAU, TAU, k_prime=20)
    rb = b.query(img, txt, q, 5, TAU, TAU, k_prime=20)
    np.testing.assert_array_equal(ra.idx, rb.idx)


def test_gather_dots():
    rng = np.random.default_rng(0)
    base = rng.standard_normal((50, 6)).astype(np.float32)
    q = rng.standard_normal((4, 6)).astype(np.float32)
    ids = rng.integers(0, 50, (4, 7))
    ids[1, 2] = -1
    got = hpm.gather_dots(q, base, ids).numpy()
    want = np.einsum("qd,qkd->qk", q, base[np.maximum(ids, 0)])
    assert np.isneginf(got[1, 2])
    ok = ids >= 0
    np.testing.assert_allclose(got[ok], want[ok], rtol=1e-5, atol=1e-6)
