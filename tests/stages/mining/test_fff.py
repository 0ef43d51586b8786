"""FFF Eq. 1 positives (+ HELIP duplicates) against naive per-pair loops (tests/stages/mining/
naive.py): the unimodal remainder, the full rule with a cross-modal model (sec. 4.1), and images
x k captions (sec. 4.3)."""
from __future__ import annotations

import numpy as np
import pytest
from vlcurate.stages.mining import fff, hpm

from .naive import naive_fff, naive_fff_captions, pairs


def as_dict(p: fff.Positives, captions: bool = False) -> dict:
    return {i: {((int(j), int(k)) if captions else int(j)): (fff.CODES[c], float(s))
                for j, k, c, s in zip(p.idx[i], p.caption[i], p.code[i], p.score[i]) if j >= 0}
            for i in range(len(p.idx))}


def assert_same(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for i in ref:
        assert got[i].keys() == ref[i].keys(), i
        for j, (rel, s) in ref[i].items():
            assert got[i][j][0] == rel and got[i][j][1] == pytest.approx(s, abs=1e-5), (i, j)


def tight(n, d, seed):
    """Tight clusters, so that the high FFF thresholds fire for some pairs and not others."""
    return pairs(n, d, seed, spread=0.25, n_clusters=12)


def cross_vectors(img, seed, noise=0.3, d=4):
    """A cross-modal space correlated with the images: S_it varies around the thresholds."""
    rng = np.random.default_rng(seed)
    n = len(img)
    return (hpm.normalize(img[:, :d] + noise * rng.standard_normal((n, d))),
            hpm.normalize(img[:, :d] + noise * rng.standard_normal((n, d))))


def test_unimodal_rule_equals_naive_loop():
    img, txt = tight(120, 6, seed=1)
    # dup above p3, or every S_tt > p3 pair would be a duplicate first (as with the defaults)
    rule = fff.Rule(p2=0.92, p3=0.99, dup=0.995)
    ref = naive_fff(img, txt, p2=0.92, p3=0.99, dup=0.995)
    got = fff.exact_positives(img, txt, rule, max_positives=200, block_size=29, query_block=17)
    assert_same(as_dict(got), ref)
    rels = {r for d in ref.values() for r, _ in d.values()}
    assert {"duplicate", "image", "text"} <= rels          # every unimodal relation occurs
    assert (got.count == [len(ref[i]) for i in range(120)]).all()


CROSS_RULE = dict(p1=0.9, p1_text=0.8, p2=0.97, p3=0.97, dup=0.99)


def test_full_eq1_with_a_cross_modal_model_equals_naive_loop():
    """Every FFF similarity on the cross-modal model; HELIP duplicates on the unimodal vectors,
    a text duplicate gated by S_it > p1' like any text positive."""
    img, txt = tight(100, 6, seed=2)
    ximg, xtxt = cross_vectors(img, seed=3)
    rule = fff.Rule(**CROSS_RULE, cross=True)
    ref = naive_fff_captions(ximg, [[t] for t in xtxt], **CROSS_RULE, img=img, txt=txt)
    got = fff.exact_positives(img, txt, rule, 400, ximg=ximg, xtxt=xtxt, block_size=31,
                              query_block=13)
    assert_same(as_dict(got, captions=True), ref)
    rels = {r for d in ref.values() for r, _ in d.values()}
    assert rels == {"duplicate", "image", "cross", "text"}
    sit = ximg @ xtxt.T
    # the text rule is gated by S_it > p1': some S_tt > p3 pairs are not positives
    stt, sii = xtxt @ xtxt.T, ximg @ ximg.T
    gated = [(i, j) for i in range(100) for j in range(100) if i != j and stt[i, j] > 0.97
             and sii[i, j] <= 0.97 and sit[i, j] <= 0.8 and img[i] @ img[j] <= 0.99]
    assert gated and all((j, 0) not in ref[i] for i, j in gated)
    # HELIP duplicates do not bypass it either: a text duplicate with a low S_it is no positive
    bypass = [(i, j) for i in range(100) for j in range(100) if i != j and txt[i] @ txt[j] > 0.99
              and img[i] @ img[j] <= 0.99 and sit[i, j] <= 0.8 and sii[i, j] <= 0.97]
    assert bypass and all((j, 0) not in ref[i] for i, j in bypass)
    # directional, as S_it is: some (i, j) is a cross positive while (j, i) is not a positive
    d = as_dict(got, captions=True)
    assert any(rel == "cross" and (i, 0) not in d[j] for i in d for (j, _), (rel, _) in d[i].items())


def test_sec_4_3_images_by_k_captions_equals_naive_loop():
    """k captions per image (1 to 4, some images without recaptions): S_it per caption, S_ii
    per image, S_tt between caption groups (mean over every caption pair)."""
    n, rng = 60, np.random.default_rng(7)
    img, txt = tight(n, 6, seed=8)
    ximg, xcap = cross_vectors(img, seed=9, noise=0.25)
    groups = [[xcap[j]] + [hpm.normalize(xcap[j] + 0.2 * rng.standard_normal((1, 4)))[0]
                           for _ in range(int(rng.integers(0, 4)))] for j in range(n)]
    owner = np.repeat(np.arange(n), [len(g) for g in groups])
    number = np.concatenate([np.arange(len(g)) for g in groups])
    flat = np.concatenate([np.stack(g) for g in groups]).astype(np.float32)
    p = dict(p1=0.92, p1_text=0.8, p2=0.98, p3=0.9, dup=0.99)
    ref = naive_fff_captions(ximg, groups, **p, img=img, txt=txt)
    got = fff.exact_positives(img, txt, fff.Rule(**p, cross=True), 1000, ximg=ximg, xtxt=flat,
                              block_size=37, query_block=11, owner=owner, number=number)
    assert_same(as_dict(got, captions=True), ref)
    rels = {r for d in ref.values() for r, _ in d.values()}
    assert rels == {"duplicate", "image", "cross", "text"}
    assert any(c > 0 for d in ref.values() for (_, c) in d)        # recaptions are positives
    # an image positive covers every caption of the other image (S_ii replicated k times)
    for i, d in ref.items():
        for (j, c), (rel, _) in d.items():
            if rel == "image":
                assert all((j, k) in d for k in range(len(groups[j])))
    # the fast path with an exhaustive search finds the same
    f = fff.features(img, txt, fff.Rule(**p, cross=True), ximg, flat, owner, number, None)
    params = {k: hpm.auto_params(len(b), b.shape[1], nlist=2, m=2, nprobe=2)
              for k, (b, _, _) in fff.index_sources(f).items()}
    fast = fff.FastPositives(fff.FastPositives.build(f, params), f)
    assert_same(as_dict(fast.query(np.arange(n), fff.Rule(**p, cross=True), 1000,
                                   k_prime=len(flat)), captions=True), ref)


def test_duplicates_switch_and_self_exclusion():
    img, txt = tight(60, 6, seed=4)
    img[1], txt[1] = img[0], txt[0]                          # an exact copy of row 0
    with_dup = as_dict(fff.exact_positives(img, txt, fff.Rule(dup=0.98), 50))
    assert with_dup[0][1][0] == "duplicate" and 0 not in with_dup[0]
    without = as_dict(fff.exact_positives(img, txt, fff.Rule(dup=0.98, duplicates=False), 50))
    assert without[0][1][0] == "image"                       # still an FFF positive (S_ii = 1)


def test_max_positives_keeps_best_relation_then_score_and_counts_the_cut():
    img, txt = tight(80, 6, seed=5)
    full = fff.exact_positives(img, txt, fff.Rule(), 80)
    cut = fff.exact_positives(img, txt, fff.Rule(), 3, block_size=16)
    for i in range(80):
        js = [(c, -s, j) for j, c, s in zip(full.idx[i], full.code[i], full.score[i]) if j >= 0]
        want = [j for _, _, j in sorted(js)[:3]]
        assert [j for j in cut.idx[i] if j >= 0] == want
        assert cut.count[i] == full.count[i] == len(js)     # what the cut removed is counted
    assert (cut.count > 3).any()


def test_fast_positives_with_exhaustive_search_equal_exact():
    img, txt = tight(300, 8, seed=6)
    rule = fff.Rule()
    ex = fff.exact_positives(img, txt, rule, 32)
    f = fff.features(img, txt, rule, device=None)
    params = {k: hpm.auto_params(300, 8, nlist=4, m=8, nprobe=4) for k in ("image", "text")}
    fp = fff.FastPositives(fff.FastPositives.build(f, params), f)
    got = fp.query(np.arange(300), rule, 32, k_prime=300)
    assert_same(as_dict(got), as_dict(ex))
    assert sum(len(v) for v in as_dict(got).values()) > 100


def test_stable_topk_breaks_ties_by_the_lower_column():
    """Equal keys (a duplicated image gives two positives one score) keep the lower text index,
    as a full stable sort would; keys below the floor (not positives) may come in any order."""
    import torch
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.integers(0, 5, (200, 300)).astype(np.float32))
    for k in (1, 7, 64, 300):
        want = torch.sort(x, dim=1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(fff.stable_topk(x, k), want)
    y = torch.full((3, 50), -1.0)
    y[:, [4, 9, 30]] = torch.tensor([0.5, 0.7, 0.5])
    top = fff.stable_topk(y, 5)
    assert top[:, :3].tolist() == [[9, 4, 30]] * 3 and (y.gather(1, top[:, 3:]) == -1).all()


def test_candidates_of_no_rows():
    img, txt = pairs(10, 4, seed=1)
    f = fff.features(img, txt, fff.Rule(), device=None)
    r = fff.Candidates(f).score(np.zeros(0, np.int64), np.full((0, 1), -1), fff.Rule(), 4)
    assert r.idx.shape == (0, 4) and len(r.count) == 0
