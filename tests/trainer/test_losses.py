"""The losses against naive references written straight from the papers' equations.

Each ``naive_*`` below is an explicit loop over i and j on scalar tensors, written from the
equation (not from the vectorised code); values and gradients (``torch.autograd.grad``) are
compared in float64 on small random batches. Then sanity properties, and gather_with_grad on a
real 2-process gloo group.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as TF

from vlcurate.trainer import distributed as D
from vlcurate.trainer import losses as L

DT = torch.float64


def unit(n: int, d: int = 8, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return TF.normalize(torch.randn(n, d, generator=g, dtype=DT), dim=1).requires_grad_()


def rand_mask(n: int, m: int, p: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, m, generator=g) < p


def param(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=DT, requires_grad=True)


def mask_to_index(H: torch.Tensor) -> torch.Tensor:
    """[n, n] bool -> [n, p] hard_index (-1 padded), in shuffled order within a row."""
    rows = [torch.nonzero(r).flatten().flip(0).tolist() for r in H]
    p = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [-1] * (p - len(r)) for r in rows])


def dot(a, b):
    return (a * b).sum()


def grads(out, inputs):
    return torch.autograd.grad(out, inputs, allow_unused=True, retain_graph=True)


def assert_parity(fast, naive, inputs, atol=1e-10):
    """Same value, same gradient w.r.t. every input."""
    assert torch.isfinite(fast)
    assert fast.item() == pytest.approx(naive.item(), rel=1e-10, abs=atol)
    for gf, gn, x in zip(grads(fast, inputs), grads(naive, inputs), inputs):
        gf = torch.zeros_like(x) if gf is None else gf
        gn = torch.zeros_like(x) if gn is None else gn
        assert torch.isfinite(gf).all()
        torch.testing.assert_close(gf, gn, rtol=1e-9, atol=atol)


# --- naive references ----------------------------------------------------------------------------

def naive_info_nce(X, T, s):
    n = len(X)
    total = 0
    for i in range(n):
        pos = torch.exp(s * dot(X[i], T[i]))
        total = total - torch.log(pos / sum(torch.exp(s * dot(X[i], T[j])) for j in range(n)))
        total = total - torch.log(pos / sum(torch.exp(s * dot(X[j], T[i])) for j in range(n)))
    return total / (2 * n)


def naive_clip_i2t(X, T, s):
    """HELIP Eq. 1 as printed (image -> text only)."""
    n = len(X)
    total = 0
    for i in range(n):
        den = sum(torch.exp(s * dot(X[i], T[j])) for j in range(n))
        total = total - torch.log(torch.exp(s * dot(X[i], T[i])) / den)
    return total / n


def naive_hnml(X, T, H):
    """HELIP Eq. 6 for each seed i; j over the normal negatives; mean over seeds."""
    n = len(X)
    per_seed = []
    for i in range(n):
        hard = [j for j in range(n) if H[i, j]]
        if not hard:
            continue
        m = min((dot(X[i], T[j]) for j in hard), key=lambda v: v.item())
        acc = 0
        for j in range(n):
            if j != i and j not in hard:
                acc = acc + torch.clamp(dot(X[i], T[j]) - m, min=0)
        per_seed.append(acc / n)
    return sum(per_seed) / len(per_seed) if per_seed else X.sum() * 0


def naive_hn_nce(X, T, s, alpha, beta):
    """DiHT sec. 3.3, both terms, weights normalised by n - 1; mean over i and directions."""
    n = len(X)

    def term(sim):  # sim(i, j): anchor i, candidate j
        tot = 0
        for i in range(n):
            z = sum(torch.exp(beta * s * sim(i, k)) for k in range(n) if k != i)
            den = alpha * torch.exp(s * sim(i, i))
            for j in range(n):
                if j != i:
                    w = (n - 1) * torch.exp(beta * s * sim(i, j)) / z
                    den = den + w * torch.exp(s * sim(i, j))
            tot = tot - torch.log(torch.exp(s * sim(i, i)) / den)
        return tot

    return (term(lambda i, j: dot(X[i], T[j])) + term(lambda i, j: dot(X[j], T[i]))) / (2 * n)


def naive_sigmoid(X, T, t, b, M):
    """FFF Eq. 2: 1/|B| sum_ij log(1 + exp(-m_ij (t s_ij + b))), m = +-1, |B| = #images."""
    total = 0
    for i in range(len(X)):
        for j in range(len(T)):
            m = 1.0 if M[i, j] else -1.0
            total = total + torch.log(1 + torch.exp(-m * (t * dot(X[i], T[j]) + b)))
    return total / len(X)


def naive_soft_ce(logits, idx, val):
    rows = []
    for i in range(logits.shape[0]):
        ks = [k for k in range(idx.shape[1]) if idx[i, k] >= 0]
        if not ks:
            continue
        z = sum(val[i, k] for k in ks)
        log_norm = torch.log(sum(torch.exp(logits[i, c]) for c in range(logits.shape[1])))
        rows.append(-sum(val[i, k] / z * (logits[i, int(idx[i, k])] - log_norm) for k in ks))
    return sum(rows) / len(rows) if rows else logits.sum() * 0


def naive_mp_nce(Z, dom, P, scale, offset, w):
    """UniCLIP Eq. 12 with Eq. 16; P_i u {i}; mean over anchors."""
    n = len(Z)

    def s(i, j):
        a, b = int(dom[i]), int(dom[j])
        return torch.exp(scale[a, b] * (dot(Z[i], Z[j]) - offset[a, b]))

    total = 0
    for i in range(n):
        positives = [p for p in range(n) if p == i or P[i, p]]
        negatives = [j for j in range(n) if j not in positives]
        neg_sum = sum(s(i, j) for j in negatives) if negatives else 0
        li = 0
        for p in positives:
            li = li - w[int(dom[i]), int(dom[p])] * torch.log(s(i, p) / (s(i, p) + neg_sum))
        total = total + li / len(positives)
    return total / n


# --- InfoNCE / HELIP -----------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 6])
def test_info_nce_parity(n):
    X, T, s = unit(n, seed=1), unit(n, seed=2), param(4.0)
    assert_parity(L.info_nce(X, T, s), naive_info_nce(X, T, s), [X, T, s])


def test_info_nce_chance_level_is_log_n():
    X = TF.normalize(torch.ones(5, 4, dtype=DT), dim=1)
    assert L.info_nce(X, X, 10.0).item() == pytest.approx(math.log(5))


def test_hnml_parity_several_hard_pairs_per_seed():
    n = 7
    X, T = unit(n, seed=3), unit(n, seed=4)
    H = rand_mask(n, n, 0.3, seed=5) & ~torch.eye(n, dtype=torch.bool)
    H[2] = False                                   # a non-seed row
    H[0, 1] = H[0, 3] = True                       # a seed with two hard pairs
    assert H.any(1).sum() >= 3
    assert_parity(L.hnml(X, T, mask_to_index(H)), naive_hnml(X, T, H), [X, T])


def test_hnml_hand_example():
    # seed 0: cos to T0..T3 = [1, .8, .1, .9]; hard pair {1} -> min .8; normals {2, 3}:
    # max(0, .1-.8) + max(0, .9-.8) = .1, over |B| = 4 -> .025.
    X = torch.tensor([[1.0, 0.0]] * 4, dtype=DT)
    cos = torch.tensor([1.0, 0.8, 0.1, 0.9], dtype=DT)
    T = torch.stack([cos, (1 - cos ** 2).sqrt()], dim=1)
    assert L.hnml(X, T, torch.tensor([[1], [-1], [-1], [-1]])).item() == pytest.approx(0.025)
    # now H_0 = {1, 3}: min(.8, .9) = .8 and the only normal negative is 2: 0
    assert L.hnml(X, T, torch.tensor([[3, 1], [-1, -1], [-1, -1], [-1, -1]])).item() == 0.0


def test_hnml_no_seeds_is_zero_with_zero_grads():
    X, T = unit(5, seed=6), unit(5, seed=7)
    out = L.hnml(X, T, -torch.ones(5, 2, dtype=torch.long))
    assert out.item() == 0.0
    gx, gt = grads(out, [X, T])
    assert not gx.any() and not gt.any()


@pytest.mark.parametrize("index,match", [([[0], [-1], [-1]], "own"), ([[1, 1], [-1, -1], [0, -1]],
                                          "repeats"), ([[3], [-1], [-1]], "padding")])
def test_hnml_rejects_bad_index(index, match):
    X = unit(3)
    with pytest.raises(ValueError, match=match):
        L.hnml(X, X, torch.tensor(index))


@pytest.mark.parametrize("symmetric", [True, False])
def test_helip_loss_parity(symmetric):
    n = 6
    X, T, s = unit(n, seed=8), unit(n, seed=9), param(5.0)
    H = rand_mask(n, n, 0.35, seed=10) & ~torch.eye(n, dtype=torch.bool)
    clip = naive_info_nce(X, T, s) if symmetric else naive_clip_i2t(X, T, s)
    naive = clip + 0.7 * naive_hnml(X, T, H)
    fast = L.helip_loss(X, T, s, mask_to_index(H), gamma=0.7, symmetric=symmetric)
    assert_parity(fast, naive, [X, T, s])


# --- DiHT ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha,beta", [(1.0, 0.25), (0.999, 0.5), (0.5, 2.0), (1.0, 0.0)])
def test_hn_nce_parity(alpha, beta):
    n = 6
    X, T, s = unit(n, seed=11), unit(n, seed=12), param(6.0)
    assert_parity(L.hn_nce(X, T, s, alpha, beta), naive_hn_nce(X, T, s, alpha, beta), [X, T, s])


def test_hn_nce_beta0_alpha1_is_info_nce():
    X, T, s = unit(7, seed=13), unit(7, seed=14), param(3.0)
    assert_parity(L.hn_nce(X, T, s, 1.0, 0.0), L.info_nce(X, T, s), [X, T, s], atol=1e-12)


def test_hn_nce_weights_average_one_over_negatives():
    # Orthonormal pairs: every negative has the same similarity, so w_ij = 1 exactly when the
    # weights are normalised by n - 1 (footnote 4) and beta cannot change anything.
    X = torch.eye(5, 8, dtype=DT)
    for beta in (0.25, 3.0):
        assert L.hn_nce(X, X, 4.0, 1.0, beta).item() == pytest.approx(
            L.info_nce(X, X, 4.0).item(), rel=1e-12)


def test_hn_nce_upweights_hard_negatives_and_alpha_dampens_positive():
    X, T = unit(8, seed=15), unit(8, seed=16)
    base = L.info_nce(X, T, 5.0).item()
    assert L.hn_nce(X, T, 5.0, 1.0, 0.5).item() > base       # mass moves to harder negatives
    assert L.hn_nce(X, T, 5.0, 0.5, 0.0).item() < base       # smaller alpha, smaller denominator


def test_hn_nce_float32_large_scale_is_finite_and_matches_float64():
    X, T = unit(16, d=4, seed=60), unit(16, d=4, seed=61)
    X32, T32 = X.detach().float().requires_grad_(), T.detach().float().requires_grad_()
    for s in (1.0, 100.0):                         # CLIP clamps the scale at 100
        ref, ref_g = L.hn_nce(X, T, s, 0.999, 0.5), None
        out = L.hn_nce(X32, T32, s, 0.999, 0.5)
        assert out.item() == pytest.approx(ref.item(), rel=1e-4)
        (g32,), (g64,) = grads(out, [X32]), grads(ref, [X])
        torch.testing.assert_close(g32.double(), g64, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("loss", ["hn_nce", "helip"])
def test_closed_form_backward_can_run_twice(loss):
    X, T, s = unit(6, seed=62), unit(6, seed=63), param(5.0)
    if loss == "hn_nce":
        out = L.hn_nce(X, T, s, 0.9, 0.5)
    else:
        out = L.helip_loss(X, T, s, torch.tensor([[1, 2], [0, -1], [-1, -1]] * 2))
    first, second = grads(out, [X, T, s]), grads(out, [X, T, s])
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_concept_ce_parity_padding_and_renormalisation():
    g = torch.Generator().manual_seed(17)
    logits = torch.randn(5, 9, generator=g, dtype=DT, requires_grad=True)
    idx = torch.tensor([[0, 3, 7], [2, -1, -1], [-1, -1, -1], [8, 1, 4], [5, 6, -1]])
    val = torch.rand(5, 3, generator=g, dtype=DT) + 0.1      # not normalised on purpose
    assert_parity(L.soft_target_cross_entropy(logits, idx, val),
                  naive_soft_ce(logits, idx, val), [logits])


def test_concept_ce_matches_dense_soft_cross_entropy():
    g = torch.Generator().manual_seed(18)
    logits = torch.randn(4, 6, generator=g, dtype=DT)
    idx = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(4)])
    val = torch.softmax(torch.randn(4, 3, generator=g, dtype=DT), dim=1)
    dense = torch.zeros(4, 6, dtype=DT).scatter(1, idx, val)
    assert L.soft_target_cross_entropy(logits, idx, val).item() == pytest.approx(
        TF.cross_entropy(logits, dense).item(), rel=1e-12)


def test_concept_ce_all_padding_is_zero():
    logits = torch.randn(3, 4, dtype=DT, requires_grad=True)
    out = L.soft_target_cross_entropy(logits, -torch.ones(3, 2, dtype=torch.long),
                                      torch.zeros(3, 2, dtype=DT))
    assert out.item() == 0.0 and not grads(out, [logits])[0].any()


def test_diht_objective_matches_paper_scale():
    # DiHT: sum_i [HN-NCE_i + CE-O_i + CE-A_i] == 2n (hn_nce + 0.5 concept_distillation_loss)
    n = 5
    X, T = unit(n, seed=19), unit(n, seed=20)
    g = torch.Generator().manual_seed(21)
    lo, la = torch.randn(n, 7, generator=g, dtype=DT), torch.randn(n, 4, generator=g, dtype=DT)
    io, ia = torch.randint(0, 7, (n, 2), generator=g), torch.randint(0, 4, (n, 1), generator=g)
    io[:, 1] = (io[:, 0] + 1) % 7
    vo, va = torch.softmax(torch.randn(n, 2, generator=g, dtype=DT), 1), torch.ones(n, 1, dtype=DT)
    paper = 2 * n * naive_hn_nce(X, T, 3.0, 1.0, 0.25) + n * (
        naive_soft_ce(lo, io, vo) + naive_soft_ce(la, ia, va))
    ours = 2 * n * (L.hn_nce(X, T, 3.0, 1.0, 0.25)
                    + 0.5 * L.concept_distillation_loss(lo, io, vo, la, ia, va))
    assert ours.item() == pytest.approx(paper.item(), rel=1e-10)


# --- FFF -----------------------------------------------------------------------------------------

def fff_mask(n_img: int, k: int, seed: int) -> torch.Tensor:
    """k captions per image (own captions positive) plus random mined positives."""
    own = torch.arange(n_img * k) // k
    return (own[None, :] == torch.arange(n_img)[:, None]) | rand_mask(n_img, n_img * k, 0.15, seed)


@pytest.mark.parametrize("kind", ["fff", "all_false", "all_true", "diag"])
def test_sigmoid_parity(kind):
    n, k = 4, 3
    X, T = unit(n, seed=22), unit(n * k, seed=23)
    t, b = param(10.0), param(-4.0)
    M = {"fff": fff_mask(n, k, 24), "all_false": torch.zeros(n, n * k, dtype=torch.bool),
         "all_true": torch.ones(n, n * k, dtype=torch.bool),
         "diag": torch.eye(n, n * k, dtype=torch.bool)}[kind]
    if kind == "fff":
        assert (M.sum(1) >= k).all() and (M.sum(1) > k).any()
    assert_parity(L.sigmoid_loss(X, T, t, b, M), naive_sigmoid(X, T, t, b, M), [X, T, t, b])


def test_sigmoid_decreases_when_positives_get_closer():
    n = 6
    X, T = unit(n, seed=25).detach(), unit(n, seed=26).detach()
    M = torch.eye(n, dtype=torch.bool)
    before = L.sigmoid_loss(X, T, 10.0, -5.0, M)
    closer = TF.normalize(T + 0.5 * X, dim=1)
    assert L.sigmoid_loss(X, closer, 10.0, -5.0, M) < before


def test_sigmoid_bias_init_minimises_initial_loss():
    t = 10.0
    batches = [(unit(4, seed=30 + i).detach(), unit(12, seed=40 + i).detach(), fff_mask(4, 3, i))
               for i in range(3)]
    sims = [x @ y.T for x, y, _ in batches]
    masks = [m for *_, m in batches]
    b = L.sigmoid_bias_init(sims, masks, t)

    plain = [(s.tolist(), m.tolist()) for s, m in zip(sims, masks)]

    def initial_loss(bias):                        # naive Eq. 2 in plain floats, loops over i, j
        total = 0.0
        for s, m in plain:                         # mean over batches of 1/n_img sum_ij
            for i in range(len(s)):
                for j in range(len(s[i])):
                    sign = 1.0 if m[i][j] else -1.0
                    total += math.log1p(math.exp(-sign * (t * s[i][j] + bias))) / len(s)
        return total / len(plain)

    grid = [-15 + 0.01 * k for k in range(2001)]   # the paper's alternative: a grid search
    best = min(grid, key=initial_loss)
    assert b == pytest.approx(best, abs=0.01)
    assert initial_loss(b) <= initial_loss(best) + 1e-12
    bt = param(b)                                  # and dL/db = 0 there
    loss = sum(L.sigmoid_loss(x, y, t, bt, m) for x, y, m in batches) / len(batches)
    assert abs(grads(loss, [bt])[0].item()) < 1e-5


def test_sigmoid_bias_init_degenerate_masks():
    s = [unit(3, seed=1).detach() @ unit(3, seed=2).detach().T]
    assert L.sigmoid_bias_init(s, [torch.zeros(3, 3, dtype=torch.bool)], 10.0) == -50.0
    assert L.sigmoid_bias_init(s, [torch.ones(3, 3, dtype=torch.bool)], 10.0) == 50.0


# --- UniCLIP -------------------------------------------------------------------------------------

def domain_params(scale=(4.0, 6.0, 5.0), offset=(0.3, -0.1, 0.2), w=(1 / 3, 1 / 2, 1.0)):
    vs = [torch.tensor(v, dtype=DT, requires_grad=True) for v in (scale, offset, w)]
    return vs, [L.pair_matrix(v, 2) for v in vs]


def test_pair_matrix_layout_and_grad():
    v = torch.tensor([1.0, 2.0, 3.0], dtype=DT, requires_grad=True)
    m = L.pair_matrix(v, 2)
    assert m.tolist() == [[1.0, 2.0], [2.0, 3.0]]
    assert grads(m.sum(), [v])[0].tolist() == [1.0, 2.0, 1.0]


def test_mp_nce_parity_multi_positive_multi_domain():
    n_img, n_txt = 4, 6
    Z = unit(n_img + n_txt, seed=50)
    dom = torch.tensor([0] * n_img + [1] * n_txt)
    P = rand_mask(10, 10, 0.3, seed=51)
    P = P | P.T                                   # symmetric positives, several per row
    P[3] = False
    P[:, 3] = False                                # an anchor with only its trivial pair
    (sv, ov, wv), (S, O, W) = domain_params()
    assert_parity(L.mp_nce(Z, dom, P, S, O, W), naive_mp_nce(Z, dom, P, S, O, W), [Z, sv, ov, wv])


def test_mp_nce_image_text_parity_and_all_positive_row():
    n = 3
    X, T = unit(n, seed=52), unit(2 * n, seed=53)
    M = fff_mask(n, 2, seed=54)
    tp = torch.zeros(2 * n, 2 * n, dtype=torch.bool)
    tp[0, 1] = tp[1, 0] = True                    # two captions of image 0 are positives
    (sv, ov, wv), (S, O, W) = domain_params()
    fast = L.mp_nce_image_text(X, T, M, S, O, W, text_pos=tp)
    Z = torch.cat([X, T])
    dom = torch.tensor([0] * n + [1] * 2 * n)
    P = torch.zeros(3 * n, 3 * n, dtype=torch.bool)
    P[:n, n:], P[n:, :n], P[n:, n:] = M, M.T, tp
    assert_parity(fast, naive_mp_nce(Z, dom, P, S, O, W), [X, T, sv, ov, wv])
    # every pair positive: no negatives, every term is -log(1) = 0 and gradients stay finite
    full = L.mp_nce_image_text(X, T, torch.ones(n, 2 * n, dtype=torch.bool), S, O, W,
                               torch.ones(n, n, dtype=torch.bool),
                               torch.ones(2 * n, 2 * n, dtype=torch.bool))
    assert full.item() == 0.0
    assert all(torch.isfinite(g).all() for g in grads(full, [X, T, sv, ov]))


def test_mp_nce_single_positive_is_info_nce():
    # one domain, only the trivial positive: Eq. 12 is Eq. 3 (InfoNCE / NT-Xent), offset cancels
    Z = unit(6, seed=55)
    one = torch.ones(1, 1, dtype=DT)
    out = L.mp_nce(Z, torch.zeros(6, dtype=torch.long), torch.zeros(6, 6, dtype=torch.bool),
                   3.0 * one, 0.4 * one, one)
    ref = TF.cross_entropy(3.0 * (Z @ Z.T), torch.arange(6))
    assert_parity(out, ref, [Z])


def test_mp_nce_cross_modal_reduces_to_clip():
    # image-text positives only, intra-domain weights 0 and intra similarities pushed to 0:
    # each anchor averages its (weight-0) trivial pair and its one pair, so MP-NCE = InfoNCE / 2.
    X, T = unit(5, seed=56), unit(5, seed=57)
    S = torch.full((2, 2), 4.0, dtype=DT)
    O = torch.tensor([[300.0, 0.0], [0.0, 300.0]], dtype=DT)
    W = torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=DT)
    out = L.mp_nce_image_text(X, T, torch.eye(5, dtype=torch.bool), S, O, W)
    assert_parity(out, 0.5 * L.info_nce(X, T, 4.0), [X, T], atol=1e-12)


def test_mp_nce_offsets_lose_one_dimension():
    # Eq. 15: a common shift of all offsets cancels (equal temperatures); a relative one does not
    Z = unit(8, seed=58)
    dom = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    P = rand_mask(8, 8, 0.3, seed=59)
    S, W = torch.full((2, 2), 5.0, dtype=DT), torch.ones(2, 2, dtype=DT)
    O = L.pair_matrix(torch.tensor([0.1, 0.3, -0.2], dtype=DT), 2)
    base = L.mp_nce(Z, dom, P, S, O, W).item()
    assert L.mp_nce(Z, dom, P, S, O + 0.37, W).item() == pytest.approx(base, rel=1e-12)
    shifted = O + torch.tensor([[0.2, 0.0], [0.0, 0.0]], dtype=DT)
    assert abs(L.mp_nce(Z, dom, P, S, shifted, W).item() - base) > 1e-4


def naive_domain_weights(dom, P, n_pairs):
    """UniCLIP Eq. 12's w_D, counted pair by pair: N over the number of (anchor, positive) pairs
    (p in P_i u {i}) of each unordered domain combination."""
    count = {}
    for i in range(len(dom)):
        for p in range(len(dom)):
            if p == i or P[i, p]:
                d = tuple(sorted((int(dom[i]), int(dom[p]))))
                count[d] = count.get(d, 0) + 1
    w = torch.zeros(2, 2, dtype=DT)
    for (a, b), c in count.items():
        w[a, b] = w[b, a] = n_pairs / c
    return w


def test_mp_domain_weights_paper_example():
    # UniCLIP sec. 2.2: three views of an image and one text per pair -> 9N ii, 6N it, N tt
    n = 4
    own_i = torch.arange(3 * n) % n                       # view v of pair i at v * n + i
    pos_it = own_i[:, None] == torch.arange(n)[None, :]
    pos, dom = L.unified_positives(pos_it, own_i[:, None] == own_i[None, :],
                                   torch.eye(n, dtype=torch.bool))
    w = L.mp_domain_weights(pos, dom, 2, n, dtype=DT)
    torch.testing.assert_close(w, torch.tensor([[1 / 9, 1 / 6], [1 / 6, 1.0]], dtype=DT))


def test_mp_nce_with_domain_weights_parity():
    # views, k texts per pair, mined positives in all three combinations: w_D from the batch
    n, views, k = 3, 2, 3
    X, T = unit(n * views, seed=60), unit(n * k, seed=61)
    own_i, own_t = torch.arange(n * views) % n, torch.arange(n * k) // k
    it = (own_i[:, None] == own_t[None, :]) | rand_mask(n * views, n * k, 0.1, seed=62)
    ii = (own_i[:, None] == own_i[None, :]) | (rand_mask(n * views, n * views, 0.1, seed=63))
    tt = (own_t[:, None] == own_t[None, :]) | (rand_mask(n * k, n * k, 0.1, seed=64))
    ii, tt = ii | ii.T, tt | tt.T
    pos, dom = L.unified_positives(it, ii, tt)
    W = L.mp_domain_weights(pos, dom, 2, n, dtype=DT)
    torch.testing.assert_close(W, naive_domain_weights(dom, pos, n))
    (sv, ov, _), (S, O, _) = domain_params()
    Z = torch.cat([X, T])
    fast = L.mp_nce(Z, dom, pos, S, O, W)
    assert_parity(fast, naive_mp_nce(Z, dom, pos, S, O, naive_domain_weights(dom, pos, n)),
                  [X, T, sv, ov])
    assert not W.requires_grad
    # a combination with no positive pair gets weight 0 (only images, no texts)
    only = L.mp_domain_weights(torch.zeros(4, 4, dtype=torch.bool), torch.zeros(4, dtype=torch.long), 2, 4)
    assert only.tolist() == [[1.0, 0.0], [0.0, 0.0]]


def test_losses_on_the_gpu_equal_the_cpu(cuda):
    """The same pure functions on CUDA tensors: values and gradients equal the CPU's (float64)."""
    n = 6
    H = mask_to_index(rand_mask(n, n, 0.35, seed=10) & ~torch.eye(n, dtype=torch.bool))
    M, P = fff_mask(2, 3, 24), rand_mask(2 * n, 2 * n, 0.3, seed=51)
    dom = torch.tensor([0] * n + [1] * n)
    cases = {
        "helip": lambda X, T, s, d: L.helip_loss(X, T, s, H.to(d), gamma=0.7),
        "hn_nce": lambda X, T, s, d: L.hn_nce(X, T, s, 0.999, 0.5),
        "sigmoid": lambda X, T, s, d: L.sigmoid_loss(X[:2], T, s, -s / 2, M.to(d)),
        "mp_nce": lambda X, T, s, d: L.mp_nce(torch.cat([X, T]), dom.to(d), P.to(d),
                                              *[L.pair_matrix(v * s / 5, 2) for v in (
                                                  torch.tensor([4.0, 6.0, 5.0], dtype=DT, device=d),
                                                  torch.tensor([.3, -.1, .2], dtype=DT, device=d),
                                                  torch.tensor([1 / 3, .5, 1.0], dtype=DT, device=d))]),
    }
    for name, loss in cases.items():
        out = {}
        for d in ("cpu", cuda):
            X, T, s = unit(n, seed=8), unit(n, seed=9), param(5.0)
            Xd, Td, sd = (v.detach().to(d).requires_grad_() for v in (X, T, s))
            value = loss(Xd, Td, sd, d)
            out[d] = [value] + [g.cpu() for g in grads(value, [Xd, Td, sd])]
        assert out[cuda][0].is_cuda, name
        for a, b in zip(out["cpu"], out[cuda]):
            torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-9, atol=1e-10, msg=name)


def test_indices_to_mask():
    m = L.indices_to_mask(torch.tensor([[1, -1], [0, 2], [-1, -1]]), 3)
    assert m.tolist() == [[False, True, False], [True, False, True], [False, False, False]]


# --- distributed ---------------------------------------------------------------------------------

SIZES = (3, 4)                                     # uneven local batches on purpose


def global_batch():
    X, T = unit(sum(SIZES), seed=60).detach(), unit(sum(SIZES), seed=61).detach()
    keys = torch.tensor([0, 1, 2, 0, 3, 1, 4])      # shared image ids, across ranks too
    return X, T, keys


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        X, T, keys = global_batch()
        lo, hi = sum(SIZES[:rank]), sum(SIZES[:rank + 1])
        x, t = X[lo:hi].clone().requires_grad_(), T[lo:hi].clone().requires_grad_()
        s = torch.tensor(4.0, dtype=DT, requires_grad=True)
        gx, gt = D.gather_with_grad(x), D.gather_with_grad(t)
        mask = D.global_key_mask(keys[lo:hi], keys[lo:hi])
        loss = L.info_nce(gx, gt, s) + L.sigmoid_loss(gx, gt, s, -2.0, mask)
        loss.backward()
        local_hard = torch.full((hi - lo, 2), -1)
        local_hard[0, 0] = 1                       # local seed 0 has local hard pair 1
        torch.save({"gx": gx.detach(), "x_grad": x.grad, "t_grad": t.grad, "s_grad": s.grad,
                    "loss": loss.detach(), "mask": mask, "rank": D.rank_world(),
                    "offset": D.rank_offset(hi - lo),
                    "index": D.globalize_index(local_hard, hi - lo),
                    "block": D.global_block_mask(torch.ones(hi - lo, 2 * (hi - lo),
                                                            dtype=torch.bool)),
                    "rows": D.local_rows(gx.detach(), hi - lo)}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_gather_with_grad_two_process_gloo(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    X, T, keys = global_batch()
    X.requires_grad_()
    T.requires_grad_()
    s = torch.tensor(4.0, dtype=DT, requires_grad=True)
    mask = keys[:, None] == keys[None, :]
    ref = L.info_nce(X, T, s) + L.sigmoid_loss(X, T, s, -2.0, mask)
    gX, gT, gs = grads(ref, [X, T, s])

    for r, out in enumerate(res):
        lo, hi = sum(SIZES[:r]), sum(SIZES[:r + 1])
        assert out["rank"] == (r, 2) and out["offset"] == lo
        torch.testing.assert_close(out["gx"], X.detach())          # rank order, trimmed
        torch.testing.assert_close(out["rows"], X.detach()[lo:hi])
        assert torch.equal(out["mask"], mask)                      # cross-rank positives kept
        assert out["loss"].item() == pytest.approx(ref.item(), rel=1e-12)
        # gradients reach both ranks' inputs: world_size * dL/dx of the global loss, which
        # DDP's averaging turns into exactly dL/dtheta
        assert out["x_grad"].abs().sum() > 0 and out["t_grad"].abs().sum() > 0
        torch.testing.assert_close(out["x_grad"], 2 * gX[lo:hi])
        torch.testing.assert_close(out["t_grad"], 2 * gT[lo:hi])
        torch.testing.assert_close(out["s_grad"], gs)           # not gathered: local grad
    # local hard index [[1, -1], ...] on each rank -> global index with the rank offset
    index = res[0]["index"]
    assert index[:, 0].tolist() == [1, -1, -1, 4, -1, -1, -1]
    assert (index[:, 1] == -1).all()
    block = res[0]["block"]
    assert block.shape == (7, 14) and block[:3, :6].all() and block[3:, 6:].all()
    assert int(block.sum()) == 3 * 6 + 4 * 8


def test_gather_is_noop_without_process_group():
    x = unit(3)
    assert D.gather_with_grad(x) is x
    assert D.rank_world() == (0, 1) and D.rank_offset(3) == 0
    assert D.globalize_index(torch.tensor([[1, -1]]), 3).tolist() == [[1, -1]]
    assert torch.equal(D.global_key_mask(torch.tensor([1, 2]), torch.tensor([2, 2, 1])),
                       torch.tensor([[False, False, True], [True, True, False]]))


# --- image groups: pairs taken out of the sums ----------------------------------------------------

def _naive_excluded_info_nce(X, T, s, ex):
    logits = s * (X @ T.T)
    keep = ~ex | torch.eye(len(X), dtype=torch.bool)
    i2t = [-(logits[i, i] - torch.logsumexp(logits[i][keep[i]], 0)) for i in range(len(X))]
    t2i = [-(logits[i, i] - torch.logsumexp(logits[:, i][keep[:, i]], 0)) for i in range(len(X))]
    return (torch.stack(i2t).mean() + torch.stack(t2i).mean()) / 2


def test_excluded_pairs_leave_every_sum():
    """Two captions of one image (rows 0-1, 2-4 share images) are no one's negatives: the loss
    equals the sums without them, and their similarities get no gradient."""
    n = 6
    X, T, s = unit(n, seed=21), unit(n, seed=22), param(4.0)
    g = torch.tensor([0, 0, 1, 1, 1, 2])
    ex = (g[:, None] == g[None, :]) & ~torch.eye(n, dtype=torch.bool)
    assert_parity(L.info_nce(X, T, s, exclude=ex), _naive_excluded_info_nce(X, T, s, ex), [X, T, s])
    assert_parity(L.hn_nce(X, T, s, 1.0, 0.0, exclude=ex), L.info_nce(X, T, s, exclude=ex),
                  [X, T, s], atol=1e-12)
    H = mask_to_index(torch.zeros(n, n, dtype=torch.bool))
    assert_parity(L.helip_loss(X, T, s, H, gamma=0.0, exclude=ex),
                  L.info_nce(X, T, s, exclude=ex), [X, T, s], atol=1e-12)
    # equal negatives: the weights average 1 over the negatives left (not n - 1)
    E = torch.eye(n, 8, dtype=DT)
    assert L.hn_nce(E, E, 4.0, 1.0, 2.0, exclude=ex).item() == pytest.approx(
        L.info_nce(E, E, 4.0, exclude=ex).item(), rel=1e-12)
    logits = (s * (X @ T.T)).detach().requires_grad_(True)
    L._clip_from_logits(L.excluded(logits, ex), True).backward()
    assert not logits.grad[ex].any() and logits.grad[~ex].abs().sum() > 0
