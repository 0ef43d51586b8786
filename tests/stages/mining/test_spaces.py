"""One-space layouts (stages/mining/engine/spaces.py): a partial joint pass plus them finds every pair
above a floor, with exact similarities, capped as the joint pass caps."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from vlcurate.stages.mining import engine as E
from vlcurate.stages.mining.engine import layout, passes, persist
from vlcurate.stages.mining.engine import spaces as S

from .naive import pairs
from .test_blocks import brute_pairs, compact_slack, cross_vectors, data, params

FLOORS = dict(floor_i=0.8, floor_t=0.85, floor_x=0.9, space_rows=20)   # 8 space clusters


def space_pass(img, txt, p, ximg=None, xtxt=None, device="cpu", rows=50) -> passes.PassResult:
    """The pass with its one-space layouts, every row mined, ``rows`` at a time."""
    lay = layout.build_layout(img, txt, p, device)
    vec = persist.sorted_vectors(lay, img, txt, ximg, xtxt, p.precision)
    sp = S.layouts(vec, p, device) if p.space_probe else []
    pos = lay.positions()
    order = np.argsort(lay.order[pos])
    r = passes.PassResult.concat([E.mine(lay, vec, pos[a:a + rows], p, device, sp)
                             for a in range(0, len(pos), rows)])
    assert (order == np.arange(len(pos))).all()     # results come in global row order
    return r


def found(r: passes.PassResult) -> set:
    return {(g, int(j)) for g in range(len(r.offsets) - 1)
            for j in r.pair_j[r.offsets[g]:r.offsets[g + 1]]}


@pytest.mark.parametrize("cross, precision", [(False, "fp32"), (True, "fp32"),
                                              (False, "bf16"), (True, "bf16"), (True, "int8")])
def test_one_space_layouts_find_every_pair_a_partial_joint_pass_misses(cross, precision, device):
    """bf16: the layouts (the joint one and each space's) and the routing by bf16 GEMMs, the
    joint blocks screened in bf16: the same pairs. int8: the joint blocks screened in int8,
    the rest as bf16's."""
    img, txt = data()
    ximg, xtxt = cross_vectors(img, 1) if cross else (None, None)
    p = params(5, 8, probe=1, precision=precision, **FLOORS)
    joint = found(space_pass(img, txt, p, ximg, xtxt, device))
    r = space_pass(img, txt, dataclasses.replace(p, space_probe=8), ximg, xtxt, device)
    got = found(r)
    # the spaces searched: HELIP's two, or with cross-modal vectors the cross-modal ones
    # (X_ii, X_tt and S_it); the joint pass adds HELIP's S_ii / S_tt pairs in its clusters
    every = brute_pairs(img, txt, 0.8, 0.85, ximg, xtxt, 0.9)
    want = (brute_pairs(np.zeros_like(img), np.zeros_like(txt), 0.8, 0.85, ximg, xtxt, 0.9)
            if cross else every)
    assert want <= got <= every and len(want) > 20
    assert len(r.pair_j) == len(got)                # no pair listed twice
    assert not want <= joint                        # the partial joint pass alone misses some
    assert joint <= got
    q = np.repeat(np.arange(len(img)), np.diff(r.offsets))
    for f, (a, b) in {"sii": (img, img), "stt": (txt, txt), "sit": (ximg, xtxt),
                      "xii": (ximg, ximg), "xtt": (xtxt, xtxt)}.items():
        want_f = np.full(len(q), np.nan) if a is None else (a[q] * b[r.pair_j]).sum(1)
        np.testing.assert_allclose(getattr(r, f"pair_{f}"), want_f, atol=1e-5)


@pytest.mark.parametrize("slack", [None, -10**6])
def test_one_space_pairs_are_capped_with_the_joint_ones_and_counted_once(slack, monkeypatch):
    """Capped as they arrive (slack -10**6: at every block) or once: the same pairs, each
    row's best by max similarity, and what the cap leaves out counted once per pair."""
    if slack is not None:
        compact_slack(monkeypatch, slack)
    img, txt = data()
    p = params(5, 8, probe=1, space_probe=8, **FLOORS)
    full = space_pass(img, txt, p, rows=8)
    capped = space_pass(img, txt, dataclasses.replace(p, max_pairs=2), rows=8)
    n = np.diff(full.offsets)
    every = brute_pairs(img, txt, 0.8, 0.85)
    np.testing.assert_array_equal(n, np.bincount([a for a, _ in every], minlength=len(img)))
    np.testing.assert_array_equal(np.diff(capped.offsets), np.minimum(n, 2))
    np.testing.assert_array_equal(capped.cut, n - np.minimum(n, 2))
    assert capped.cut.sum() > 0
    best = np.fmax(full.pair_sii, full.pair_stt)
    kept = np.fmax(capped.pair_sii, capped.pair_stt)
    for g in np.flatnonzero(n > 2):
        np.testing.assert_allclose(np.sort(kept[capped.offsets[g]:capped.offsets[g + 1]]),
                                   np.sort(best[full.offsets[g]:full.offsets[g + 1]])[-2:])


def test_a_space_is_laid_out_only_where_a_floor_can_fire():
    img, txt = data(n=40)
    lay = layout.build_layout(img, txt, params(5, 2))
    vec = persist.sorted_vectors(lay, img, txt)
    assert S.spaces_of(vec, params(5, 2, floor_i=0.9)) == ["img"]
    assert S.spaces_of(vec, params(5, 2, floor_i=0.9, floor_t=0.5)) == ["img", "txt"]
    ximg, xtxt = cross_vectors(img, 1)
    cvec = persist.sorted_vectors(lay, img, txt, ximg, xtxt)
    assert S.spaces_of(cvec, params(5, 2, floor_x=0.3)) == ["xtxt"]


def test_a_pair_at_a_floor_is_listed_once():
    """A GEMM and a gathered dot product differ in their last bits (here in 384 d): with the
    image floor set to a pair's gathered S_I, a search accepting by its GEMM and a later one
    testing the gathered value would list some pairs twice. Each search accepts by the
    gathered value, which later searches test."""
    img, txt = pairs(160, 384, seed=3, spread=0.8, n_clusters=6)
    st = txt @ txt.T
    for a, b in ((7, 12), (7, 17), (12, 20)):
        s_i = float((torch.from_numpy(img[a:a + 1]) * torch.from_numpy(img[b:b + 1])).sum())
        p = params(5, 8, probe=1, space_probe=8, floor_i=s_i, floor_t=float(st[a, b]) - 0.01,
                   space_rows=20)
        r = space_pass(img, txt, p)
        q = np.repeat(np.arange(len(img)), np.diff(r.offsets))
        assert len(set(zip(q.tolist(), r.pair_j.tolist()))) == len(q) > 0


def test_int8_one_space_copies_written_by_build_are_the_ones_load_gives_the_search(
        tmp_path, monkeypatch):
    """hpm.engine.precision int8, the seam from the global step to the workers: spaces.build writes
    each space's int8 copy with its clusters' scales and bounds, spaces.load hands it to the
    search (no block is quantized on the fly: q8.block is never called), and the pairs equal
    those of the in-memory layouts."""
    from vlcurate.stages.mining.int8 import q8
    img, txt = data()
    ximg, xtxt = cross_vectors(img, 1)
    p = params(5, 8, probe=1, precision="int8", space_probe=8, **FLOORS)
    lay = layout.build_layout(img, txt, p)
    vec = persist.sorted_vectors(lay, img, txt, ximg, xtxt, p.precision)
    S.build(str(tmp_path), vec, p, "cpu")
    loaded, memory = S.load(str(tmp_path), len(img)), S.layouts(vec, p)
    assert [s.name for s in loaded] == [s.name for s in memory] == ["ximg", "xtxt"]
    for a, b in zip(loaded, memory):
        assert isinstance(a.low, q8.Copy)
        np.testing.assert_array_equal(np.asarray(a.low.values), b.low.values)
        np.testing.assert_array_equal(a.low.stats, b.low.stats)
    monkeypatch.setattr(q8, "block", lambda *a: pytest.fail("a block quantized on the fly"))
    pos = lay.positions()
    got, want = (E.mine(lay, vec, pos, p, spaces=sp) for sp in (loaded, memory))
    assert len(got.pair_j) > 20
    for f in ("offsets", "pair_j", "pair_sit", "pair_xii", "pair_xtt"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
