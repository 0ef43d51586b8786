"""stages/mining/native.py and int8/kernels.py: the C kernels (native.c, int8/screen_int8.c)
give the same bits as their torch and NumPy paths, and a pass with them writes the same bytes
as a pass without them."""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import numpy as np
import pytest
import torch
from vlcurate.stages.mining import hpm, native
from vlcurate.stages.mining.engine import core, passes, screen, topk, units
from vlcurate.stages.mining.engine.pairs import _pairs as pairs_of
from vlcurate.stages.mining.int8 import kernels, q8
from vlcurate.stages.mining.int8 import routing as i8routing

from .naive import pairs
from .test_blocks import cross_vectors
from .test_spaces import FLOORS, space_pass

built = pytest.mark.skipif(native.library() is None, reason="no C compiler here (the torch "
                                                           "path is what every other test runs)")


@pytest.fixture
def no_native(monkeypatch):
    """native.library() turned off (VLCURATE_NATIVE=0) until the test ends."""
    monkeypatch.setenv("VLCURATE_NATIVE", "0")
    _clear()
    yield
    _clear()


def _clear() -> None:
    """The C libraries (native.c's, the int8 package's) built or loaded again when next used."""
    native.library.cache_clear()
    kernels.library.cache_clear()
    kernels.count_library.cache_clear()


def _bits(x: torch.Tensor) -> bytes:
    return x.contiguous().view(torch.int32).numpy().tobytes()


@built
@pytest.mark.parametrize("d", [1, 7, 16, 17, 40, 384])
def test_c_dot_products_equal_the_torch_lanes_bit_for_bit(d, tmp_path):
    """Rows read in place (an array, a memmap) or gathered (a strided view: the torch path),
    repeated rows, the tail of d mod 16 dimensions: the same bits; and they are dot products
    (float64 reference)."""
    rng = np.random.default_rng(d)
    a = torch.from_numpy(rng.standard_normal((300, d)).astype(np.float32))
    mm = np.lib.format.open_memmap(tmp_path / "b.npy", "w+", np.float32, (500, d))
    mm[:] = rng.standard_normal((500, d)) * 10.0 ** rng.integers(-3, 3, (500, 1))
    b = core._whole(np.load(tmp_path / "b.npy", mmap_mode="r"))
    ia = torch.from_numpy(rng.integers(0, 300, 9000))
    ib = torch.from_numpy(rng.integers(0, 500, 9000))
    got = native.pair_dots(a, ia, b, ib, "cpu")
    lanes = torch.cat([native._lane_dots(a[ia[i:i + 999]], b[ib[i:i + 999]])
                       for i in range(0, 9000, 999)])
    assert _bits(got) == _bits(lanes)
    wide = torch.stack([a, a], 2)[:, :, 0]              # a, strided: torch's path
    assert _bits(native.pair_dots(wide, ia, b, ib, "cpu")) == _bits(got)
    exact = (a.double()[ia] * b.double()[ib]).sum(1)
    scale = (a.double()[ia].abs() * b.double()[ib].abs()).sum(1)
    assert ((got.double() - exact).abs() <= 1e-6 * scale + 1e-30).all()
    assert len(native.pair_dots(a, ia[:0], b, ib[:0], "cpu")) == 0


@built
def test_the_c_screen_lists_what_the_rule_s_masks_list():
    """Exact integer compares: every (floor, tau) of img and txt, an extra mask, thresholds at
    int32's ends, empty and one-column blocks."""
    rng = np.random.default_rng(0)
    for nq, nm in ((57, 300), (3, 7), (1, 1), (0, 5), (4, 0)):
        sums = {s: rng.integers(-999, 999, (nq, nm)).astype(np.int32) for s in ("sii", "stt")}
        limits = {s: [rng.integers(-999, 999, (nq, 1)).astype(np.int32) + o for o in (800, 200)]
                  for s in sums}
        if nq > 2:
            limits["sii"][0][1], limits["stt"][1][2] = q8.INT32
        for extra in (None, rng.random((nq, nm)) < 0.02):
            want = np.flatnonzero(q8.rule(sums, limits) | (False if extra is None else extra))
            got = kernels.screen_pairs(sums["sii"], sums["stt"], limits["sii"], limits["stt"],
                                      extra, 1234)
            assert np.array_equal(got, want + 1234)
            assert nq * nm == 0 or len(want) > 0



@pytest.mark.skipif(not kernels.vnni(), reason="no AVX512-VNNI (or no C compiler) here: the "
                                              "int8 blocks take torch's GEMMs")
@pytest.mark.parametrize("nq, nm, di, dt", [(57, 300, 384, 384), (8, 16, 4, 8), (9, 33, 40, 72),
                                            (1, 1, 384, 768), (0, 5, 8, 8), (4, 0, 8, 8),
                                            (130, 47, 64, 128), (16, 17, 128, 64)])
@pytest.mark.parametrize("amx", [True, False])
def test_the_fused_int8_screen_lists_what_torch_s_gemms_and_the_rule_list(nq, nm, di, dt, amx,
                                                                         monkeypatch):
    """native.screen_int8 (VNNI GEMMs and the rule in one pass) against torch's int32 sums
    and q8.rule (and, with one similarity, S_ii above its floor): values at int8's ends
    (-127, 127, and -128, which q8 never writes), tiles' row tails (the last 8 rows again)
    and panel tails, thresholds at int32's ends and near the sums, both similarities'
    clauses; the rows read where they lie (a slice of a larger array, as a stack's); with AMX
    tiles where they run (dimensions multiples of 64) and with VNNI."""
    if amx and not kernels.amx():
        pytest.skip("no AMX here")
    monkeypatch.setattr(kernels, "USE_AMX", amx)
    rng = np.random.default_rng(nq + nm)
    big = [torch.from_numpy(rng.integers(-128, 128, (n + 3, d), dtype=np.int8))
           for n, d in ((nq, di), (nm, di), (nq, dt), (nm, dt))]
    qi, mi, qt, mt = (x[2:2 + n] for x, n in zip(big, (nq, nm, nq, nm)))
    sums = {"sii": torch._int_mm(qi, mi.T).numpy() if nq * nm else np.zeros((nq, nm), np.int32),
            "stt": torch._int_mm(qt, mt.T).numpy() if nq * nm else np.zeros((nq, nm), np.int32)}
    mid = {s: (np.median(v, 1, keepdims=True) if nm else np.zeros((nq, 1))).astype(np.int64)
           for s, v in sums.items()}
    limits = {s: [(mid[s] + o).astype(np.int32) for o in (90 * di, -10 * di)] for s in sums}
    if nq > 3:
        limits["sii"][0][1], limits["stt"][1][2] = q8.INT32
        limits["sii"][1][3], limits["stt"][0][3] = q8.INT32[::-1]
    want = np.flatnonzero(q8.rule(sums, limits)) + 77
    got = kernels.screen_int8(qi, mi, qt, mt, limits["sii"], limits["stt"], 77)
    assert np.array_equal(got, want)
    assert nq * nm < 2 or 0 < len(want) < nq * nm
    assert kernels.screen_int8(qi[:, :3], mi[:, :3], qt, mt, limits["sii"], limits["stt"],
                              0) is None                    # 3 dimensions: torch's GEMMs
    one = kernels.screen_int8(qi, mi, None, None, limits["sii"][:1], None, 5)   # q8.hits'
    assert np.array_equal(one, np.flatnonzero(sums["sii"] > limits["sii"][0]) + 5)

def _pass(precision, cross):
    """Every row mined with the one-space layouts, 40 dimensions (two 16-lane blocks and a
    tail), similarities crowding the thresholds, every screened block re-scored."""
    img, txt = pairs(240, 40, seed=5, spread=0.9, n_clusters=4)
    ximg, xtxt = cross_vectors(img, 2) if cross else (None, None)
    p = core.PassParams(k=7, tau_i=0.3, tau_t=0.1, dup=0.98, n_clusters=4, probe=2,
                     query_block=41, block_size=53, precision=precision, space_probe=8,
                     **dict(FLOORS, floor_i=0.5, floor_t=0.5, floor_x=0.6))
    return space_pass(img, txt, p, ximg, xtxt)


class _Counted:
    """native.library() standing in for itself: its functions counted by name as called."""

    def __init__(self, lib, calls: dict) -> None:
        self.lib, self.calls = lib, calls

    def __call__(self):
        return self

    def cache_clear(self) -> None:
        pass

    def __getattr__(self, name: str):
        fn = getattr(self.lib, name)

        def counted(*a):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*a)
        return counted


@built
@pytest.mark.parametrize("precision, cross", [("int8", False), ("int8", True),
                                               ("bf16", True), ("fp32", True)])
def test_a_pass_with_the_c_kernels_writes_what_one_without_writes(precision, cross,
                                                                   monkeypatch):
    monkeypatch.setattr(screen, "DENSE_SHARE", 1.0)
    calls: dict = {}
    monkeypatch.setattr(native, "library", _Counted(native.library(), calls))
    monkeypatch.setattr(kernels, "library", _Counted(kernels.library(), calls))
    with_c = _pass(precision, cross)
    # the C loops did run: re-score (not fp32's joint blocks) and one-space similarities,
    # the int8 screen, routing
    # routing's selection: int8's (joint and one-space) from its integer sums, else top_columns
    assert calls.get("pair_dots") and calls.get(
        "route_columns" if precision == "int8" else "top_columns"), calls
    assert bool(calls.get("route_columns")) == (precision == "int8"), calls
    assert calls.get("row_best") and calls.get("stable_order"), calls   # gather, the units
    assert calls.get("block_findings") and calls.get("add_rows"), calls  # units, the layout
    # int8 GEMMs with their screen in C (VNNI): the joint blocks' without cross-modal vectors,
    # the one-space blocks' always; else torch's GEMMs, then the C screen
    vnni = precision == "int8" and kernels.vnni()
    assert bool(calls.get("screen_int8")) == vnni, calls
    assert bool(calls.get("screen_pairs")) == (precision == "int8" and (cross or not vnni)), calls
    assert_same_without_c(with_c, lambda: _pass(precision, cross), 1.0, monkeypatch)


def assert_same_without_c(with_c, run, share: float, monkeypatch) -> None:
    """``run()`` again with no C library (``VLCURATE_NATIVE=0``), the dense share ``share``:
    every PassResult field the same bytes as ``with_c``'s."""
    monkeypatch.undo()
    monkeypatch.setattr(screen, "DENSE_SHARE", share)
    monkeypatch.setenv("VLCURATE_NATIVE", "0")
    _clear()
    try:
        assert native.library() is None and kernels.library() is None
        without = run()
    finally:
        monkeypatch.delenv("VLCURATE_NATIVE")
        _clear()
    assert len(with_c.pair_j) > 50 and with_c.support.sum() > 100
    for f in dataclasses.fields(passes.PassResult):
        x, y = getattr(with_c, f.name), getattr(without, f.name)
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), f.name


def test_a_failed_build_warns_once_and_the_pass_runs_without_it(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("VLCURATE_NATIVE_DIR", str(tmp_path))
    _clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native.__name__):
            assert native.library() is None and native.library() is None
            r = _pass("int8", False)
        for source in ("native.c", "screen_int8.c"):      # each library: one warning
            assert sum("native mining kernels unavailable" in m and source in m
                       for m in caplog.messages) == 1, caplog.messages
        assert len(r.pair_j) > 50
        assert not list(tmp_path.glob("*.so"))            # nothing half-written left behind
    finally:
        _clear()


@built
def test_the_build_is_cached_by_its_source_and_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("VLCURATE_NATIVE_DIR", str(tmp_path))
    native.library.cache_clear()
    try:
        assert native.library() is not None
        (so,) = tmp_path.glob("mining-native-*.so")
        stamp = so.stat().st_mtime_ns
        native.library.cache_clear()
        assert native.library() is not None and so.stat().st_mtime_ns == stamp
    finally:
        native.library.cache_clear()


def test_without_the_library_the_dot_products_are_torch_s_lanes(no_native):
    a = torch.randn(20, 33)
    i = torch.arange(20)
    got = native.pair_dots(a, i, a, i.flip(0), "cpu")
    assert native.library() is None
    assert _bits(got) == _bits(native._lane_dots(a.clone(), a.flip(0)))


@built
@pytest.mark.parametrize("c, levels", [(37, 6), (700, 40), (700, 10 ** 6), (4001, 10 ** 6)])
def test_the_c_top_columns_equal_torch_s_with_ties_and_infinities(c, levels):
    """Routing's selection: ties straddling the k-th place (the lower clusters win), -inf
    (empty clusters) and +inf (a query's own), k = 1 to c; and the bound over the rest. Past
    16 x k columns the C code bounds the k-th value from groups' maxima first."""
    rng = np.random.default_rng(c + levels)
    m = torch.from_numpy(rng.integers(0, levels, (300, c)).astype(np.float32) / levels)
    m[:, 5] = -np.inf
    m[np.arange(300), rng.integers(0, c, 300)] = np.inf
    m[:3] = m[3]                                                  # whole rows alike
    m[7, 3:] = -np.inf                     # fewer finite scores than k: -inf ties at the k-th
    reach = torch.from_numpy(rng.random(c).astype(np.float32))
    for k in sorted({1, 3, 10, 43, 60, c - 1, c} & set(range(1, c + 1))):
        got = native.top_columns(m, k, reach)
        native.library.cache_clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("VLCURATE_NATIVE", "0")
            want = native.top_columns(m, k, reach)
            native.library.cache_clear()
        assert np.array_equal(got[0], want[0]) and got[1].tobytes() == want[1].tobytes()
        assert (np.diff(got[0], axis=1) > 0).all()
        kth = np.sort(m.numpy(), 1)[:, -k]
        picked = np.take_along_axis(m.numpy(), got[0], 1)
        assert (picked >= kth[:, None]).all()
    assert native.top_columns(m, 4)[1] is None


@built
def test_the_c_kernels_refuse_indices_and_shapes_they_would_read_past():
    a = torch.randn(10, 8)
    i = torch.arange(10)
    for bad in (torch.tensor([10]), torch.tensor([-1])):
        with pytest.raises(IndexError):
            native.pair_dots(a, bad, a, torch.tensor([0]), "cpu")
    with pytest.raises(ValueError):
        native.pair_dots(a, i, torch.randn(10, 9), i, "cpu")
    d = np.zeros((3, 4), np.int32)
    with pytest.raises(ValueError):
        kernels.screen_pairs(d, d[:2], [d[:, :1]] * 2, [d[:, :1]] * 2, None, 0)
    q, m = torch.zeros((3, 8), dtype=torch.int8), torch.zeros((5, 8), dtype=torch.int8)
    for bad in ((q, m, q[:2], m), (q, m, q, m[:, :4]), (q, m[:4], q, m)):
        with pytest.raises(ValueError):
            kernels.screen_int8(*bad, [d[:, :1]] * 2, [d[:, :1]] * 2, 0)
    with pytest.raises(ValueError):
        kernels.screen_int8(q, m, q, m, [d[:2, :1]] * 2, [d[:, :1]] * 2, 0)


def test_a_nan_score_takes_torch_s_selection_not_the_c_one():
    """The C selection assumes no NaN (a NaN vector's scores); with one, top_columns answers
    as torch does (topk ranks NaN highest), never with unset columns."""
    m = torch.randn(6, 200)
    m[2, 7] = float("nan")
    top, _ = native.top_columns(m, 5, torch.zeros(200))
    assert np.array_equal(top, hpm.top_columns(m, 5).numpy()) and 7 in top[2]


@built
@pytest.mark.parametrize("c", [5, 37, 3906])
def test_c_routing_from_int8_sums_equals_torch_s_scores_and_selection(c):
    """route_columns forms fp32(sums) * scale + bias row by row as torch forms the [n, c]
    scores (each step rounded: the same bits), with +inf at each row's own cluster (or none),
    and selects as top_columns does: equal to torch's whole path, ties and empty clusters
    (-inf bias) included; a NaN scale answers None (the caller's torch path)."""
    rng = np.random.default_rng(c)
    sums = torch.from_numpy(rng.integers(-300, 300, (200, c)).astype(np.int32))
    sums[:, 1] = sums[:, 0]                                         # ties
    scale = torch.from_numpy(rng.random(200).astype(np.float32) / 97)
    bias = torch.from_numpy(rng.random(c).astype(np.float32) / 3)
    bias[2] = -np.inf
    own = rng.integers(0, c, 200)
    reach = torch.from_numpy(rng.random(c).astype(np.float32))
    for k in sorted({1, 4, 60, c} & set(range(1, c + 1))):
        got = native.route_columns(sums, scale, bias, own, k, reach)
        m = i8routing._scores(sums, scale, bias).scatter_(1, torch.as_tensor(own)[:, None],
                                                            np.inf)
        want = native._torch_top(m, k, reach)
        assert np.array_equal(got[0], want[0]) and got[1].tobytes() == want[1].tobytes()
        assert (got[0] == own[:, None]).any(1).all()
        alone = native.route_columns(sums, scale, bias, None, k, None)   # no own (spaces.py)
        assert np.array_equal(alone[0], native._torch_top(i8routing._scores(sums, scale, bias),
                                                          k, None)[0])
    scale[3] = np.nan
    assert native.route_columns(sums, scale, bias, own, 4, reach) is None
    with pytest.raises(IndexError):
        native.route_columns(sums, scale, bias, own + c, 4, reach)


@built
@pytest.mark.parametrize("per_row, k", [(3, 5), (40, 5), (300, 50)])
def test_c_row_best_equals_best_s_sorted_lists(per_row, k):
    """Best.dense in C (a counting sort by row, a sort within each row: insertion sort for
    short runs, quicksort past 24) equals torch's sorts of every entry: best score first,
    equal scores by the lower j (many ties here), -1 / 0 padding, rows with no entry."""
    rng = np.random.default_rng(per_row)
    n = 60
    r = np.repeat(np.arange(0, n, 2), per_row)                   # odd rows: none
    j = np.concatenate([rng.choice(10 ** 6, per_row, replace=False) for _ in range(n // 2)])
    s = (rng.integers(1, 8, len(r)) / 8).astype(np.float32)
    o = rng.permutation(len(r))
    best = topk.Best(n, k, "cpu")
    best.add(*(torch.from_numpy(x[o]) for x in (r, j, s)))
    got = best.dense()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "row_best", lambda *a: None)
        want = best.dense()
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    with native.scratch_kept():          # kept scratch, a larger call first: the same lists
        bigger = topk.Best(n, k, "cpu")
        bigger.add(*(torch.from_numpy(np.tile(x, 2)) for x in (r, j + 10 ** 6, s)))
        bigger.dense()
        assert all(torch.equal(x, y) for x, y in zip(best.dense(), want))
    assert (got[0][1::2] == -1).all() and (got[0][::2, :min(k, per_row)] >= 0).all()
    s[3] = np.nan
    assert native.row_best(*(torch.from_numpy(x) for x in (r, j, s)), n, k) is None


def _block(rng, n: int, cross: bool) -> tuple:
    """A block's candidates: rows ascending in runs (some long, some rows absent), similarities
    on few levels (ties), with NaN, -0, 0 and values at the floors, taus and dup."""
    r = np.sort(rng.choice(n, 4000) // 1)
    r[:900] = r[0]                                              # one long run
    levels = np.array([np.nan, -0.0, 0.0, -0.5, 0.3, 0.5, 0.6, 0.9, 0.95, 0.98, 0.99, 1.0],
                      np.float32)
    names = core.SIMS if cross else ("sii", "stt")
    val = {f: torch.from_numpy(levels[rng.integers(0, len(levels), len(r))]) for f in names}
    if cross:
        val["xtt"][::3] = np.nan
    return torch.from_numpy(r.astype(np.int64)), torch.from_numpy(rng.integers(0, 10**6, len(r))), \
        val


def _sampled(n: int, cross: bool) -> tuple:
    """One row's run of 2,048 pairs whose every 16th (what native.c's kth_of samples) is
    higher: the sample's threshold keeps 128, enough for k up to 127, else all are searched."""
    hi = np.arange(2048) % 16 == 0
    val = {"sii": np.where(hi, 0.97, 0.92), "stt": np.where(hi, 0.97, 0.6)}
    val.update({f: np.full(2048, np.nan) for f in core.SIMS[2:] if cross})
    return torch.full((2048,), n - 1), torch.arange(2048), \
        {f: torch.from_numpy(v.astype(np.float32)) for f, v in val.items()}


@built
@pytest.mark.parametrize("k, max_pairs, dup, cross", [(5, None, 0.98, False), (1, 3, None, True),
                                                      (50, 40, 0.98, True), (7, 1, 0.95, False),
                                                      (200, 150, None, False)])
def test_c_block_findings_equal_torch_s_selection(k, max_pairs, dup, cross):
    """Findings.add in C (native.block_findings) and in torch, over four blocks: the same
    pairs above the floors, in the same order, with the same values (NaN where a similarity is
    absent), the same cut, support and held top-k; rows not ascending go to torch's."""
    rng = np.random.default_rng(k)
    n = 300
    p = core.PassParams(k=k, tau_i=0.5, tau_t=0.3, dup=dup, floor_i=0.9, floor_t=0.95,
                        floor_x=0.6 if cross else 2.0, max_pairs=max_pairs)
    blocks = [_block(rng, n, cross) for _ in range(3)] + [_sampled(n, cross)]
    got = {}
    for on in (True, "kept", False):     # kept: scratch kept from block to block
        with pytest.MonkeyPatch.context() as mp, \
                (native.scratch_kept() if on == "kept" else contextlib.nullcontext()):
            if not on:
                mp.setattr(native, "block_findings", lambda *a: None)
            acc = units.Findings(n, p, "cpu")
            for b in blocks:
                acc.add(*b)
            got[on] = (pairs_of(acc.found), acc.best.unsorted(), acc.support, acc.cut)
    (pb, tb, sb, cb) = got[False]
    for pa, ta, sa, ca in (got[True], got["kept"]):
        assert pa.keys() == pb.keys() and all(_same(pa[f], pb[f]) for f in pa)
        assert all(_same(x, y) for x, y in zip(ta, tb)) and torch.equal(sa, sb)
        np.testing.assert_array_equal(ca, cb)
    pa, ta, sa, ca = got[True]
    assert len(pa["q"]) and len(ta[0]) and int(sa.sum()) > len(ta[0])
    if max_pairs is not None:
        assert ca.sum() > 0
    r, _, val = blocks[0]
    acc = units.Findings(n, p, "cpu")
    assert native.block_findings(r, val, acc.floors, p, acc.support, acc.cut) is not None
    assert native.block_findings(r.flip(0), val, acc.floors, p, acc.support, acc.cut) is None
    with pytest.raises(IndexError):
        native.block_findings(r + n, val, acc.floors, p, acc.support, acc.cut)


def _same(x, y) -> bool:
    x, y = (np.asarray(v) for v in (x, y))
    return x.dtype == y.dtype and x.tobytes() == y.tobytes()


@built
def test_c_stable_order_is_numpy_s_stable_argsort():
    key = np.random.default_rng(0).integers(0, 300, 5000)
    np.testing.assert_array_equal(native.stable_order(key, 300), np.argsort(key, kind="stable"))
    with pytest.raises(IndexError):
        native.stable_order(key, 200)



@pytest.mark.skipif(not kernels.amx(), reason="no AMX (or no C compiler) here: torch's _int_mm")
@pytest.mark.parametrize("n, m, d", [(1, 1, 64), (15, 17, 128), (17, 16, 64), (33, 47, 384),
                                     (0, 5, 64), (5, 0, 64), (40, 3, 40)])
def test_the_amx_int8_gemm_gives_torch_s_integers(n, m, d):
    """kernels.int_mm (AMX tiles) against torch._int_mm: the same int32 sums, values at int8's
    ends, row and column tails; None where d is not a multiple of 64 (q8.int_mm: torch's)."""
    rng = np.random.default_rng(n + m + d)
    a, b = (torch.from_numpy(rng.integers(-128, 128, (k, d), dtype=np.int8)) for k in (n, m))
    a[:1, :] = -128
    got = kernels.int_mm(a, b)
    if d % 64:
        assert got is None and q8.int_mm(a, b).shape == (n, m)
        return
    want = a.long() @ b.long().T
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    assert torch.equal(q8.int_mm(a, b), got)


@pytest.mark.skipif(not kernels.amx(), reason="no AMX (or no C compiler) here: torch's argmax")
@pytest.mark.parametrize("n, m, d", [(1, 1, 64), (15, 33, 128), (17, 3906, 64), (9000, 50, 64),
                                     (5, 7, 40)])
def test_the_amx_argmax_is_torch_s_argmax_of_the_sums(n, m, d):
    """kernels.int_argmax (the sums reduced in the tiles' output, rows over threads) against
    torch.argmax of the exact sums: ties (repeated columns: the first wins), rows whose every
    sum is negative (a panel's zero padding must not win), row and column tails; None where d
    is not a multiple of 64; the layout's nearest the same either way."""
    rng = np.random.default_rng(n + m + d)
    a, b = (torch.from_numpy(rng.integers(-128, 128, (k, d), dtype=np.int8)) for k in (n, m))
    b[m // 2], a[0], b[-1] = b[m // 3], 1, -1     # a tie; row 0 x the last column: -d (m = 1:
                                                  # its only sum, negative)
    got = kernels.int_argmax(a, b)
    if d % 64:
        assert got is None
        return
    assert torch.equal(got, torch.argmax(a.long() @ b.long().T, 1))
    x = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32))
    cent = torch.nn.functional.normalize(torch.from_numpy(
        rng.standard_normal((m, d)).astype(np.float32)), dim=1)
    with pytest.MonkeyPatch.context() as mp:
        want = i8routing.nearest(x, cent)
        mp.setattr(kernels, "USE_AMX", False)
        assert torch.equal(i8routing.nearest(x, cent), want)


@built
def test_c_member_sums_are_torch_s_index_add_bit_for_bit():
    """native.add_rows against index_add_ in float64 (the layout's member sums): values over 60
    decades (order matters: each element's additions in row order), one and two torch threads,
    a strided view; rows out of range refused."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6000, 80)) * 10.0 ** rng.integers(-30, 30, (6000, 80)))
    x = torch.from_numpy(x.astype(np.float32))
    lab = torch.from_numpy(rng.integers(0, 3, len(x)))
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            want = torch.zeros((3, 80), dtype=torch.float64).index_add_(0, lab, x.double())
            got = torch.zeros((3, 80), dtype=torch.float64)
            assert native.add_rows(x, lab, got) and _same(got, want)
    finally:
        torch.set_num_threads(threads)
    wide = torch.stack([x, x], 1)[:, 0]                 # rows 160 floats apart
    got = torch.zeros((3, 80), dtype=torch.float64)
    assert native.add_rows(wide, lab, got) and _same(got, want)
    with pytest.raises(IndexError):
        native.add_rows(x, lab + 1, torch.zeros((3, 80), dtype=torch.float64))
    assert not native.add_rows(x.double(), lab, got)


@pytest.mark.skipif(not kernels.amx(), reason="no AMX (or no C compiler) here: block by block")
def test_the_stacked_amx_screen_lists_what_the_blocks_list_one_by_one(monkeypatch):
    """kernels.screen_blocks (one C call for a stack) against screen_int8 block by block and
    q8.rule on torch's sums: blocks with no queries or no members, row tails under 16, members
    read where they lie (slices of one array), flat indices from each block's offset, and
    thresholds at int32's ends; a layout it cannot read in place falls back (None)."""
    rng = np.random.default_rng(3)
    di, dt = 128, 64
    qi, qt = (torch.from_numpy(rng.integers(-127, 128, (70, d), dtype=np.int8)) for d in (di, dt))
    mall = [torch.from_numpy(rng.integers(-127, 128, (400, d), dtype=np.int8)) for d in (di, dt)]
    spans = [(0, 17), (17, 17), (17, 20), (20, 52), (52, 70), (30, 40)]
    rows = [(0, 33), (33, 90), (90, 90), (100, 116), (120, 377), (5, 6)]
    members = [(mall[0][a:b], mall[1][a:b]) for a, b in rows]
    firsts = np.cumsum([0] + [(b - a) * len(m[0]) for (a, b), m in zip(spans, members)])
    lim0 = np.cumsum([0] + [b - a for a, b in spans])
    lim = {s: [np.zeros((lim0[-1], 1), np.int32) for _ in range(2)] for s in ("sii", "stt")}
    want = []
    for u, ((a, b), (mi, mt)) in enumerate(zip(spans, members)):
        at = slice(lim0[u], lim0[u + 1])
        sums = {"sii": torch._int_mm(qi[a:b], mi.T).numpy() if (b - a) * len(mi) else None,
                "stt": torch._int_mm(qt[a:b], mt.T).numpy() if (b - a) * len(mi) else None}
        for s, x in sums.items():          # floor: a row's top 5%; tau: its top 60%
            for t, pct in zip(lim[s], (95, 40)):
                t[at] = np.percentile(x, pct, 1, keepdims=True) if x is not None else 0
        if b - a > 3:
            lim["sii"][0][at][1], lim["stt"][1][at][2] = q8.INT32
        one = kernels.screen_int8(qi[a:b], mi, qt[a:b], mt, [t[at] for t in lim["sii"]],
                                  [t[at] for t in lim["stt"]], int(firsts[u]))
        if sums["sii"] is not None:
            assert np.array_equal(one, np.flatnonzero(q8.rule(sums, {
                s: [t[at] for t in v] for s, v in lim.items()})) + firsts[u])
        want.append(one)
    got = kernels.screen_blocks(qi, qt, spans, members, lim["sii"], lim["stt"], firsts[:-1])
    want = np.concatenate(want)
    assert 0.2 < len(want) / firsts[-1] < 0.8 and np.array_equal(got, want)
    own = np.unique(np.r_[want[::7], want[-1], 1, firsts[-1] - 1])   # listed or not
    for o in (own, own[::-1]):          # left out; not ascending: listed (the caller's to do)
        got = kernels.screen_blocks(qi, qt, spans, members, lim["sii"], lim["stt"],
                                    firsts[:-1], o)
        assert np.array_equal(got, want[~np.isin(want, own)] if o is own else want)
    assert kernels.screen_blocks(qi[:, ::2], qt, spans, members, lim["sii"], lim["stt"],
                                 firsts[:-1]) is None               # strided: block by block
    monkeypatch.setattr(kernels, "USE_AMX", False)
    assert kernels.screen_blocks(qi, qt, spans, members, lim["sii"], lim["stt"],
                                 firsts[:-1]) is None


@built
def test_c_dense_reads_equal_torch_s_takes_and_divisions():
    """native.dense_read (a dense block's candidates: rows, columns and fp32 values in one
    pass) against the torch path it replaces, into views of larger buffers; an index outside
    the block, or out of order, raises before a wrong read."""
    g = torch.Generator().manual_seed(2)
    sims = {s: torch.randn(37, 53, generator=g) for s in ("sii", "stt", "xii")}
    at = 1000
    flat = torch.sort(torch.randperm(37 * 53, generator=g)[:900]).values + at
    flat[-1] = at + 37 * 53 - 1
    n = len(flat) + 5
    buf = {s: torch.full((n,), -1.0) for s in sims}
    rows, cols = torch.full((n,), -1, dtype=torch.long), torch.full((n,), -1, dtype=torch.long)
    view = slice(3, 3 + len(flat))
    assert native.dense_read(sims, flat, at, 11, 400, {s: v[view] for s, v in buf.items()},
                             rows[view], cols[view])
    local = flat - at
    assert torch.equal(rows[view], local // 53 + 11) and torch.equal(cols[view], local % 53 + 400)
    for s, x in sims.items():
        assert _bits(buf[s][view]) == _bits(torch.take(x, local))
        assert (buf[s][:3] == -1).all() and (buf[s][view.stop:] == -1).all()
    here = {s: v[view] for s, v in buf.items()}
    for bad in (flat - 1, flat + 1, flat.flip(0)):
        with pytest.raises(IndexError, match="dense_read"):
            native.dense_read(sims, bad, at, 0, 0, here, rows[view], cols[view])
    assert not native.dense_read({s: x.t() for s, x in sims.items()}, flat, at, 0, 0, here,
                                 rows[view], cols[view])          # not row-major: torch's


@built
@pytest.mark.skipif(not kernels.amx(), reason="no AMX here: the stacked screen does not run")
@pytest.mark.parametrize("dense", [False, True])
def test_a_pass_at_64_dimensions_with_the_stacked_screen_writes_what_one_without_writes(
        dense, monkeypatch):
    """int8 at 64 dimensions (AMX reads them): every stack screened in one C call
    (screen_amx_blocks) and, dense, its candidates read off fp32 GEMMs in C (dense_read); the
    same bytes as the pass without any C kernel."""
    img, txt = pairs(300, 64, seed=8, spread=0.9, n_clusters=5)
    p = core.PassParams(k=7, tau_i=0.3, tau_t=0.1, dup=0.98, n_clusters=5, probe=2,
                        query_block=41, block_size=53, precision="int8", space_probe=0,
                        **dict(FLOORS, floor_i=0.5, floor_t=0.5, floor_x=0.6))
    share = 0.0 if dense else 1.0
    calls: dict = {}
    monkeypatch.setattr(screen, "DENSE_SHARE", share)
    monkeypatch.setattr(native, "library", _Counted(native.library(), calls))
    monkeypatch.setattr(kernels, "count_library", _Counted(kernels.count_library(), calls))
    with_c = space_pass(img, txt, p)
    assert calls.get("screen_amx_blocks") and bool(calls.get("dense_read")) == dense, calls
    assert_same_without_c(with_c, lambda: space_pass(img, txt, p), share, monkeypatch)
