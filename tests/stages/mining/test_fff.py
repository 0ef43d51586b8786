"""FFF Eq. 1 positives (+ HELIP duplicates) against the naive per-pair loop."""
from __future__ import annotations

import numpy as np
import pytest
from vlcurate.stages.mining import fff, hpm

from .naive import naive_fff, pairs


def as_dict(p: fff.Positives) -> dict:
    return {i: {int(j): (fff.CODES[c], float(s)) for j, c, s in zip(p.idx[i], p.code[i], p.score[i])
                if j >= 0} for i in range(len(p.idx))}


def assert_same(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for i in ref:
        assert got[i].keys() == ref[i].keys(), i
        for j, (rel, s) in ref[i].items():
            assert got[i][j][0] == rel and got[i][j][1] == pytest.approx(s, abs=1e-5), (i, j)


def tight(n, d, seed):
    """Tight clusters, so that the high FFF thresholds fire for some pairs and not others."""
    return pairs(n, d, seed, spread=0.25, n_clusters=12)


def test_unimodal_rule_equals_naive_loop():
    img, txt = tight(120, 6, seed=1)
    # dup above p3, or every S_tt > p3 pair would be a duplicate first (as with the defaults)
    rule = fff.Rule(p2=0.92, p3=0.99, dup=0.995)
    ref = naive_fff(img, txt, p2=0.92, p3=0.99, dup=0.995)
    got = fff.exact_positives(img, txt, rule, max_positives=200, block_size=29, query_block=17)
    assert_same(as_dict(got), ref)
    rels = {r for d in ref.values() for r, _ in d.values()}
    assert {"duplicate", "image", "text"} <= rels          # every unimodal relation occurs


def test_full_eq1_with_cross_modal_embedding_equals_naive_loop():
    img, txt = tight(100, 6, seed=2)
    rng = np.random.default_rng(3)
    ximg = hpm.normalize(img[:, :4] + 0.3 * rng.standard_normal((100, 4)))
    xtxt = hpm.normalize(img[:, :4] + 0.3 * rng.standard_normal((100, 4)))
    rule = fff.Rule(p1=0.9, p1_text=0.8, p2=0.97, p3=0.97, dup=0.995, cross=True)
    ref = naive_fff(img, txt, 0.9, 0.8, 0.97, 0.97, 0.995, ximg, xtxt)
    got = fff.exact_positives(img, txt, rule, 200, ximg=ximg, xtxt=xtxt, block_size=31,
                              query_block=13)
    assert_same(as_dict(got), ref)
    rels = {r for d in ref.values() for r, _ in d.values()}
    assert rels == {"duplicate", "image", "cross", "text"}
    # the text rule is gated by S_it > p1': some S_tt > p3 pairs are not positives
    gated = [(i, j) for i in range(100) for j in range(100) if i != j
             and txt[i] @ txt[j] > 0.97 and img[i] @ img[j] <= 0.97 and ximg[i] @ xtxt[j] <= 0.8
             and max(img[i] @ img[j], txt[i] @ txt[j]) <= 0.995]
    assert gated and all(j not in ref[i] for i, j in gated)


def test_duplicates_switch_and_self_exclusion():
    img, txt = tight(60, 6, seed=4)
    img[1], txt[1] = img[0], txt[0]                          # an exact copy of row 0
    with_dup = as_dict(fff.exact_positives(img, txt, fff.Rule(dup=0.98), 50))
    assert with_dup[0][1][0] == "duplicate" and 0 not in with_dup[0]
    without = as_dict(fff.exact_positives(img, txt, fff.Rule(dup=0.98, duplicates=False), 50))
    assert without[0][1][0] == "image"                       # still an FFF positive (S_ii = 1)


def test_max_positives_keeps_best_relation_then_score():
    img, txt = tight(80, 6, seed=5)
    full = fff.exact_positives(img, txt, fff.Rule(), 80)
    cut = fff.exact_positives(img, txt, fff.Rule(), 3, block_size=16)
    for i in range(80):
        js = [(c, -s, j) for j, c, s in zip(full.idx[i], full.code[i], full.score[i]) if j >= 0]
        want = [j for _, _, j in sorted(js)[:3]]
        assert [j for j in cut.idx[i] if j >= 0] == want


def test_fast_positives_with_exhaustive_search_equal_exact():
    img, txt = tight(300, 8, seed=6)
    rule = fff.Rule()
    ex = fff.exact_positives(img, txt, rule, 32)
    params = {k: hpm.auto_params(300, 8, nlist=4, m=8, nprobe=4) for k in ("image", "text")}
    fp = fff.FastPositives(fff.FastPositives.build(img, txt, params), img, txt)
    got = fp.query(np.arange(300), rule, 32, k_prime=300)
    assert_same(as_dict(got), as_dict(ex))
    assert sum(len(v) for v in as_dict(got).values()) > 100
