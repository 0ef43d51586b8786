"""The sibling rule (engine/siblings.py): other captions of a row's image support it in HELIP's
noise rule when their caption agrees, on constructed multi-caption data, against a float64
brute force; one caption per image leaves Alg. 1's decisions as they are."""
from __future__ import annotations

import numpy as np
import pytest
from vlcurate.stages.mining import hpm
from vlcurate.stages.mining.engine import siblings as S

TAU, DUP = 0.5, 0.98


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def multi_caption(groups: int = 6, per: int = 4, d: int = 16, seed: int = 0,
                  swap: tuple = (1, 9)):
    """``groups`` images (orthogonal image vectors) with ``per`` captions each, near the
    image's own caption topic; row swap[0] gets row swap[1]'s caption (another image's).
    (img, txt, group, labels)."""
    rng = np.random.default_rng(seed)
    basis = np.linalg.qr(rng.normal(size=(d, d)))[0].astype(np.float32)
    group = np.repeat(np.arange(groups), per)
    img = basis[group]
    txt = unit(basis[(group + 3) % d] + 0.1 * rng.normal(size=(len(group), d)))
    labels = np.zeros(len(group), bool)
    a, b = swap
    txt[a], labels[a] = txt[b], True
    return img, txt, group, labels


def brute(group, img, txt, tau_sib, dup=DUP, tau=TAU) -> np.ndarray:
    """Per row, in float64: siblings with S_tt > tau_sib that Alg. 1 does not count."""
    I, T = img.astype(np.float64), txt.astype(np.float64)
    dup = np.inf if dup is None else dup
    out = np.zeros(len(group), np.int64)
    for i in range(len(group)):
        for j in np.flatnonzero(group == group[i]):
            sii, stt = I[i] @ I[j], T[i] @ T[j]
            counted = tau < sii <= dup and tau < stt <= dup
            out[i] += j != i and stt > tau_sib and not counted
    return out


def decide(img, txt, group, k, tau_sib=TAU, dup=DUP):
    sup = hpm.exact_hpm(img, txt, k, TAU, TAU, dup).support
    sib = S.agreeing(group, img, txt, TAU, TAU, dup, tau_sib)
    return sup, sib, hpm.noise_pairs(sup, sib, k)


def test_agreeing_siblings_rescue_pairs_and_the_mismatch_is_flagged():
    img, txt, group, labels = multi_caption()
    sup, sib, noise = decide(img, txt, group, k=2)
    assert (sup == 0).all()                       # Alg. 1: siblings are duplicates (S_ii = 1)
    assert hpm.noise_pairs(sup, 0 * sib, 2).all()  # so HELIP's rule flags every row
    np.testing.assert_array_equal(sib, brute(group, img, txt, TAU))
    assert sib[1] == 0 and (sib[~labels] >= 2).all()
    np.testing.assert_array_equal(noise, labels)   # only the mismatch is left flagged


def test_a_disagreeing_sibling_does_not_rescue():
    """k = 3: a target with two supporters (another image like its own, an agreeing caption)
    is rescued by one agreeing sibling, not by one whose caption disagrees."""
    d = 8
    e = np.eye(d, dtype=np.float32)
    img = unit(np.stack([e[0], e[0], e[0] + 0.3 * e[1], e[0] + 0.3 * e[2], e[5]]))
    topic = unit(e[3] + 0.1 * e[4])
    txt = unit(np.stack([e[3], topic, e[3] + 0.3 * e[1], e[3] + 0.3 * e[2], e[6]]))
    group = np.array([0, 0, 1, 2, 3])          # rows 0 and 1: one image, two captions
    sup, sib, noise = decide(img, txt, group, k=3)
    assert sup[0] == 2 and sib[0] == 1 and not noise[0]
    txt[1] = e[7]                               # the sibling's caption now disagrees
    sup, sib, noise = decide(img, txt, group, k=3)
    assert sup[0] == 2 and sib[0] == 0 and noise[0]


def test_a_sibling_alg1_counts_is_not_counted_twice():
    img, txt, group, _ = multi_caption()
    sup, sib, _ = decide(img, txt, group, k=2, dup=None)   # no duplicate rule: S_ii = 1 counts
    assert (sup >= 2).any() and (sib == 0).all()
    np.testing.assert_array_equal(sib, brute(group, img, txt, TAU, dup=None))


def test_one_caption_per_image_is_alg1():
    rng = np.random.default_rng(8)
    topic = unit(rng.normal(size=(5, 12)))[rng.integers(0, 5, 200)]
    img = unit(topic + 0.3 * rng.normal(size=(200, 12)))
    txt = unit(topic + 0.3 * rng.normal(size=(200, 12)))
    _, sib, noise = decide(img, txt, np.arange(200), k=5)
    alg1 = hpm.exact_hpm(img, txt, 5, TAU, TAU, DUP).noise
    assert (sib == 0).all() and 0 < alg1.sum() < 200
    np.testing.assert_array_equal(noise, alg1)


@pytest.mark.parametrize("tau_sib", [0.2, 0.5, 0.8])
def test_counts_equal_the_brute_force_whatever_the_chunks_and_order(monkeypatch, tau_sib):
    rng = np.random.default_rng(3)
    n, d = 300, 12
    group = rng.integers(0, 70, n)               # groups of 0 to ~10 rows, unsorted
    img = unit(rng.normal(size=(70, d)))[group]
    txt = unit(0.25 * rng.normal(size=(n, d)) + unit(rng.normal(size=(70, d)))[group])
    want = brute(group, img, txt, tau_sib)
    got = S.agreeing(group, img, txt, TAU, TAU, DUP, tau_sib)
    np.testing.assert_array_equal(got, want)
    assert 0 < (got > 0).sum() < n
    monkeypatch.setattr(S, "CHUNK", 7)           # other chunks: the same counts
    np.testing.assert_array_equal(S.agreeing(group, img, txt, TAU, TAU, DUP, tau_sib), got)
    perm = rng.permutation(n)                    # rows in another order: the same per row
    np.testing.assert_array_equal(
        S.agreeing(group[perm], img[perm], txt[perm], TAU, TAU, DUP, tau_sib), got[perm])


def test_sibling_pairs_cover_every_ordered_pair_once():
    group = np.array([4, 1, 4, 2, 4, 1, 9])
    pairs = sorted(zip(*map(np.ndarray.tolist, next(S.sibling_pairs(group)))))
    assert pairs == sorted((a, b) for a in range(7) for b in range(7)
                           if a != b and group[a] == group[b])
    assert list(S.sibling_pairs(np.arange(5))) == []
