"""Cross-rank plumbing for the losses: a gradient-keeping all_gather and global labels/masks.

The losses in ``losses.py`` are pure functions of one batch. Under DDP each rank gathers the
embeddings of all ranks with ``gather_with_grad`` (rank order, so rank r's rows start at
``rank_offset``), builds the matching global masks/indices with the helpers below, and computes
the *same* global loss. ``gather_with_grad``'s backward sums the gradient that every rank's copy
of the loss sends to a rank's rows, so each input receives ``world_size * dL/dx``; DDP's gradient
averaging then divides by ``world_size`` and the parameters get exactly ``dL/dtheta`` of the
global-batch loss (the scheme open_clip uses with ``gather_with_grad`` and ``local_loss=False``).
If each rank instead computes a loss over its own anchors only (``local_rows``), the same sum
gives ``d(sum_r L_r)/dx`` and DDP's average the gradient of the mean of the per-rank losses.

Every function is a no-op (or the single-rank answer) when torch.distributed is not initialised.
Local batches may differ in size between ranks (a short last batch): gathers pad to the largest
and trim.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["rank_world", "gather_with_grad", "gather_no_grad", "local_sizes", "rank_offset",
           "globalize_index", "global_block_mask", "global_key_mask", "local_rows"]


def _active(group=None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank_world(group=None) -> tuple[int, int]:
    """(rank, world size); (0, 1) when not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def local_sizes(n_local: int, device: torch.device | str = "cpu", group=None) -> list[int]:
    """Every rank's local batch size, in rank order."""
    if not _active(group):
        return [n_local]
    mine = torch.tensor([n_local], dtype=torch.long, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [int(x) for x in out]


def _gather(t: Tensor, sizes: list[int], group) -> Tensor:
    pad = max(sizes) - t.shape[0]
    src = t.contiguous() if pad == 0 else torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    out = [torch.empty_like(src) for _ in sizes]
    dist.all_gather(out, src, group=group)
    return torch.cat([o[:n] for o, n in zip(out, sizes)])


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, group) -> Tensor:
        sizes = local_sizes(t.shape[0], t.device, group)
        rank = dist.get_rank(group)
        ctx.group, ctx.start, ctx.n = group, sum(sizes[:rank]), t.shape[0]
        return _gather(t, sizes, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.start:ctx.start + ctx.n], None


def gather_with_grad(t: Tensor, group=None) -> Tensor:
    """Concatenate ``t`` ``[n_r, ...]`` of every rank along dim 0 (rank order), keeping gradients.

    The backward all-reduces (sums) the gradient of the gathered tensor and hands each rank the
    slice of its own rows: with every rank computing the same global loss L, rank r's input
    receives ``world_size * dL/dx_r`` (see the module docstring for why that is what DDP wants).
    Works on gloo and nccl; returns ``t`` itself when not distributed.
    """
    if not _active(group):
        return t
    return _GatherWithGrad.apply(t, group)


def gather_no_grad(t: Tensor, group=None) -> Tensor:
    """All-gather without autograd (labels, masks, keys); ``t`` itself when not distributed."""
    if not _active(group):
        return t
    with torch.no_grad():
        return _gather(t, local_sizes(t.shape[0], t.device, group), group)


def rank_offset(n_local: int, device: torch.device | str = "cpu", group=None) -> int:
    """Index of this rank's first row in the gathered batch (sum of lower ranks' sizes)."""
    rank, _ = rank_world(group)
    return sum(local_sizes(n_local, device, group)[:rank])


def globalize_index(local_index: Tensor, n_target_local: int, group=None) -> Tensor:
    """Local indices -> the global batch's indices, gathered from every rank.

    ``local_index`` ``[n, ...]`` holds indices into this rank's local *target* batch (of size
    ``n_target_local``; e.g. the texts an image's labels point at, or a seed's hard pairs), with
    ``-1`` for padding. Each rank adds the offset of its local target batch, then the rows are
    gathered: row i of the result belongs to global anchor i. Pairs across ranks cannot be
    expressed this way; use ``global_key_mask`` for those.
    """
    offset = rank_offset(n_target_local, local_index.device, group)
    shifted = torch.where(local_index >= 0, local_index + offset, local_index)
    return gather_no_grad(shifted, group)


def global_block_mask(local_mask: Tensor, group=None) -> Tensor:
    """Local ``[n_r, m_r]`` masks of every rank -> the block-diagonal global ``[N, M]`` mask.

    For relations that only hold inside a local batch (a seed and the hard pairs the loader put
    in its batch, an image and its own captions). Everything across ranks is False.
    """
    if not _active(group):
        return local_mask
    dev = local_mask.device
    rows = local_sizes(local_mask.shape[0], dev, group)
    cols = local_sizes(local_mask.shape[1], dev, group)
    rank = dist.get_rank(group)
    c0 = sum(cols[:rank])
    wide = torch.zeros(local_mask.shape[0], sum(cols), dtype=local_mask.dtype, device=dev)
    wide[:, c0:c0 + local_mask.shape[1]] = local_mask
    return gather_no_grad(wide, group)


def global_key_mask(row_keys: Tensor, col_keys: Tensor, group=None) -> Tensor:
    """``mask[i, j] = key_row[i] == key_col[j]`` over the gathered keys of every rank.

    For relations given by a shared id, which hold across ranks too (e.g. image id: an image and
    every caption or recaption of it, wherever they landed). Keys are integer ``[n]`` tensors.
    """
    r = gather_no_grad(row_keys, group)
    c = gather_no_grad(col_keys, group)
    return r[:, None] == c[None, :]


def local_rows(global_t: Tensor, n_local: int, group=None) -> Tensor:
    """This rank's rows of a gathered tensor (e.g. to compute a loss on local anchors only)."""
    start = rank_offset(n_local, global_t.device, group)
    return global_t[start:start + n_local]
