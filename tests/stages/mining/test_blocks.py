"""The neighbour pass in dense blocks against the naive loops and exact HPM."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from vlcurate.foundation import heap
from vlcurate.stages.mining import engine as E
from vlcurate.stages.mining.engine import (core, layout, passes, persist, routing, screen, topk,
                                           units)
from vlcurate.stages.mining.engine import pairs as epairs
from vlcurate.stages.mining.engine import precision
from vlcurate.stages.mining import fff, hpm, native

from .naive import naive_fff, naive_fff_captions, naive_hpm, pairs
from .test_hpm import assert_matches_naive

TAU = 0.3


def data(n=160, d=12, seed=3):
    img, txt = pairs(n, d, seed=seed, spread=0.8, n_clusters=6)
    img[7], txt[7] = img[3], txt[3]                      # an exact duplicate
    img[9] = img[4]                                      # an image duplicate only
    return img, txt


def params(k, c, probe=None, **kw):
    return core.PassParams(k=k, tau_i=TAU, tau_t=TAU, dup=0.98, n_clusters=c,
                        probe=probe or c, query_block=37, block_size=29,
                        **kw)


@pytest.mark.parametrize("c", [1, 5])
def test_exhaustive_pass_equals_naive_hpm(c, device):
    img, txt = data()
    k = 26
    lay, r = E.neighbour_pass(img, txt, params(k, c), device=device)
    assert lay.n_clusters == c and r.certified.all()
    assert_matches_naive(hpm.TopK(r.idx, r.score, r.support, r.certified),
                         naive_hpm(img, txt, k, TAU, TAU, 0.98), k)
    assert 0 < r.noise.sum() < len(img)
    assert 7 not in r.idx[3] and 3 not in r.idx[7]       # duplicates are not hard pairs


def compact_slack(monkeypatch, slack: int) -> None:
    """core.COMPACT_SLACK as every holder of pairs reads it (Best, Held, Findings)."""
    for mod in (core, topk, epairs, units):
        monkeypatch.setattr(mod, "COMPACT_SLACK", slack)


def brute_pairs(img, txt, fi, ft, ximg=None, xtxt=None, fx=2.0):
    si, st = img @ img.T, txt @ txt.T
    keep = (si > fi) | (st > ft)
    if ximg is not None:
        keep |= ((ximg @ xtxt.T) > fx) | ((ximg @ ximg.T) > fi) | ((xtxt @ xtxt.T) > ft)
    np.fill_diagonal(keep, False)
    return {(int(a), int(b)) for a, b in zip(*np.nonzero(keep))}


def cross_vectors(img, seed):
    rng = np.random.default_rng(seed)
    return (hpm.normalize(img[:, :6] + 0.3 * rng.standard_normal((len(img), 6))),
            hpm.normalize(img[:, :6] + 0.3 * rng.standard_normal((len(img), 6))))


def test_exhaustive_pairs_are_every_pair_above_the_floors_with_exact_similarities(device):
    img, txt = data()
    ximg, xtxt = cross_vectors(img, 1)
    p = params(5, 4, floor_i=0.8, floor_t=0.85, floor_x=0.9)
    _, r = E.neighbour_pass(img, txt, p, ximg, xtxt, device=device)
    got = {(g, int(j)) for g in range(len(img)) for j in r.pair_j[r.offsets[g]:r.offsets[g + 1]]}
    assert got == brute_pairs(img, txt, 0.8, 0.85, ximg, xtxt, 0.9) and len(got) > 20
    assert got != brute_pairs(img, txt, 0.8, 0.85)              # the cross-modal floors count
    q = np.repeat(np.arange(len(img)), np.diff(r.offsets))
    for got_, (a, b) in ((r.pair_sii, (img, img)), (r.pair_stt, (txt, txt)),
                         (r.pair_sit, (ximg, xtxt)), (r.pair_xii, (ximg, ximg)),
                         (r.pair_xtt, (xtxt, xtxt))):
        np.testing.assert_allclose(got_, (a[q] * b[r.pair_j]).sum(1), atol=1e-5)


@pytest.mark.parametrize("cross", [False, True])
def test_fff_eq1_on_the_pairs_equals_naive_eq1_and_the_duplicate_list(cross):
    """Eq. 1 (and HELIP's duplicates) applied to the persisted pairs = the naive loop over every
    pair, when the floors are at or below the rule's thresholds: on HELIP's encoders without a
    cross-modal model, on the cross-modal one (X_ii, X_tt, S_it) with it."""
    img, txt = data()
    ximg, xtxt = cross_vectors(img, 2) if cross else (None, None)
    rule = fff.Rule(p1=0.9, p1_text=0.85, p2=0.85, p3=0.9, dup=0.98, cross=cross)
    p = params(5, 3, floor_i=0.85, floor_t=0.9, floor_x=0.85)
    _, r = E.neighbour_pass(img, txt, p, ximg, xtxt)
    import torch
    t = {f: torch.from_numpy(getattr(r, f)) for f in ("pair_sii", "pair_stt", "pair_sit",
                                                       "pair_xii", "pair_xtt")}
    if cross:
        code, score = fff.relate(t["pair_xii"], t["pair_xtt"], t["pair_sit"], rule,
                                 t["pair_sii"], t["pair_stt"])
        ref = naive_fff_captions(ximg, [[x] for x in xtxt], 0.9, 0.85, 0.85, 0.9, 0.98, img, txt)
        want = {(i, j): v for i, row in ref.items() for (j, _), v in row.items()}
    else:
        code, score = fff.relate(t["pair_sii"], t["pair_stt"], None, rule)
        ref = naive_fff(img, txt, 0.9, 0.85, 0.85, 0.9, 0.98)
        want = {(i, j): v for i, row in ref.items() for j, v in row.items()}
    q = np.repeat(np.arange(len(img)), np.diff(r.offsets))
    got = {(int(a), int(b)): (fff.CODES[c], s) for a, b, c, s in
           zip(q, r.pair_j, code.numpy(), score.numpy()) if c >= 0}
    assert got.keys() == want.keys() and len(want) > 10
    for key, (rel, s) in want.items():
        assert got[key][0] == rel and abs(got[key][1] - s) < 1e-5
    dups = {key for key, (rel, _) in want.items() if rel == "duplicate"}
    assert {(3, 7), (7, 3), (4, 9), (9, 4)} <= dups


@pytest.mark.parametrize("k, probe, tau, precision", [(5, 3, TAU, "fp32"), (500, 8, 0.5, "fp32"),
                                                      (5, 3, TAU, "bf16"), (5, 3, TAU, "int8")])
def test_partial_probing_certificate_is_a_proof(k, probe, tau, precision, device):
    """Among certified targets, every top-k equals exact HPM's (precision 100%), at
    k = 5 and k = 500 (there: every row is a noise pair, certified only when no pair left out
    can score > 0), and at the prefixes k' <= k (certified_at) of the same pass. bf16: routed
    by bf16 GEMMs too, whose error the bound on a left-out pair is widened by; int8: laid out
    by int8 GEMMs, routed as bf16, screened in int8. The pass's own certificate: without
    completing short rows' support (exact_noise, tested below)."""
    img, txt = pairs(900, 16, seed=8, spread=0.5, n_clusters=12)
    p = core.PassParams(k=k, tau_i=tau, tau_t=tau, dup=0.98, n_clusters=12, probe=probe,
                     query_block=37, block_size=29, precision=precision, exact_noise=False)
    _, r = E.neighbour_pass(img, txt, p, device=device)
    ex = hpm.exact_hpm(img, txt, k, tau, tau, 0.98, device=device)
    exact_idx = topk.canonical(ex.idx, ex.score)[0]
    assert (r.idx == topk.canonical(r.idx, r.score)[0]).all()   # the pass's order is canonical
    assert ((r.idx >= 0) == (r.score > 0)).all()
    assert (r.support <= ex.support).all()              # support among candidates: a lower bound
    for kk in sorted({5, 50, k} & set(range(1, k + 1))):
        cert = r.certified_at(kk)
        same = (r.idx[:, :kk] == exact_idx[:, :kk]).all(1)
        assert 0 < cert.sum() and (~cert).any()         # a real test: both kinds of targets
        assert same[cert].all()                         # every certified target is exact
    cert = r.certified                                  # k: the noise decision is exact too
    assert (r.noise[cert] == ex.noise[cert]).all()
    np.testing.assert_array_equal(r.certified, r.certified_at(k))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_routing_takes_the_nearest_means_and_its_own_cluster_and_bounds_the_rest(precision,
                                                                                 device):
    """route: each query's probe clusters are its own plus the best non-empty ones by
    <q, mu_c> + ROUTE_SPREAD sqrt(1 - |mu_c|^2) (as a naive sort finds them, up to bf16's or
    int8's near-ties), never an empty one while non-empty ones are left; m_out is at least
    every left-out cluster's <q, mu_c> + r_c (in bf16 and int8 too: widened by the screen's
    margin, or by each row's int8 bound)."""
    img, txt = pairs(400, 16, seed=5, spread=0.7, n_clusters=9)
    p = core.PassParams(k=5, tau_i=TAU, tau_t=TAU, n_clusters=10, probe=4, precision=precision)
    lay = layout.build_layout(img, txt, p)
    lay = layout.Layout(np.vstack([lay.means, lay.means[:1]]), np.r_[lay.radius, 0.0], lay.order,
                   np.r_[lay.bounds, lay.bounds[-1]])          # an empty cluster, nearest of all
    vec = persist.sorted_vectors(lay, img, txt, precision=precision)
    pos = np.arange(0, 400, 7)
    routes, m_out = routing.route(lay, vec, pos, p.probe, device, precision)
    q = np.hstack([vec.img[pos], vec.txt[pos]]) / np.sqrt(2)
    sims = (q @ lay.means.T).astype(np.float64)
    rank = sims + routing.ROUTE_SPREAD * np.sqrt(np.clip(1 - (lay.means.astype(np.float64) ** 2).sum(1),
                                                   0, None))
    full = np.flatnonzero(np.diff(lay.bounds) > 0)
    assert lay.n_clusters - 1 not in full
    own = lay.cluster_of(pos)
    tol = 2 * np.broadcast_to(routing.routing_scores(lay, torch.from_numpy(q).float(), precision)[1],
                             len(q))
    for i, row in enumerate(routes):
        assert own[i] in row and set(row) <= set(full) and len(set(row)) == p.probe
        rest = np.setdiff1d(full, row)
        others = np.setdiff1d(row, [own[i]])
        assert rank[i, others].min() >= rank[i, rest].max() - tol[i]
        assert m_out[i] >= (sims[i, rest] + lay.radius[rest]).max()


def test_int8_routing_scores_are_within_each_rows_bound(device):
    """routing_scores in int8 (each query row with its scale, the means with one): every score
    within its row's bound of the exact <x, mu_c> + bias (float64), the bound below the
    ~2x bf16's fixed margin it replaces in the certificate; bf16's within its margin."""
    img, txt = pairs(3000, 384, seed=3, spread=0.8, n_clusters=40)
    lay = layout.build_layout(img, txt, core.PassParams(k=5, tau_i=TAU, tau_t=TAU, n_clusters=40))
    x = torch.from_numpy(np.hstack([img[:500], txt[:500]]) / np.sqrt(2)).float()
    bias = np.where(np.diff(lay.bounds) == 0, -np.inf, routing.ROUTE_SPREAD * routing.spread(lay))
    exact = x.double().numpy() @ lay.means.astype(np.float64).T + bias
    for precision in ("int8", "bf16"):
        m, err = routing.routing_scores(lay, x.to(device), precision)
        full = np.diff(lay.bounds) > 0                     # empty clusters: -inf in both
        gap = np.abs(m.double().cpu().numpy()[:, full] - exact[:, full]).max(1)
        assert (gap <= err).all() and (gap > 0).all(), precision
    assert routing.routing_scores(lay, x.to(device), "int8")[1].max() < 2 * err   # err: bf16's


def test_shares_split_the_clusters_in_proportion():
    share = layout._shares(np.array([600, 300, 1, 0, 99]), 20)
    assert share.sum() == 20 and share.tolist() == [12, 6, 1, 0, 1]
    assert layout._shares(np.array([3, 1]), 10).tolist() == [3, 1]        # never more than the rows


def test_a_two_level_layout_assigns_each_row_within_its_coarse_cluster(monkeypatch, device):
    """Above TWO_LEVEL_WORK: every row in the fine cluster nearest to it among those of its
    COARSE_PROBE nearest coarse clusters; the requested number of clusters; with every cluster
    probed, exact HPM; probing some, the certificate is still a proof."""
    monkeypatch.setattr(layout, "TWO_LEVEL_WORK", 4 * 900)
    monkeypatch.setattr(layout, "COARSE_PROBE", 2)
    img, txt = pairs(900, 16, seed=8, spread=2.0, n_clusters=12)
    p = core.PassParams(k=5, tau_i=TAU, tau_t=TAU, dup=0.98, n_clusters=16, probe=16,
                     query_block=37, block_size=29)
    cent = layout.kmeans(img, txt, 16, p, device)
    assert len(cent.fine) == 16 and len(cent.coarse) == 4 and cent.start[-1] == 16
    x = layout.joint_t(torch.from_numpy(img), torch.from_numpy(txt)).to(device)
    top = (x @ cent.coarse.T).topk(2, dim=1).indices.cpu().numpy()
    s = (x @ cent.fine.T).cpu().numpy()
    group = np.repeat(np.arange(4), np.diff(cent.start))
    want = [int(np.argmax(np.where(np.isin(group, t), s[i], -np.inf))) for i, t in enumerate(top)]
    near = s.argmax(1)
    assert cent.nearest(x).cpu().tolist() == want
    assert (want != near).any() and (want == near).mean() > 0.9    # the coarse probe matters
    assert len(set(want)) > 8                           # the fine clusters are used
    lay, r = E.neighbour_pass(img, txt, p, device=device)
    assert lay.n_clusters == 16 and r.certified.all()
    assert_matches_naive(hpm.TopK(r.idx, r.score, r.support, r.certified),
                         naive_hpm(img, txt, 5, TAU, TAU, 0.98), 5)
    img, txt = pairs(900, 16, seed=8, spread=0.5, n_clusters=12)      # tighter: certifiable
    _, r = E.neighbour_pass(img, txt, dataclasses.replace(p, probe=5), device=device)
    ex = hpm.exact_hpm(img, txt, 5, TAU, TAU, 0.98, device=device)
    cert = r.certified
    assert 0 < cert.sum() < len(img)
    assert (r.idx[cert] == topk.canonical(ex.idx, ex.score)[0][cert]).all()


def test_int8_assignment_is_the_argmax_of_the_quantized_products(monkeypatch, device):
    """hpm.engine.precision int8 lays out by int8 GEMMs: each row's centroid is the argmax of its
    integer sums (rows scaled each by its own largest |value|, the centroids by one scale), as
    a naive int64 product finds it (first index on ties), the same as fp32's for most rows;
    a two-level layout (coarse centroids scored in bf16) with every cluster probed is still
    exact HPM."""
    img, txt = pairs(900, 16, seed=8, spread=2.0, n_clusters=12)
    x = layout.joint_t(torch.from_numpy(img), torch.from_numpy(txt))
    cent = torch.nn.functional.normalize(x[::45] + 0.1, dim=1)
    xq = torch.round(x * 127 / x.abs().amax(1, keepdim=True)).long()
    cq = torch.round(cent * 127 / cent.abs().max()).long()
    want = (xq @ cq.T).argmax(1)
    got = precision.get("int8").nearest(x.to(device), cent.to(device)).cpu()
    assert torch.equal(got, want)
    assert (got == layout.nearest(x, cent)).float().mean() > 0.9
    monkeypatch.setattr(layout, "TWO_LEVEL_WORK", 4 * 900)
    p = core.PassParams(k=5, tau_i=TAU, tau_t=TAU, dup=0.98, n_clusters=16, probe=16,
                     query_block=37, block_size=29, precision="int8")
    lay, r = E.neighbour_pass(img, txt, p, device=device)
    assert lay.n_clusters == 16 and r.certified.all()
    assert_matches_naive(hpm.TopK(r.idx, r.score, r.support, r.certified),
                         naive_hpm(img, txt, 5, TAU, TAU, 0.98), 5)


def test_gather_caps_pairs_per_row_by_similarity():
    img, txt = data()
    p = params(4, 2, floor_i=0.3, floor_t=0.3)
    _, full = E.neighbour_pass(img, txt, p)
    _, capped = E.neighbour_pass(img, txt, p, max_pairs=3)
    n_full = np.diff(full.offsets)
    assert (np.diff(capped.offsets) == np.minimum(n_full, 3)).all()
    np.testing.assert_array_equal(capped.cut, np.maximum(n_full - 3, 0))
    assert capped.cut.sum() > 0
    g = int(np.argmax(n_full))
    best = np.maximum(full.pair_sii, full.pair_stt)[full.offsets[g]:full.offsets[g + 1]]
    kept = np.maximum(capped.pair_sii, capped.pair_stt)[capped.offsets[g]:capped.offsets[g + 1]]
    np.testing.assert_allclose(np.sort(kept), np.sort(best)[-3:])


def test_a_rows_result_does_not_depend_on_the_rows_mined_with_it():
    """The stage mines each chunk of each part on its own: any split of the rows (and any order)
    gives every row the same hard pairs, support, certificate and candidate pairs as mining
    them all at once. Scores agree to float rounding only: a GEMM's last bits depend
    on its shape, which is why the runner fixes the chunks (run.chunk_rows) and threads. Exact
    ties: test_ties_at_the_kth_place_keep_the_lower_row_whatever_the_chunks."""
    img, txt = pairs(500, 16, seed=4, spread=0.6, n_clusters=8)
    p = params(5, 7, probe=3, floor_i=0.7, floor_t=0.7, max_pairs=4)
    lay, whole = E.neighbour_pass(img, txt, p, rows=500)
    vec = persist.sorted_vectors(lay, img, txt)
    perm = np.random.default_rng(0).permutation(500)
    pos = lay.positions()[perm]
    split = passes.PassResult.concat([E.mine(lay, vec, pos[a:b], p)
                                 for a, b in ((0, 1), (1, 38), (38, 500))])
    inv = np.argsort(perm)
    for f in ("idx", "support", "certified", "cut"):
        np.testing.assert_array_equal(getattr(split, f)[inv], getattr(whole, f))
    np.testing.assert_allclose(split.score[inv], whole.score, rtol=1e-6)
    for g in range(500):
        a, b = split.offsets[inv[g]], split.offsets[inv[g] + 1]
        c, d = whole.offsets[g], whole.offsets[g + 1]
        np.testing.assert_array_equal(split.pair_j[a:b], whole.pair_j[c:d])
        np.testing.assert_allclose(split.pair_sii[a:b], whole.pair_sii[c:d], rtol=1e-6)
    assert len(whole.pair_j) > 50 and whole.cut.sum() > 0
    assert whole.certified.any() and (~whole.certified).any()


@pytest.mark.parametrize("probe", [2, 4])
def test_ties_at_the_kth_place_keep_the_lower_row_whatever_the_chunks(probe):
    """Every row has an exact twin, so scores tie exactly at the k-th place: the lower global
    row is kept, whichever rows are mined together, and (exhaustive) as exact HPM keeps it.
    The vectors lie on a 1/256 grid, so that every dot product is exact in float32 whatever order
    a GEMM kernel sums it in (on an AMD EPYC, AVX-512, twins' dots differed in their last bit
    with their place in the block: no tie at all)."""
    img, txt = (np.round(x * 256) / 256 for x in pairs(120, 8, seed=5, spread=0.5, n_clusters=4))
    img, txt = np.concatenate([img, img]), np.concatenate([txt, txt])
    p = params(5, 4, probe=probe)
    lay, whole = E.neighbour_pass(img, txt, p, rows=240)
    vec, pos = persist.sorted_vectors(lay, img, txt), lay.positions()
    for cuts in ((0, 1, 240), (0, 7, 100, 101, 240)):
        split = passes.PassResult.concat([E.mine(lay, vec, pos[a:b], p)
                                     for a, b in zip(cuts[:-1], cuts[1:])])
        np.testing.assert_array_equal(split.idx, whole.idx)
    live = whole.idx[:, -1] >= 0                 # twins come in pairs: the 5th splits one
    assert live.sum() > 100
    assert (whole.idx[live, -1] < 120).all()     # of two tied twins, the lower row is kept
    if probe == 4:
        ex = hpm.exact_hpm(img, txt, 5, TAU, TAU, 0.98, block_size=29, query_block=37)
        np.testing.assert_array_equal(topk.canonical(ex.idx, ex.score)[0], whole.idx)


def test_capping_as_units_arrive_equals_capping_once(monkeypatch):
    """gather caps the pairs it holds whenever they pass 2 n max_pairs (+ slack): with no slack
    it compacts after nearly every unit, and the result is the same as one cap at the end."""
    img, txt = data()
    p = params(4, 2, floor_i=0.3, floor_t=0.3)
    _, once = E.neighbour_pass(img, txt, p, max_pairs=3)
    compact_slack(monkeypatch, -2 * len(img) * 3)
    _, often = E.neighbour_pass(img, txt, p, max_pairs=3)
    for f in ("offsets", "pair_j", "pair_sii", "pair_stt", "pair_sit", "idx", "score"):
        np.testing.assert_array_equal(getattr(often, f), getattr(once, f))
    np.testing.assert_array_equal(often.cut, once.cut)
    assert once.cut.sum() > 0


@pytest.mark.parametrize("slack", [None, -10**6])
def test_held_drops_pairs_below_a_full_rows_floor_exactly_as_one_cap(slack, monkeypatch):
    """Held: pieces in any order, capped whenever they pass 2 n max_pairs (+ slack: -10**6
    after every piece), with pairs strictly below a full row's floor dropped on arrival, keep
    and cut exactly what one cap of every pair keeps and cuts, ties (equal max similarity,
    ordered by j) included."""
    if slack is not None:
        compact_slack(monkeypatch, slack)
    rng = np.random.default_rng(7)
    n, cap, m = 6, 5, 400
    pairs = {"q": rng.integers(0, n, m), "j": rng.permutation(10 * m)[:m]}
    for f in core.SIMS:
        pairs[f] = rng.choice([0.5, 0.7, 0.9], m).astype(np.float32)
        pairs[f][rng.random(m) < 0.3] = np.nan              # cross-modal ones may be absent
    pairs["sii"] = rng.choice([0.6, 0.8, 0.95], m).astype(np.float32)
    want_cut = np.zeros(n, np.int64)
    want = epairs._cap(pairs, cap, want_cut)
    cut = np.zeros(n, np.int64)
    held = epairs.Held(n, cap, cut)
    for piece in np.array_split(rng.permutation(m), 9):
        held.add({f: v[piece] for f, v in pairs.items()})
    got = held.pairs()
    order = lambda x: np.lexsort((x["j"], x["q"]))          # noqa: E731
    for f in pairs:
        np.testing.assert_array_equal(got[f][order(got)], want[f][order(want)])
    np.testing.assert_array_equal(cut, want_cut)
    assert want_cut.sum() == m - n * cap
    if slack is not None:
        assert (held.floor > -np.inf).all()                  # the floors did drop pairs


def test_cap_keeps_each_rows_best_by_max_similarity_then_j_as_a_naive_sort():
    """_cap sorts only the rows over the cap, after dropping what is below their cap-th value:
    the same pairs kept and cut as sorting each row's pairs by (-max similarity, j) in Python,
    with ties at the cap-th place, NaN similarities and rows under the cap (left untouched)."""
    rng = np.random.default_rng(11)
    n, cap, m = 9, 4, 300
    q = rng.choice([0, 1, 2, 3, 5, 8], m - 7, p=[.3, .3, .2, .1, .05, .05])
    pairs = {"q": np.r_[q, [6] * 3, [7] * 4], "j": rng.permutation(5 * m)[:m]}   # 6, 7: <= cap
    for f in core.SIMS:
        pairs[f] = rng.choice([0.5, 0.7, 0.9], m).astype(np.float32)
        pairs[f][rng.random(m) < 0.4] = np.nan
    pairs["sii"] = rng.choice([0.6, 0.8, 0.95], m).astype(np.float32)
    cut = np.zeros(n, np.int64)
    got = epairs._cap({f: v.copy() for f, v in pairs.items()}, cap, cut)
    best = np.fmax.reduce([pairs[f] for f in core.SIMS])
    want, want_cut = set(), np.zeros(n, np.int64)
    for q in range(n):
        mine = sorted(np.flatnonzero(pairs["q"] == q), key=lambda i: (-best[i], pairs["j"][i]))
        want |= {(q, int(pairs["j"][i])) for i in mine[:cap]}
        want_cut[q] = max(len(mine) - cap, 0)
    assert set(zip(got["q"].tolist(), got["j"].tolist())) == want
    np.testing.assert_array_equal(cut, want_cut)
    assert (want_cut > 0).sum() >= 2 and want_cut[6] == want_cut[7] == 0
    at = {(q, j): i for i, (q, j) in enumerate(zip(pairs["q"].tolist(), pairs["j"].tolist()))}
    for i, key in enumerate(zip(got["q"].tolist(), got["j"].tolist())):
        for f in core.SIMS:                                     # every similarity travels with it
            np.testing.assert_array_equal(got[f][i], pairs[f][at[key]])


@pytest.mark.parametrize("slack", [None, -10**6])
def test_best_keeps_each_rows_k_best_with_ties_to_the_lower_row(slack, monkeypatch, device):
    """Best (the pass's top-k, held as lists): pieces in any order, cut whenever they pass
    2 n k (+ slack; -10**6: after every piece), give each row's k best by score, equal scores
    by the lower global row - a stable sort of every pair at once."""
    import torch
    if slack is not None:
        compact_slack(monkeypatch, slack)
    rng = np.random.default_rng(4)
    n, k, m = 9, 4, 300
    r = rng.integers(0, n, m)
    j = rng.permutation(10 * m)[:m]                       # distinct global rows
    s = rng.choice([0.25, 0.5, 0.75], m).astype(np.float32)      # many exact ties
    best = topk.Best(n, k, device)
    for piece in np.array_split(rng.permutation(m), 7):
        best.add(*(torch.as_tensor(x[piece], device=device) for x in (r, j, s)))
    idx, score = (x.cpu().numpy() for x in best.dense())
    for row in range(n):
        mine = np.flatnonzero(r == row)
        want = mine[np.lexsort((j[mine], -s[mine]))][:k]
        np.testing.assert_array_equal(idx[row, :len(want)], j[want])
        np.testing.assert_array_equal(score[row, :len(want)], s[want])
        assert (idx[row, len(want):] == -1).all()


@pytest.mark.parametrize("precision, query_block", [("fp32", 200), ("bf16", 200),
                                                     ("int8", 200), ("int8", 23)])
def test_stacked_units_find_what_units_alone_find(precision, query_block, monkeypatch, device):
    """Small units run stacked (each unit's GEMMs into one flat buffer, one candidate pass for
    all: run_stack) and find the same top-k, support, pairs and similarities as each alone;
    bf16 and int8 screen every block (DENSE_SHARE 1: this data is dense) and re-score a
    stack's pairs at once from the sorted vectors (rescore_flat's members), each unit alone
    through its own members: the same bits. query_block 23: units of more queries are stacked
    in pieces (a cluster's pieces may share a stack)."""
    img, txt = data(n=240)
    p = core.PassParams(k=6, tau_i=TAU, tau_t=TAU, dup=0.98, n_clusters=8, probe=3,
                     query_block=query_block, block_size=64, floor_i=0.5, floor_t=0.5,
                     max_pairs=5, precision=precision)
    lay = layout.build_layout(img, txt, p)
    routes, _ = routing.route(lay, persist.sorted_vectors(lay, img, txt), lay.positions(), p.probe)
    assert (np.bincount(routes.ravel()) > query_block).any() == (query_block < 200)
    monkeypatch.setattr(screen, "DENSE_SHARE", 1.0)
    calls, rescored = [], []
    real, rescore = units.run_stack, screen.rescore_flat
    monkeypatch.setattr(passes, "run_stack", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(screen, "rescore_flat", lambda q, b, f, m=None: rescored.append(
        m is not None and len(f)) or rescore(q, b, f, m))
    _, stacked = E.neighbour_pass(img, txt, p, device=device)
    assert calls                                                # stacks did run
    assert precision == "fp32" or any(rescored)       # and re-scored pairs with their members
    monkeypatch.setattr(units, "STACK_PAIRS", 0)                    # every unit alone
    calls.clear()
    _, alone = E.neighbour_pass(img, txt, p, device=device)
    assert not calls
    # and in int8 (exact sums, each pair re-scored alone) whatever the query_block
    whole = E.neighbour_pass(img, txt, dataclasses.replace(p, query_block=200),
                             device=device)[1] if precision == "int8" else alone
    for f in ("idx", "score", "support", "offsets", "pair_j", "pair_sii", "pair_stt", "cut",
              "certified"):         # byte for byte: each unit's GEMMs are the ones it runs alone
        np.testing.assert_array_equal(getattr(stacked, f), getattr(alone, f), err_msg=f)
        np.testing.assert_array_equal(getattr(whole, f), getattr(alone, f), err_msg=f)
    assert (stacked.idx >= 0).sum() > 100 and len(stacked.pair_j) > 50


@pytest.mark.parametrize("cells, in_c", [(1 << 22, True), (1 << 22, False), (150, False)])
def test_at_or_above_kth_keeps_every_entry_that_can_be_among_its_rows_best_k(cells, in_c,
                                                                             monkeypatch, device):
    """The pre-cut of a block's pairs (Findings: the top-k and the max_pairs cap): per row, every
    entry at or above the row's k-th largest value (ties at the k-th all kept, NaN lowest),
    every entry of a row with at most k; the same in C (a quickselect per row, on a CPU) and
    in torch's dense pieces of a row or two (its memory bound, DENSE_CELLS)."""
    monkeypatch.setattr(topk, "DENSE_CELLS", cells)
    if not in_c:
        monkeypatch.setattr(native, "at_or_above_kth", lambda *a: None)
    elif device != "cpu" or native.library() is None:
        pytest.skip("the C cut runs on a CPU with the native library")
    g = np.random.default_rng(4)
    r = np.sort(g.integers(0, 40, 3000))
    v = g.integers(0, 30, 3000).astype(np.float32) / 30          # many exact ties
    v[::17] = np.nan
    v[5::23] = -0.0
    v[7::29] = np.inf
    v[:1000] = g.standard_normal(1000)                           # no ties
    for k in (1, 5, 60, 200):
        got = topk.at_or_above_kth(torch.from_numpy(r).to(device), torch.from_numpy(v).to(device), k)
        want = np.ones(len(r), bool)
        for row in np.unique(r):
            at = r == row
            if at.sum() > k:
                x = np.nan_to_num(v[at], nan=-np.inf)
                want[at] = x >= np.sort(x)[::-1][k - 1]
        np.testing.assert_array_equal(got.cpu().numpy(), want, err_msg=str(k))
        assert k >= 200 or not want.all()
    assert topk.at_or_above_kth(torch.zeros(0, dtype=torch.long), torch.zeros(0), 3).shape == (0,)


def test_glibc_tuning_changes_no_byte_and_yields_to_the_users_malloc_settings(monkeypatch):
    """core.freed_memory_kept is speed only: the pass with glibc tuned (this Linux) and with
    it off (another libc, or the user's MALLOC_* variables, which win) gives the same bytes."""
    img, txt = data()
    heap.glibc.cache_clear()
    assert heap.glibc() is not None                      # the tests run on glibc
    tuned = E.neighbour_pass(img, txt, params(9, 5, probe=2, max_pairs=4, floor_i=0.5))[1]
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    heap.glibc.cache_clear()
    try:
        assert heap.glibc() is None
        plain = E.neighbour_pass(img, txt, params(9, 5, probe=2, max_pairs=4, floor_i=0.5))[1]
    finally:
        monkeypatch.delenv("MALLOC_ARENA_MAX")
        heap.glibc.cache_clear()
    assert len(tuned.pair_j) and (tuned.idx >= 0).any()
    for f in ("idx", "score", "support", "offsets", "pair_j", "pair_sii", "cut"):
        assert np.array_equal(getattr(tuned, f), getattr(plain, f)), f


@pytest.mark.parametrize("low", [0.5, -0.5])
def test_the_row_order_is_row_then_score_descending_then_j(low):
    """Best's order (topk._row_order): one key of row and score for positive scores (their
    bits), three stable sorts otherwise; the same order as a lexsort, ties included."""
    rng = np.random.default_rng(4)
    r, j = rng.integers(0, 50, 5000), rng.permutation(10 ** 6)[:5000]
    s = (rng.integers(0, 20, 5000) / 20 + low).astype(np.float32)     # many equal scores
    s[:3] = [np.float32(1e-30), np.float32(3e38), np.float32(1.5)]
    got = topk._row_order(*(torch.from_numpy(x) for x in (r, j, s))).numpy()
    assert np.array_equal(got, np.lexsort((j, -s, r)))


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_dense_screen_reads_fp32_gemms_only_where_it_has_candidates(precision, monkeypatch):
    """A screen too dense to re-score (DENSE_SHARE 0: every one) computes in fp32 only the
    blocks holding one of its candidates and reads them at those alone (screen.dense_pairs):
    every cluster probed (the same units, stacks and GEMMs in every precision), the same bytes
    as fp32, which computes every block and runs the rule over every pair."""
    img, txt = data(n=240)
    p = core.PassParams(k=6, tau_i=0.7, tau_t=0.7, dup=0.98, n_clusters=16, probe=16,
                        query_block=200, block_size=64, floor_i=0.8, floor_t=0.8, max_pairs=5)
    lay = layout.build_layout(img, txt, p)
    want = E.mine(lay, persist.sorted_vectors(lay, img, txt), lay.positions(), p)
    monkeypatch.setattr(screen, "DENSE_SHARE", 0.0)
    seen, real = [], screen.dense_pairs

    def dense(q, blocks, flat, *a):
        at = screen.offsets(blocks)
        seen.append((len(blocks), len(np.unique(np.searchsorted(at, flat.numpy(), "right")))))
        return real(q, blocks, flat, *a)
    monkeypatch.setattr(screen, "dense_pairs", dense)
    q = dataclasses.replace(p, precision=precision)
    got = E.mine(lay, persist.sorted_vectors(lay, img, txt, precision=precision),
                 lay.positions(), q)
    assert seen and any(n > held for n, held in seen)     # blocks without one: skipped
    for f in dataclasses.fields(want):
        assert np.asarray(getattr(got, f.name)).tobytes() == \
            np.asarray(getattr(want, f.name)).tobytes(), f.name
    assert (want.idx >= 0).sum() > 50 and len(want.pair_j) > 20


def test_without_drops_the_targets_own_pairs_only():
    """screen._without: sorted flat indices less those listed (absent ones ignored), on NumPy's
    path (a CPU) as on torch's."""
    flat = torch.tensor([2, 5, 9, 11, 40])
    for own, want in (([5, 40], [2, 9, 11]), ([3, 41], [2, 5, 9, 11, 40]), ([], [2, 5, 9, 11, 40]),
                      ([2, 5, 9, 11, 40], [])):
        got = screen._without(flat, torch.tensor(own, dtype=torch.long))
        assert got.tolist() == want
    assert screen._without(flat[:0], torch.tensor([1])).tolist() == []
