"""The papers' losses as pure functions of one (global) batch.

Conventions shared by every loss here:

- ``image_emb`` ``[n, d]`` and ``text_emb`` ``[m, d]`` are L2-normalised, so ``x @ t.T`` is the
  cosine similarity the papers write ``sim(.,.)``, ``x_i^T t_j`` or ``s_ij``. The losses do not
  normalise again (the model does; normalising twice would change nothing but the cost).
- ``scale`` is the inverse temperature ``1/tau`` (CLIP's ``exp(logit_scale)``); pass the model's
  tensor and its gradient flows. FFF calls it ``t``.
- Every loss is a mean over anchors, and the two directions of a symmetric loss are averaged
  (CLIP's convention), so a chance-level InfoNCE reads ``log n``. Where a paper writes a plain sum
  over the batch, the docstring says how its scale relates to ours.
- No collective happens here. Under DDP the trainer gathers embeddings with
  ``distributed.gather_with_grad`` and builds global masks/indices with the helpers there, then
  calls these functions on the global batch.
- Call them in float32 (or float64) outside autocast: the masks use the dtype's most negative
  finite value as "minus infinity", which keeps rows with no negatives free of NaN gradients.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as TF
from torch import Tensor

__all__ = [
    "info_nce", "hnml", "helip_loss", "hn_nce", "sigmoid_loss", "sigmoid_bias_init",
    "soft_target_cross_entropy", "concept_distillation_loss", "mp_nce", "mp_nce_image_text",
    "pair_matrix", "indices_to_mask", "unified_positives", "mp_domain_weights",
]


def _neg_inf(t: Tensor) -> float:
    return torch.finfo(t.dtype).min


def _eye(n: int, device: torch.device) -> Tensor:
    return torch.eye(n, dtype=torch.bool, device=device)


def _check_square(image_emb: Tensor, text_emb: Tensor, name: str) -> int:
    n = image_emb.shape[0]
    if text_emb.shape[0] != n:
        raise ValueError(f"{name} needs one text per image (paired batch), got {n} images and "
                         f"{text_emb.shape[0]} texts")
    return n


def indices_to_mask(index: Tensor, n_cols: int) -> Tensor:
    """``[n, k]`` column indices (``-1`` = padding) -> ``[n, n_cols]`` bool mask."""
    index = index.long()
    mask = torch.zeros(index.shape[0], n_cols + 1, dtype=torch.bool, device=index.device)
    mask.scatter_(1, torch.where(index < 0, n_cols, index), True)
    return mask[:, :n_cols]


# --- CLIP ----------------------------------------------------------------------------------------

def _clip_from_logits(logits: Tensor, symmetric: bool) -> Tensor:
    labels = torch.arange(logits.shape[0], device=logits.device)
    i2t = TF.cross_entropy(logits, labels)
    return (i2t + TF.cross_entropy(logits.T, labels)) / 2 if symmetric else i2t


def excluded(logits: Tensor, exclude: Optional[Tensor]) -> Tensor:
    """``logits`` with the pairs in ``exclude`` (``[n, n]`` bool, never the diagonal: e.g. two
    captions of one image) taken out of every denominator: they are no one's negatives."""
    if exclude is None:
        return logits
    return logits.masked_fill(exclude & ~_eye(logits.shape[0], logits.device), _neg_inf(logits))


def info_nce(image_emb: Tensor, text_emb: Tensor, scale: Tensor | float,
             exclude: Optional[Tensor] = None) -> Tensor:
    """CLIP's symmetric InfoNCE (HELIP Eq. 1, DiHT sec. 3.3 "NCE"), with ``L = scale * X T^T``:

        L_NCE = 1/(2n) sum_i [ -log(e^{L_ii} / sum_j e^{L_ij}) - log(e^{L_ii} / sum_j e^{L_ji}) ]

    DiHT writes the plain sum over i of both terms, i.e. ``2n`` times this value. The pairs in
    ``exclude`` are left out of the sums (``excluded``).
    """
    _check_square(image_emb, text_emb, "info_nce")
    return _clip_from_logits(excluded(scale * (image_emb @ text_emb.T), exclude), symmetric=True)


# --- HELIP ---------------------------------------------------------------------------------------

def _check_hard_index(hard_index: Tensor, n_cols: int) -> Tensor:
    """Validated ``[n, p]`` hard index with the padding (-1) replaced by the row's own index."""
    idx = hard_index.long()
    if idx.dim() != 2:
        raise ValueError(f"hard_index must be [n, p], got shape {tuple(idx.shape)}")
    rows = torch.arange(idx.shape[0], device=idx.device)[:, None]
    lo, hi = idx.aminmax()
    if not (-1 <= int(lo) and int(hi) < n_cols):
        raise ValueError(f"hard_index entries must be -1 (padding) or in [0, {n_cols})")
    if bool((idx == rows).any()):
        raise ValueError("hard_index lists a pair as its own hard negative")
    if idx.shape[1] > 1:
        srt = idx.sort(dim=1).values
        if bool(((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any()):
            raise ValueError("hard_index repeats a hard pair within a row")
    return torch.where(idx < 0, rows, idx)


class _Hnml(torch.autograd.Function):
    """HELIP's l_margin from the cosine matrix, with the gradient in closed form.

    With ``m_i = min_{j' in H_i} s_ij'`` (at column ``a_i``) and ``A_i`` the normal negatives whose
    hinge is active (``s_ij > m_i``): ``d/ds_ij = 1`` for ``j in A_i`` and ``d/ds_{i a_i} = -|A_i|``
    (times ``1 / (|B| n_seeds)``). Padding entries of ``index`` point at the row's own (diagonal)
    column, which is excluded anyway. One [n, m] buffer is kept for the backward.
    """

    @staticmethod
    def forward(ctx, cos: Tensor, index: Tensor, valid: Tensor) -> Tensor:
        hard_cos = cos.gather(1, index).masked_fill_(~valid, torch.finfo(cos.dtype).max)
        min_hard, arg = hard_cos.min(dim=1, keepdim=True)           # +max on non-seed rows
        h = (cos - min_hard).relu_()                               # non-seed rows: all 0
        h.diagonal().zero_()                                       # j = i: the positive
        h.scatter_(1, index, 0)                                    # j in H_i: the hard pairs
        norm = cos.shape[1] * max(int(valid.any(dim=1).sum()), 1)  # |B| * number of seeds
        total = h.sum() / norm
        active = h.sign_()
        ctx.norm = norm
        ctx.save_for_backward(active, index.gather(1, arg), active.sum(dim=1, keepdim=True))
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        active, argcol, count = ctx.saved_tensors
        c = grad / ctx.norm
        g = active * c                          # not in place: a retained graph may run again
        g.scatter_add_(1, argcol, count * -c)
        return g, None, None


def _hnml_from_cos(cos: Tensor, hard_index: Tensor) -> Tensor:
    return _Hnml.apply(cos, _check_hard_index(hard_index, cos.shape[1]), hard_index >= 0)


def hnml(image_emb: Tensor, text_emb: Tensor, hard_index: Tensor) -> Tensor:
    """HELIP's hard negative margin loss (Eq. 6) on cosine similarities ``s_ij = sim(I_i, T_j)``:

        l_margin(i) = 1/|B| sum_{j in B \ ({i} u H_i^p)} max(0, s_ij - min_{j' in H_i^p} s_ij')
        l_margin    = mean over seeds i (rows with H_i^p non-empty) of l_margin(i)

    ``hard_index`` ``[n, p]`` lists, for each row i, the batch positions of the hard pairs
    ``H_i^p`` mined for seed i and put in the batch with it (HELIP Alg. 3; ``p = 1`` by default
    there), ``-1`` padding; a row of ``-1`` is not a seed. Entries must differ from i and within a
    row. ``indices_to_mask`` turns it into the ``[n, n]`` mask. Choices where Eq. 6 is loose (it
    leaves ``i`` free and lets ``j`` run over all of B):

    - ``j`` runs over the *normal* negatives ``B \ ({i} u H_i^p)``. Taken literally, ``j = i``
      would penalise the positive for being more similar than the hard negatives, and ``j`` in
      ``H_i^p`` would pull the hard negatives together; neither is the geometry of Fig. 2/3
      ("hard negatives closer to the positive than the normal negatives").
    - ``|B|`` is the size of the batch the loss sees (hard pairs included), as printed; it is not
      the number of normal negatives.
    - Eq. 6 is per seed; the batch value is the mean over seeds, 0 when there is none. Only
      the image anchor is used (``sim(I_i, T_j)``), as printed.
    - The similarity is the raw cosine (no temperature): "no extra inner product computation is
      required"; ``helip_loss`` reuses the CLIP matmul for it.
    """
    _check_square(image_emb, text_emb, "hnml")
    return _hnml_from_cos(image_emb @ text_emb.T, hard_index)


def helip_loss(image_emb: Tensor, text_emb: Tensor, scale: Tensor | float, hard_index: Tensor,
               gamma: float = 1.0, symmetric: bool = True,
               exclude: Optional[Tensor] = None) -> Tensor:
    """HELIP's fine-tuning loss (Eq. 7): ``l_finetune = l_CLIP + gamma * l_margin`` (``hnml``).

    ``l_CLIP`` is ``info_nce`` on ``scale * cos`` with ``symmetric=True`` (the loss the CLIP and
    SLIP checkpoints HELIP fine-tunes were trained with); HELIP's Eq. 1 prints only its
    image->text half, which ``symmetric=False`` gives. One matmul serves both terms. The paper's
    default is ``gamma = 1``. The pairs in ``exclude`` are left out of ``l_CLIP``'s sums.
    """
    _check_square(image_emb, text_emb, "helip_loss")
    cos = image_emb @ text_emb.T
    return _clip_from_logits(excluded(scale * cos, exclude), symmetric) + \
        gamma * _hnml_from_cos(cos, hard_index)


# --- DiHT ----------------------------------------------------------------------------------------

class _HnNce(torch.autograd.Function):
    """Both HN-NCE directions from the logits, with the gradient in closed form.

    Per direction (anchor i, candidates j != i), with ``x_ij = L_ij - max_{j != i} L_ij``:
    ``S_a = sum_j e^{(1+beta) x_ij}``, ``S_b = sum_j e^{beta x_ij}``,
    ``log_neg_i = log(n-1) + log S_a - log S_b + max_j L_ij`` (the reweighted negative mass),
    ``l_i = logaddexp(log alpha + L_ii, log_neg_i) - L_ii`` and, with
    ``q_i = sigmoid(log_neg_i - log alpha - L_ii)``:
    ``dl_i/dL_ii = -q_i`` and
    ``dl_i/dL_ij = q_i ((1+beta) e^{(1+beta) x_ij} / S_a - beta e^{beta x_ij} / S_b)``.
    The stabiliser is the off-diagonal maximum, so ``S_a, S_b >= 1`` (no underflow to log 0 even
    at scale 100 in float32). Two exponentials per direction and a backward of four fused
    multiply-adds replace four masked logsumexps and their autograd graph.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, alpha: float, beta: float,
                negatives: Optional[Tensor] = None) -> Tensor:
        n = logits.shape[0]
        off = logits.clone()
        off.diagonal().fill_(float("-inf"))
        diag = logits.diagonal()
        log_alpha = math.log(alpha)
        total = logits.new_zeros(())
        saved = []
        for dim in (1, 0):                      # dim 1: image anchors (rows); dim 0: text anchors
            m = off.amax(dim=dim, keepdim=True)
            x = off - m
            if beta:
                xb = beta * x
                eb = torch.exp(xb)
                ea = torch.exp(x + xb)
                sa, sb = ea.sum(dim), eb.sum(dim)
                log_n1 = math.log(n - 1) if negatives is None else negatives.sum(dim).clamp(min=1).log()
                log_neg = log_n1 + sa.log() - sb.log() + m.squeeze(dim)
            else:
                eb = sb = None
                ea = torch.exp(x)
                sa = ea.sum(dim)
                log_neg = sa.log() + m.squeeze(dim)
            pos = log_alpha + diag
            total = total + (torch.logaddexp(pos, log_neg) - diag).mean()
            saved.append((ea, sa, eb, sb, torch.sigmoid(log_neg - pos)))
        ctx.beta, ctx.n = beta, n
        ctx.saved = saved
        return total / 2

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        beta, n = ctx.beta, ctx.n
        c = grad / (2 * n)
        out = None
        for dim, (ea, sa, eb, sb, q) in zip((1, 0), ctx.saved):
            cq = c * q
            g = ea * (cq * (1 + beta) / sa).unsqueeze(dim)
            if eb is not None:
                g.addcmul_(eb, (cq * beta / sb).unsqueeze(dim), value=-1)
            g.diagonal().sub_(cq)
            out = g if out is None else out.add_(g)
        return out, None, None, None


def hn_nce(image_emb: Tensor, text_emb: Tensor, scale: Tensor | float, alpha: float = 1.0,
           beta: float = 0.0, exclude: Optional[Tensor] = None) -> Tensor:
    """DiHT's hard-negative NCE (sec. 3.3), with ``L = scale * X T^T`` (``L_ij = x_i^T t_j / tau``):

        l_i2t(i) = -log[ e^{L_ii} / ( alpha e^{L_ii} + sum_{j != i} w_ij e^{L_ij} ) ]
        w_ij     = (n - 1) e^{beta L_ij} / sum_{k != i} e^{beta L_ik}
        l_t2i(i) = the same on L^T (weights normalised over the images k != i of text i)
        HN-NCE   = 1/(2n) sum_i [ l_i2t(i) + l_t2i(i) ]

    As in the paper: the weights are normalised to average 1 over the ``n - 1`` negatives
    (footnote 4), the positive is outside both the reweighting and that normalisation, and
    ``beta`` multiplies the temperature-scaled similarity. The weights are functions of the
    embeddings and are *not* detached (the equation has no stop-gradient). ``alpha = 1, beta = 0``
    is ``info_nce`` exactly. DiHT's Table A.2 uses ``alpha, beta = (1.0, 0.25)`` on LAION and
    ``(0.999, 0.5)`` on PMD. DiHT sums over i (``2n`` times this value). The pairs in
    ``exclude`` are no negatives: out of the sums, and the weights average 1 over the others.
    """
    n = _check_square(image_emb, text_emb, "hn_nce")
    if n < 2:
        raise ValueError("hn_nce needs at least 2 pairs (one negative)")
    if not (alpha > 0 and beta >= 0):
        raise ValueError(f"hn_nce needs alpha > 0 and beta >= 0, got {alpha}, {beta}")
    logits = excluded(scale * (image_emb @ text_emb.T), exclude)
    negatives = None if exclude is None else \
        (~exclude & ~_eye(n, logits.device)).to(torch.promote_types(logits.dtype, torch.float32))
    return _HnNce.apply(logits, float(alpha), float(beta), negatives)


def soft_target_cross_entropy(logits: Tensor, target_index: Tensor,
                              target_value: Tensor) -> Tensor:
    """Cross-entropy against sparse soft targets (DiHT's top-k teacher pseudo-labels):

        CE(i) = -sum_k p_ik log softmax(logits_i)[c_ik],   p_ik = v_ik / sum_k' v_ik'

    ``target_index`` ``[n, k]`` holds class ids ``c_ik`` (``-1`` = padding, for images with
    fewer than k concepts) and ``target_value`` ``[n, k]`` their teacher probabilities. The
    values are re-normalised over the valid entries (DiHT sec. 3.2 re-normalises the top-k; doing
    it again is a no-op on clean targets and absorbs storage rounding). Rows with no valid
    target (or only zero values) are left out; the result is the mean over the other rows (0 if
    none).
    """
    valid = target_index >= 0
    v = target_value.to(logits.dtype).masked_fill(~valid, 0)
    total = v.sum(dim=1)
    has = total > 0
    p = v / total.clamp_min(torch.finfo(v.dtype).tiny)[:, None]
    # sum_k p_k (lse - logit_c) = lse - sum_k p_k logit_c, as sum_k p_k = 1 on rows with targets:
    # no [n, C] log_softmax is materialised, only the per-row logsumexp.
    picked = (p * logits.gather(1, target_index.long().clamp_min(0))).sum(dim=1)
    per_row = (torch.logsumexp(logits, dim=1) - picked).masked_fill(~has, 0)
    return per_row.sum() / has.sum().clamp_min(1)


def concept_distillation_loss(obj_logits: Tensor, obj_index: Tensor, obj_value: Tensor,
                              attr_logits: Tensor, attr_index: Tensor,
                              attr_value: Tensor) -> Tensor:
    """DiHT's concept distillation terms (sec. 3.4, A.1.2): ``CE-O + CE-A``, where
    ``CE-O = mean_i CE(p_i^obj, f_obj(x_i))`` and ``CE-A`` likewise on the attribute head; each
    CE is ``soft_target_cross_entropy`` on the head's logits (the linear heads are model
    parameters, applied by the model to the image embedding ``x_i``).

    DiHT minimises ``sum_i [HN-NCE_i + CE-O_i + CE-A_i]`` where HN-NCE_i sums the two directions;
    that is ``2n * (hn_nce(...) + 0.5 * concept_distillation_loss(...))``, so weight this loss by
    0.5 next to ``hn_nce`` to keep the paper's balance.
    """
    return (soft_target_cross_entropy(obj_logits, obj_index, obj_value)
            + soft_target_cross_entropy(attr_logits, attr_index, attr_value))


# --- FFF -----------------------------------------------------------------------------------------

def sigmoid_loss(image_emb: Tensor, text_emb: Tensor, t: Tensor | float, b: Tensor | float,
                 pos_mask: Tensor) -> Tensor:
    """FFF's multi-positive sigmoid loss (Eq. 2) on ``s_ij = cos(x_i, t_j)``:

        L = 1/n_img sum_i sum_j log(1 + exp(-m_ij (t s_ij + b))),  m_ij = +1 if M_ij else -1

    ``pos_mask`` is FFF's assignment matrix M ``[n_img, n_txt]`` (the image's own captions and
    recaptions plus mined positives), so the matrix may be rectangular. ``t`` (inverse
    temperature, FFF's learnable scale) and the learnable bias ``b`` may be tensors. Eq. 2's
    normaliser ``1/|B|`` is read as the number of images (rows), as in SigLIP, whose loss this is.
    """
    logits = t * (image_emb @ text_emb.T) + b
    return TF.binary_cross_entropy_with_logits(
        logits, pos_mask.to(logits.dtype), reduction="sum") / logits.shape[0]


@torch.no_grad()
def sigmoid_bias_init(similarities: Sequence[Tensor], pos_masks: Sequence[Tensor],
                      t: float, lo: float = -50.0, hi: float = 50.0, tol: float = 1e-6) -> float:
    """FFF sec. 4.4's bias initialisation: the ``b`` minimising the initial sigmoid loss.

    FFF stores the cosine similarities of ``b`` batches under the randomly initialised model and
    searches the bias that minimises the initial loss with everything else frozen ("by gradient
    descent or grid search"). The objective, the mean over batches of ``sigmoid_loss``, is convex
    in ``b`` and its derivative

        g(b) = mean_batches 1/n_img sum_ij [ sigmoid(t s_ij + b) - M_ij ]

    is increasing, so the minimiser is the root of ``g``, found here by bisection on
    ``[lo, hi]`` to ``tol``: the exact minimiser rather than a grid point. With no positives at
    all the infimum is at ``b -> -inf`` and ``lo`` is returned (``hi`` when everything is
    positive).
    """
    if len(similarities) != len(pos_masks) or not similarities:
        raise ValueError("sigmoid_bias_init needs one positive mask per similarity matrix")
    z = [t * s.double() for s in similarities]
    m = [pm.double() for pm in pos_masks]

    def grad(b: float) -> float:
        return sum(float((torch.sigmoid(zi + b) - mi).sum()) / zi.shape[0]
                   for zi, mi in zip(z, m)) / len(z)

    if grad(lo) >= 0:
        return lo
    if grad(hi) <= 0:
        return hi
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if grad(mid) < 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# --- UniCLIP -------------------------------------------------------------------------------------

class _Gram(torch.autograd.Function):
    """``Z Z^T`` with the symmetric backward ``(G + G^T) Z``: one matmul instead of two."""

    @staticmethod
    def forward(ctx, z: Tensor) -> Tensor:
        ctx.save_for_backward(z)
        return z @ z.T

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (z,) = ctx.saved_tensors
        return (grad + grad.T) @ z


def pair_matrix(values: Tensor, n_domains: int) -> Tensor:
    """Per-domain-combination values -> the symmetric ``[K, K]`` matrix ``mp_nce`` indexes.

    ``values`` lists the upper triangle row by row (for image=0, text=1: ``[ii, it, tt]``), so a
    learnable ``tau``/``b`` per unordered combination ``D(i, j)`` keeps its gradient.
    """
    r, c = torch.triu_indices(n_domains, n_domains, device=values.device)
    if values.shape[0] != r.shape[0]:
        raise ValueError(f"{n_domains} domains have {r.shape[0]} combinations, got "
                         f"{values.shape[0]} values")
    idx = torch.empty(n_domains, n_domains, dtype=torch.long, device=values.device)
    k = torch.arange(r.shape[0], device=values.device)
    idx[r, c] = k
    idx[c, r] = k
    return values[idx]


def mp_nce(emb: Tensor, domains: Tensor, pos_mask: Tensor, scale: Tensor, offset: Tensor,
           weights: Tensor) -> Tensor:
    """UniCLIP's MP-NCE (Eq. 12) with the domain-dependent similarity (Eq. 16).

    ``emb`` ``[M, d]`` is the unified batch (image views and texts in one space), ``domains``
    ``[M]`` the domain id of each row, ``pos_mask[i, j]`` True when j is in ``P_i``. With
    ``D = D(i, j) = (domains[i], domains[j])``:

        s_ij   = exp( scale_D (cos(z_i, z_j) - offset_D) )                         (Eq. 16)
        L_i    = mean_{p in P_i u {i}} -w_D(i,p) log(s_ip / (s_ip + sum_{n in N_i} s_in))
        MP-NCE = mean_i L_i                                                         (Eq. 12)

    ``scale`` (= 1/tau_D), ``offset`` (b_D) and ``weights`` (w_D) are ``[K, K]`` matrices indexed
    by the domain combination; build them from per-combination values with ``pair_matrix`` (the
    paper has one value per unordered combination: ii, it, tt). The trivial pair (i, i) is always
    a positive (Eq. 11), whatever ``pos_mask`` says on the diagonal; the negatives ``N_i`` are all
    other rows not in ``P_i``, from every domain. The paper leaves the batch reduction implicit;
    it is the mean over all anchors of the unified batch. Each positive's term is the softplus
    ``log(1 + sum_n s_in / s_ip)``, which is 0 (not NaN) when a row has no negatives.
    UniCLIP's example weights: three image views and one text per pair give 9N image-image, 6N
    image-text and N text-text positives, so w = 1/9, 1/6, 1.
    """
    m = emb.shape[0]
    pos = pos_mask | _eye(m, emb.device)
    onehot = TF.one_hot(domains.long(), scale.shape[0]).to(emb.dtype)              # [M, K]
    # per-pair scale_D and scale_D * offset_D as rank-K products: no [M, M] gathers
    logits = ((onehot @ scale @ onehot.T) * _Gram.apply(emb)
              - onehot @ (scale * offset) @ onehot.T)
    neg_lse = torch.logsumexp(logits.masked_fill(pos, _neg_inf(logits)), dim=1)
    # -log(s_ip / (s_ip + sum_n s_in)) = softplus(lse_n - log s_ip), only at the positives
    r, c = pos.nonzero(as_tuple=True)
    term = TF.softplus(neg_lse[r] - logits[r, c]) * weights[domains[r], domains[c]]
    per_anchor = torch.zeros(m, dtype=term.dtype, device=term.device).index_add(0, r, term)
    return (per_anchor / pos.sum(dim=1)).mean()


def unified_positives(pos_it: Tensor, image_pos: Tensor, text_pos: Tensor) -> tuple[Tensor, Tensor]:
    """The unified batch ``[images; texts]`` of UniCLIP: its ``[n + m, n + m]`` positive mask
    (``image_pos`` ``[n, n]``, ``pos_it`` ``[n, m]`` and its transpose, ``text_pos`` ``[m, m]``)
    and the domain of each row (image = 0, text = 1)."""
    n, m = pos_it.shape
    pos = torch.cat([torch.cat([image_pos, pos_it], 1), torch.cat([pos_it.T, text_pos], 1)])
    domains = torch.cat([torch.zeros(n, dtype=torch.long, device=pos_it.device),
                         torch.ones(m, dtype=torch.long, device=pos_it.device)])
    return pos, domains


@torch.no_grad()
def mp_domain_weights(pos_mask: Tensor, domains: Tensor, n_domains: int, n_pairs: int,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """UniCLIP's balancing weights ``w_D`` (Eq. 12): ``w_D = N / |{(i, p): p in P_i u {i},
    D(i, p) = D}|``, the number of original pairs ``N`` over the number of positive pairs of the
    domain combination D in the batch, so that each combination contributes equally. Pairs are
    ordered and include the trivial one, as in the paper's example (three views of an image and
    one text: 9N image-image, 6N image-text, N text-text pairs, so w = 1/9, 1/6, 1). Returns the
    ``[K, K]`` symmetric matrix ``mp_nce`` takes; a combination with no positive pair gets 0 (no
    term uses it). Hyperparameters of the loss: no gradient flows through them.
    """
    pos = pos_mask | _eye(pos_mask.shape[0], pos_mask.device)
    pair = domains[:, None] * n_domains + domains[None, :]            # ordered (D_i, D_p) id
    counts = torch.bincount(pair[pos], minlength=n_domains * n_domains).view(n_domains, n_domains)
    counts = counts + counts.T - torch.diag(counts.diagonal())        # unordered combination
    w = n_pairs / counts.to(dtype).clamp_min(1)
    return w.masked_fill(counts == 0, 0.0)


def mp_nce_image_text(image_emb: Tensor, text_emb: Tensor, pos_mask: Tensor, scale: Tensor,
                      offset: Tensor, weights: Tensor, image_pos: Tensor | None = None,
                      text_pos: Tensor | None = None) -> Tensor:
    """``mp_nce`` on the unified batch ``[images; texts]`` (domains image = 0, text = 1).

    ``pos_mask`` ``[n, m]`` are the image-text positives (e.g. FFF's M); ``image_pos`` ``[n, n]``
    and ``text_pos`` ``[m, m]`` the intra-domain positives (views of one image, captions of one
    image), by default none besides the trivial pairs. ``scale``/``offset``/``weights`` are
    ``[2, 2]`` (see ``pair_matrix``; ``mp_domain_weights`` gives the paper's ``w_D``).
    """
    n, m = image_emb.shape[0], text_emb.shape[0]
    dev = image_emb.device
    image_pos = _eye(n, dev) if image_pos is None else image_pos
    text_pos = _eye(m, dev) if text_pos is None else text_pos
    pos, domains = unified_positives(pos_mask, image_pos, text_pos)
    return mp_nce(torch.cat([image_emb, text_emb]), domains, pos, scale, offset, weights)
