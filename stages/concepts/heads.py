"""DiHT's teacher heads (paper sec. 3.2, appendix A.1.2): linear classifiers for objects and for
attributes on frozen teacher features, and the top-k soft targets they predict.

Training, as in the appendix (the SWAG linear-classifier recipe):

* soft-target cross-entropy: an image with K concepts has target 1/K on each, 0 elsewhere;
* inverse square-root resampling: image i is drawn (with replacement) with probability
  proportional to ``max_{c in i} n_c ** -0.5`` (n_c: images with concept c), so a concept's share
  of the draws goes from n_c to about sqrt(n_c): the tail is upsampled. The max (not the mean)
  over an image's concepts is our choice: an image is upsampled for its rarest concept;
* ``resample_length`` draws per epoch (DiHT: a 50M-sample resampled dataset; default: as many
  draws as training images), ``epochs`` epochs;
* SGD, momentum 0.9, weight decay 1e-4, lr = base_lr * batch_size / 256 (the linear scaling
  rule; DiHT: base 0.001 at 64 x 256 images per step), cosine decay to 0 over all steps (DiHT
  gives no schedule; this is ours);
* features standardised per dimension (mean/std of the training images, kept with the head);
  weights start at zero (the problem is convex), so a seed fixes the result.

Visualness of an attribute (for the DiHT/[61] attribute selection): the ROC AUC of its head's
logit on held-out images (``holdout_fraction``), trained on the rest: an attribute the frozen
teacher cannot see in images scores near 0.5.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

MIN_HOLDOUT_POSITIVES = 5   # fewer held-out images with the attribute: visualness not measured


@dataclass
class Head:
    mean: np.ndarray      # (d,)
    std: np.ndarray       # (d,)
    weight: np.ndarray    # (C, d)
    bias: np.ndarray      # (C,)

    def logits(self, x: np.ndarray) -> np.ndarray:
        z = (np.asarray(x, np.float32) - self.mean) / self.std
        return z @ self.weight.T + self.bias

    def save(self, path: str) -> None:
        np.savez(path, mean=self.mean, std=self.std, weight=self.weight, bias=self.bias)

    @classmethod
    def load(cls, path: str) -> "Head":
        with np.load(path) as f:
            return cls(f["mean"], f["std"], f["weight"], f["bias"])


def resample_weights(labels: Sequence[Sequence[int]], n_classes: int) -> np.ndarray:
    """Per image: max over its concepts of n_c ** -0.5 (0 for an image with none)."""
    counts = np.bincount(np.fromiter((c for r in labels for c in r), np.int64),
                         minlength=n_classes).astype(np.float64)
    inv = np.where(counts > 0, 1.0 / np.sqrt(np.maximum(counts, 1)), 0.0)
    return np.array([inv[list(r)].max() if len(r) else 0.0 for r in labels])


class Labels:
    """Per-image concept ids as CSR arrays, for vectorised soft targets and masks."""

    def __init__(self, labels: Sequence[Sequence[int]]) -> None:
        self.lens = np.fromiter((len(r) for r in labels), np.int64, len(labels))
        self.indptr = np.concatenate([[0], np.cumsum(self.lens)])
        self.indices = np.fromiter((c for r in labels for c in r), np.int64, int(self.lens.sum()))

    def coo(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lens = self.lens[idx]
        starts = np.repeat(self.indptr[idx] - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
        cols = self.indices[starts + np.arange(int(lens.sum()))]
        vals = np.repeat(1.0 / np.maximum(lens, 1), lens)
        return np.repeat(np.arange(len(idx)), lens), cols, vals

    def soft(self, idx: np.ndarray, n_classes: int) -> Any:
        """Soft targets (len(idx), C): 1/K on each of an image's K concepts."""
        import torch
        r, c, v = self.coo(idx)
        t = torch.zeros(len(idx), n_classes)
        t[torch.from_numpy(r), torch.from_numpy(c)] = torch.from_numpy(v).float()
        return t

    def mask(self, idx: np.ndarray, n_classes: int) -> np.ndarray:
        r, c, _ = self.coo(idx)
        m = np.zeros((len(idx), n_classes), bool)
        m[r, c] = True
        return m


def train_head(x: np.ndarray, labels: Sequence[Sequence[int]], n_classes: int, cfg: Any,
               device: str = "cpu") -> Optional[Head]:
    """Fit a linear head on ``x`` (n, d) to ``labels`` (per image: concept ids). Images with no
    concept do not take part. ``cfg``: the ``concepts`` section. None when nothing to learn."""
    import torch
    keep = np.array([len(r) > 0 for r in labels], bool)
    if n_classes == 0 or not keep.any():
        return None
    rows = np.flatnonzero(keep)
    lab = Labels([labels[i] for i in rows])
    xs = x if keep.all() else x[rows]
    mean = xs.mean(0, dtype=np.float64).astype(np.float32)
    std = (xs.std(0, dtype=np.float64) + 1e-6).astype(np.float32)
    w = resample_weights([labels[i] for i in rows], n_classes)
    rng = np.random.default_rng(cfg.seed)
    draws = cfg.resample_length or len(rows)
    bs = cfg.batch_size
    steps = cfg.epochs * math.ceil(draws / bs)
    lin = torch.nn.Linear(x.shape[1], n_classes).to(device)
    torch.nn.init.zeros_(lin.weight)
    torch.nn.init.zeros_(lin.bias)
    opt = torch.optim.SGD(lin.parameters(), lr=cfg.base_lr * bs / 256, momentum=cfg.momentum,
                          weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))   # cosine to 0
    for _ in range(cfg.epochs):
        order = rng.choice(len(rows), size=draws, replace=True, p=w / w.sum())
        for lo in range(0, draws, bs):
            idx = order[lo:lo + bs]
            xb = torch.from_numpy((xs[idx].astype(np.float32) - mean) / std).to(device)
            tb = lab.soft(idx, n_classes).to(device)
            loss = -(tb * torch.log_softmax(lin(xb), dim=1)).sum(1).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return Head(mean, std, lin.weight.detach().cpu().numpy().astype(np.float32),
                lin.bias.detach().cpu().numpy().astype(np.float32))


def auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """ROC AUC of ``scores`` for the boolean ``positive`` (Mann-Whitney, average ranks on ties)."""
    p, n = int(positive.sum()), int((~positive).sum())
    if p == 0 or n == 0:
        return float("nan")
    _, inv, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2.0)[inv]
    return float((ranks[positive].sum() - p * (p + 1) / 2) / (p * n))


def visualness(x: np.ndarray, labels: Sequence[Sequence[int]], n_classes: int, cfg: Any,
               device: str = "cpu") -> np.ndarray:
    """Per concept: ROC AUC of its logit on held-out images (all of them: an image with no
    attribute is a negative for each), the head trained on the other images. NaN when fewer
    than MIN_HOLDOUT_POSITIVES held-out images have it. Evaluating only images with some
    attribute would make a softmax head's "none of the others" look visible."""
    out = np.full(n_classes, np.nan)
    if n_classes == 0 or len(labels) < 2:
        return out
    perm = np.random.default_rng(cfg.seed + 1).permutation(len(labels))
    n_hold = max(1, int(round(len(perm) * cfg.holdout_fraction)))
    hold, train = np.sort(perm[:n_hold]), np.sort(perm[n_hold:])
    head = train_head(x[train], [labels[i] for i in train], n_classes, cfg, device)
    if head is None:
        return out
    scores = head.logits(x[hold])
    pos = Labels([labels[i] for i in hold]).mask(np.arange(len(hold)), n_classes)
    for c in np.flatnonzero(pos.sum(0) >= MIN_HOLDOUT_POSITIVES):
        out[c] = auc(scores[:, c], pos[:, c])
    return out


def select_attributes(names: list[str], vis: np.ndarray, sharedness: dict, cfg: Any) -> list[str]:
    """Attributes with visualness >= min_visualness (unmeasured ones pass); over
    max_attributes, the best ranked by visualness (unmeasured counts as the threshold) then
    sharedness. They keep the order of ``names`` (so ids do not depend on the AUC values)."""
    floor = cfg.min_visualness if cfg.min_visualness is not None else 0.0
    v = {n: (floor if np.isnan(s) else float(s)) for n, s in zip(names, vis, strict=True)}
    kept = [n for n in names if cfg.min_visualness is None or v[n] >= cfg.min_visualness]
    ranked = sorted(kept, key=lambda n: (-v[n], -sharedness.get(n, 0), n))
    top = set(ranked[:cfg.max_attributes] if cfg.max_attributes else ranked)
    return [n for n in kept if n in top]


def top_k(head: Optional[Head], x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over the vocabulary, the k most probable concepts, renormalised to sum to 1:
    ids (n, k') int64 and probabilities (n, k') float32, best first (k' = min(k, C))."""
    if head is None or len(x) == 0:
        return np.zeros((len(x), 0), np.int64), np.zeros((len(x), 0), np.float32)
    z = head.logits(x)
    z -= z.max(1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(1, keepdims=True)
    k = min(k, p.shape[1])
    ids = np.argpartition(-p, k - 1, axis=1)[:, :k]
    top = np.take_along_axis(p, ids, 1)
    order = np.argsort(-top, axis=1, kind="stable")
    ids, top = np.take_along_axis(ids, order, 1), np.take_along_axis(top, order, 1)
    return ids, (top / top.sum(1, keepdims=True)).astype(np.float32)
