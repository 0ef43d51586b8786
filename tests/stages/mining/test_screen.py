"""hpm.engine.precision bf16 (stages/mining/engine/screen.py) and int8 (int8/q8.py): a low-precision screen
with a proven margin, then an fp32 re-score, finds exactly the pairs fp32 finds, with fp32's
similarities."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from vlcurate.stages.mining import engine as E
from vlcurate.stages.mining import hpm
from vlcurate.stages.mining.engine import core, layout, passes, persist, precision, screen
from vlcurate.stages.mining.engine.precision import Bf16
from vlcurate.stages.mining.int8 import q8

from .naive import naive_hpm, pairs
from .test_blocks import cross_vectors
from .test_hpm import assert_matches_naive


def test_the_margin_bounds_bf16_similarities_of_unit_vectors(device):
    """On the GPU too: cuBLAS's bf16 GEMM (with reduced-precision reductions off, as
    screen.low sets them) stays inside the same bound."""
    g = torch.Generator().manual_seed(0)
    for d in (8, 384, 768):
        a = torch.nn.functional.normalize(torch.randn(300, d, generator=g), dim=1)
        b = torch.nn.functional.normalize(torch.randn(500, d, generator=g), dim=1)
        b[:50] = a[:50] + 0.01 * b[:50]             # near 1, where bf16 rounds the coarsest
        a, b = a.to(device), torch.nn.functional.normalize(b, dim=1).to(device)
        low = precision.low({"img": a, "txt": b}, "bf16")
        err = ((low["img"] @ low["txt"].T).float() - a @ b.T).abs().max().item()
        assert 0 < err <= precision.margin("bf16", d), (d, err)
    assert precision.margin("fp32", 768) == 0.0


def near_thresholds(n=240, seed=7):
    """Vectors whose similarities crowd every threshold below: many pairs within bf16's error of
    tau, the floors and dup."""
    img, txt = pairs(n, 6, seed=seed, spread=0.9, n_clusters=3)
    img[5], txt[5] = img[2], txt[2]                               # a duplicate
    return img, txt, *cross_vectors(img, seed)


def params(precision):
    return core.PassParams(k=7, tau_i=0.3, tau_t=0.05, dup=0.98, floor_i=0.8, floor_t=0.85,
                        floor_x=0.6, n_clusters=3, probe=3, query_block=41, block_size=53,
                        precision=precision)


def run(precision, img, txt, ximg, xtxt, device="cpu"):
    return E.neighbour_pass(img, txt, params(precision), ximg, xtxt, device=device)[1]


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_blocks_cast_on_the_fly_equal_the_stored_low_copies(precision, monkeypatch, device):
    """Without stored low copies (Vectors.low) each block is cast as it is read (int8: with
    the block's own scale, not its cluster's): the same result, bit for bit."""
    img, txt, ximg, xtxt = near_thresholds()
    monkeypatch.setattr(screen, "DENSE_SHARE", 1.0)
    lay, stored = E.neighbour_pass(img, txt, params(precision), ximg, xtxt, device, rows=240)
    vec = persist.sorted_vectors(lay, img, txt, ximg, xtxt)
    assert vec.low is None
    cast = E.mine(lay, vec, lay.positions(), params(precision), device)
    for f in dataclasses.fields(passes.PassResult):
        np.testing.assert_array_equal(getattr(cast, f.name), getattr(stored, f.name), f.name)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("cross", [False, True])
def test_low_precision_finds_what_fp32_finds(cross, precision, monkeypatch, device):
    """Every block screened in bf16 or int8 (DENSE_SHARE 1: this data is dense), as sparse
    data is. On a GPU the reference is still the CPU's fp32 pass."""
    img, txt, ximg, xtxt = near_thresholds()
    x = (ximg, xtxt) if cross else (None, None)
    want = run("fp32", img, txt, *x)
    monkeypatch.setattr(screen, "DENSE_SHARE", 1.0)
    got = run(precision, img, txt, *x, device)
    monkeypatch.setattr(Bf16, "margin", lambda self, dim: 0.0)
    monkeypatch.setattr(q8, "bound", lambda *a: 0.0)
    assert (run(precision, img, txt, *x, device).support != want.support).any()   # it matters
    for f in ("idx", "support", "certified", "cut", "offsets", "pair_j"):
        np.testing.assert_array_equal(getattr(got, f), getattr(want, f), f)
    for f in ("score", "pair_sii", "pair_stt", "pair_sit", "pair_xii", "pair_xtt"):
        np.testing.assert_allclose(getattr(got, f), getattr(want, f), atol=1e-6, err_msg=f)
    assert len(want.pair_j) > 100 and (want.support > 0).mean() > 0.5
    assert_matches_naive(hpm.TopK(got.idx, got.score, got.support, got.certified),
                         naive_hpm(img, txt, 7, 0.3, 0.05, 0.98), 7)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_dense_block_is_computed_in_fp32(precision, monkeypatch, device):
    """Over DENSE_SHARE of a block's pairs passing the screen: that block in fp32, the same
    result bit for bit (as fp32 on the same device)."""
    img, txt, ximg, xtxt = near_thresholds()
    want = run("fp32", img, txt, ximg, xtxt, device)
    calls = []
    rescore = screen.rescore
    monkeypatch.setattr(screen, "rescore", lambda *a: calls.append(1) or rescore(*a))
    monkeypatch.setattr(screen, "DENSE_SHARE", 0.0)
    got = run(precision, img, txt, ximg, xtxt, device)
    assert not calls
    for f in dataclasses.fields(passes.PassResult):
        np.testing.assert_array_equal(getattr(got, f.name), getattr(want, f.name), f.name)


def whole_block_rule(s, floors, tau_i, tau_t, eps, own_r, own_c):
    """The candidate rule evaluated on every pair of the block (the reference)."""
    keep = (s["sii"] > tau_i - eps) & (s["stt"] > tau_t - eps)
    for name, floor in floors.items():
        if name in s:
            keep |= s[name] > floor - eps
    keep[own_r, own_c] = False
    return keep.nonzero(as_tuple=True)


@pytest.mark.parametrize("eps", [0.0, 0.03])
@pytest.mark.parametrize("cross", [False, True])
def test_the_pre_screened_candidates_equal_the_rule_over_the_whole_block(cross, eps, device):
    """flat_candidates runs the rule over the block with its thresholds a hair low (GUARD),
    then exactly on the pairs listed: the same pairs, in the same (row-major) order, as the
    rule over every pair, with thresholds that differ per similarity, values placed exactly
    on them, and the targets left out."""
    g = torch.Generator().manual_seed(3)
    names = ("sii", "stt", "sit", "xii", "xtt") if cross else ("sii", "stt")
    s = {n: torch.rand(37, 61, generator=g) * 2 - 1 for n in names}
    floors = {"sii": 0.8, "stt": 0.85, "sit": 0.2, "xii": 0.8, "xtt": 0.85}
    tau_i, tau_t = 0.3, -0.1
    s["sii"][0, :5] = torch.tensor([0.3, 0.8, 0.8 - eps, 0.3 - eps, 0.9])    # on the thresholds
    s["stt"][0, :5] = torch.tensor([0.5, -0.1, 0.0, -0.1 - eps, 0.86])
    s = {n: x.to(device) for n, x in s.items()}
    own_r = torch.tensor([0, 4, 9], device=device)
    own_c = torch.tensor([4, 0, 60], device=device)
    flat = screen.flat_candidates(s, floors, tau_i, tau_t, eps, own_r * 61 + own_c)
    want_r, want_c = whole_block_rule(s, floors, tau_i, tau_t, eps, own_r, own_c)
    assert 0 < len(want_r) < s["sii"].numel()
    assert torch.equal(flat, want_r * 61 + want_c)
    assert not (flat == 4).any()                    # a target is never its own candidate


def test_a_bf16_block_compared_on_its_bits_equals_the_float_comparison(device):
    """_greater reads a bf16 block's int16 bits against the largest bf16 at or below t: the
    same answer as comparing the values, for thresholds on and between bf16 values, values
    of both signs, zeros, infinities and NaN, and on a strided view (a padded GEMM's result)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.rand(64, 300, generator=g) * 2.2 - 1.1).to(torch.bfloat16)
    on = [0.5, 0.4765625, 1.0, 2.0 ** -130]                 # bf16 values (one subnormal)
    x[0, :8] = torch.tensor(on + [-0.0, 0.0, math.inf, math.nan]).to(torch.bfloat16)
    x[1, :4] = torch.tensor([-math.inf, -0.5, 0.5 + 2 ** -8, 0.5 - 2 ** -9]).to(torch.bfloat16)
    view = x.to(device)[:, :257]
    for t in on + [0.5 + 1e-7, 0.4878, 0.49999, 0.99, 1e-30, 0.0, -0.3, -1e-7]:
        got = screen._greater(view, t)
        got = got if isinstance(got, np.ndarray) else got.cpu().numpy()    # a GPU's: a tensor
        want = view.float().cpu().numpy() > t
        np.testing.assert_array_equal(got, want, err_msg=str(t))
        assert want.any() and not want.all()


def pairs_at_a_floor(device):
    """240 queries, 37 of them (rows) each with members just above the floor 0.801 (bf16's
    0.80078 is just below it): (x, rows, members, floor, the pairs above it in fp32)."""
    g = torch.Generator().manual_seed(3)
    x = torch.nn.functional.normalize(torch.randn(240, 384, generator=g), dim=1)
    rows, floor = np.arange(3, 240, 6)[:37], 0.801    # just above bf16's 0.80078
    q = x[torch.as_tensor(rows)]
    s_ = floor + 0.002 * torch.rand(53, generator=g)   # above the floor, below the next midpoint
    u = torch.randn(53, 384, generator=g)
    u -= (u * q[np.arange(53) % 37]).sum(1, keepdim=True) * q[np.arange(53) % 37]
    m = s_[:, None] * q[np.arange(53) % 37] + (1 - s_[:, None] ** 2).sqrt() * \
        torch.nn.functional.normalize(u, dim=1)
    x, m = x.to(device), m.to(device)
    want = set(zip(*np.nonzero((x[torch.as_tensor(rows, device=device)] @ m.T).cpu().numpy()
                               > floor)))
    return x, rows, m, floor, want


def test_one_space_hits_in_bf16_hold_every_pair_above_the_floor(device):
    """screen.hits (spaces.py's blocks): in bf16, at the floor lowered by the margin, a superset
    of the pairs whose fp32 dot product is above the floor, here all within bf16's rounding of
    it (without the margin, most are missed); in fp32, exactly the GEMM's pairs. Shapes off
    HIT_STEP's multiples (37 of 240 queries, 53 members): the padding is cut off."""
    x, rows, m, floor, want = pairs_at_a_floor(device)
    low = precision.low({"x": x}, "bf16")["x"]
    eps = precision.margin("bf16", 384)
    r, c = screen.hits(low, rows, m.to(low.dtype), floor - eps)
    assert len(want) > 15 and want <= set(zip(r, c)) and r.max() < 37 and c.max() < 53
    assert not want <= set(zip(*screen.hits(low, rows, m.to(low.dtype), floor)))
    assert set(zip(*screen.hits(x, rows, m, floor))) == want


def test_the_int8_bound_holds_for_every_pair_and_its_thresholds_keep_every_pair_above(device):
    """q8.py: queries with their own scales, members with their cluster's (here a cluster
    whose rows' largest coordinates differ 4x, and a zero row): |<q~, m~> - fp32 <q, m>| stays
    within q8.bound for every pair, near-duplicates (~1) included, and the int32 thresholds
    keep every pair whose fp32 similarity is above t, for t placed just below, on and just
    above pairs' similarities."""
    g = torch.Generator().manual_seed(0)
    for d in (8, 384, 768):
        a = torch.nn.functional.normalize(torch.randn(60, d, generator=g), dim=1)
        b = torch.randn(90, d, generator=g)
        b[:30] = a[:30] + 0.01 * b[:30]                        # near-duplicates
        b[30:40, 0] += 40.0                                    # rows dominated by one coordinate
        b = torch.nn.functional.normalize(b, dim=1)
        b[40] = 0.0
        cluster = np.repeat([0, 1, 2], 30)
        values, stats = q8.cluster_copy(b.numpy(), cluster, 3)
        copy, q = q8.Copy(values, stats), q8.rows(a.to(device))
        exact = (a[:, None, :] * b[None, :, :]).sum(2)         # the re-score's products and sum
        for c in range(3):
            m = copy.block(slice(30 * c, 30 * c + 30), c, device)
            dots = torch.as_tensor(np.asarray(q8.products(q, m)), device="cpu").double()
            screened = dots * torch.from_numpy(q.scale)[:, None] * float(m.scale[0])
            err = (screened - exact[:, 30 * c:30 * c + 30].double()).abs().max(1).values
            limit = q8.bound(q.err, q.norm, m.err[0], m.norm[0], d)
            assert (err.numpy() <= limit).all() and limit.max() < (0.2 if c == 1 else 0.03)
            ts = np.sort(exact[:, 30 * c:30 * c + 30].numpy().ravel())[::97]
            for t in np.r_[ts, np.nextafter(ts, -1), np.nextafter(ts, 2)]:
                (lim,) = q8.thresholds(q, [(0, 60)], np.array([np.concatenate(m.stats())]), [t])
                above = exact[:, 30 * c:30 * c + 30].numpy() > t
                assert (np.asarray(dots)[above] > np.broadcast_to(lim, above.shape)[above]).all()
    assert stats[1, 0] > 3 * stats[0, 0]          # the dominated cluster's scale is its own


def test_int8_copies_written_in_chunks_equal_the_copy_in_memory(tmp_path):
    """save_vectors writes whole clusters at a time (chunks smaller than a cluster, or cut
    inside one, move to a cluster's start): the int8 values and each cluster's scale and
    bounds equal the in-memory copy's, and load_vectors reads them back as a q8.Copy."""
    img, txt, ximg, xtxt = near_thresholds()
    p = params("int8")
    lay = layout.build_layout(img, txt, p)
    want = persist.sorted_vectors(lay, img, txt, precision="int8").low
    for chunk in (7, 100, 1000):
        out = tmp_path / str(chunk)
        persist.save_vectors(str(out), lay, {"img": img, "txt": txt}, "int8", chunk=chunk)
        got = persist.load_vectors(str(out), len(img)).low
        for name in ("img", "txt"):
            assert isinstance(got[name], q8.Copy)
            np.testing.assert_array_equal(np.asarray(got[name].values), want[name].values)
            np.testing.assert_array_equal(got[name].stats, want[name].stats)
    assert (want["img"].stats[:, 0] > 0).all() and len(np.unique(want["img"].stats[:, 0])) == 3


@pytest.mark.parametrize("grouped", [False, True])
def test_int8_quantization_a_few_rows_at_a_time_equals_all_at_once(grouped, monkeypatch):
    """q8.quantize's float64 work core.CACHE_ELEMS values at a time (rows cut across groups, a zero
    row among them): the same values, scales, errs and norms as all rows at once."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(301, 24, generator=g)
    x[5] = 0
    group = torch.randint(0, 9, (301,), generator=g) if grouped else None
    args = (x, group, 9) if grouped else (x,)
    whole = q8.quantize(*args)
    monkeypatch.setattr(core, "CACHE_ELEMS", 24 * 7)
    for got, want in zip(q8.quantize(*args), whole):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert whole[2][5] == 0 and (grouped or whole[1][5] == 1.0)     # the zero row: exact
    x[6] = -0.0
    x[7, 3] = math.nan
    got, want = q8.abs_max(x), x.abs().amax(1)
    assert torch.equal(got[8:], want[8:]) and torch.equal(got[:7], want[:7])
    assert not got[6].signbit() and got[7].isnan() and want[7].isnan()


def test_one_space_hits_in_int8_hold_every_pair_above_the_floor(monkeypatch, device):
    """q8.hits (spaces.py's blocks under hpm.engine.precision int8): each query against its proven
    threshold, the members' cluster copy: a superset of the pairs above the floor in fp32;
    without the bound, some are missed."""
    x, rows, m, floor, want = pairs_at_a_floor(device)
    copy = q8.Copy(*q8.cluster_copy(m.cpu().numpy(), np.zeros(len(m), np.int64), 1))
    q, members = q8.rows(x), copy.block(slice(0, len(m)), 0, device)
    r, c = q8.hits(q, rows, members, floor)
    assert len(want) > 15 and want <= set(zip(r, c)) and r.max() < 37 and c.max() < 53
    monkeypatch.setattr(q8, "bound", lambda *a: 0.0)
    assert not want <= set(zip(*q8.hits(q, rows, members, floor)))


@pytest.mark.parametrize("cross", [False, True])
def test_a_stacks_pairs_rescored_at_once_equal_those_rescored_block_by_block(cross, device):
    """rescore_flat with ``members`` (run_stack: every block's members are rows of the sorted
    vectors, gathered for all the stack's pairs at once) gives the same bits as each block
    alone from its own members (on a CPU; CUDA's row sums may group by the rows summed at
    once), and each value is the pair's dot product (float64 within 1e-6)."""
    g = torch.Generator().manual_seed(5)
    names = ("img", "txt", "ximg", "xtxt") if cross else ("img", "txt")
    base = {x: torch.nn.functional.normalize(torch.randn(300, 24, generator=g), dim=1)
            for x in names}
    chunk = {x: torch.nn.functional.normalize(torch.randn(50, 24, generator=g), dim=1)
             for x in names}
    q = screen.QueryRows({x: v.to(device) for x, v in chunk.items()},
                         torch.randperm(50, generator=g)[:40].to(device))
    first, size, qcut = [0, 40, 120, 260], [40, 80, 17, 40], [0, 10, 25, 26, 40]
    blocks = [(qcut[u], qcut[u + 1], {x: base[x][first[u]:first[u] + size[u]].to(device)
                                      for x in names}, None) for u in range(4)]
    total = int(screen.offsets(blocks)[-1])
    flat = torch.sort(torch.randperm(total, generator=g)[:200]).values.to(device)
    r, c, at_once = screen.rescore_flat(q, blocks, flat, ({x: v.to(device) for x, v in
                                                           base.items()}, np.array(first)))
    at = screen.offsets(blocks)
    alone = [screen.rescore_flat(q, [blk], flat[(flat >= at[u]) & (flat < at[u + 1])] - at[u])[2]
             for u, blk in enumerate(blocks)]
    by_block = {s: torch.cat([x[s] for x in alone]) for s in alone[0]}
    with pytest.raises(ValueError, match="members"):
        screen.rescore_flat(q, blocks, flat)
    assert set(at_once) == set(by_block) == {s for s, a, _ in screen.PAIRS if a in names}
    assert all(torch.equal(x, y) for x, y in zip((r, c), screen.pair_rows(blocks, flat, first)))
    for s, a, b in screen.PAIRS:
        if a in names:
            if device == "cpu":
                assert torch.equal(at_once[s], by_block[s]), s
            want = (chunk[a][q.index.cpu()[r.cpu()]].double() * base[b][c.cpu()].double()).sum(1)
            np.testing.assert_allclose(at_once[s].cpu().double(), want, atol=1e-6)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_mining_no_rows_gives_an_empty_result(precision, device):
    """A call with no rows (a batch whose rows all lack embeddings): empty results, no error
    (int8's routing and queries quantize zero rows; on CUDA its pieces are never of 0 rows)."""
    img, txt, ximg, xtxt = near_thresholds()
    p = params(precision)
    lay = layout.build_layout(img, txt, p, device)
    vec = persist.sorted_vectors(lay, img, txt, ximg, xtxt, precision)
    r = E.mine(lay, vec, np.zeros(0, np.int64), p, device)
    assert r.idx.shape == (0, p.k) and len(r.pair_j) == 0 and r.offsets.tolist() == [0]
