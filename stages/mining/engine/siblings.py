"""Siblings in the noise rule: the other captions of a row's image as support.

HELIP (Wang et al., sec. 3.2 and Alg. 1) mines web pairs, one caption per image (CC3M, CC12M,
YFCC15M, LAION subsets; sec. 4.1, "Training datasets"): a target's support is the pairs whose image *and* caption are both
near its own. With several captions per image (COCO, Flickr: five), the other captions of the
same image (its *siblings*, the rows of its ``image_group``) are the strongest evidence about
a caption, yet Alg. 1 cannot count them: their image similarity is 1, above the duplicate
threshold, so they score 0. The extension (``hpm.siblings``): a sibling j of target i supports
i when their captions agree, S_tt(i, j) > ``hpm.siblings.tau_text``, and Alg. 1 does not
already count it (S_ii and S_tt both in (tau, dup]); the target is a noise pair when its
support plus its agreeing siblings is below k. A mismatched caption disagrees with the
captions of the image it was put with, so its siblings do not rescue it; a row of an image
with one caption has no siblings, and the rule is Alg. 1's.

Siblings are not hard pairs (they are the same image: positives), so the hard sets are Alg. 1's.
Each similarity is one fixed-order fp32 dot product (native.pair_dots): the same bits on every
device and whatever the parts or batches. A pair within ~1e-6 of a threshold can be judged
differently here and in the pass's GEMMs; only such a pair could be counted twice.
"""
from __future__ import annotations

from typing import Iterator, Optional

import numpy as np
import torch

from .. import native
from ..hpm import as_tensor, positive_scores

CHUNK = 1 << 20          # sibling pairs scored per pair_dots call


def agreeing(group: np.ndarray, img, txt, tau_i: float, tau_t: float, dup: Optional[float],
             tau_sib: float) -> np.ndarray:
    """[n] int32: per row, its siblings (other rows of equal ``group``) whose caption agrees
    (S_tt > tau_sib) and that Alg. 1 does not count as support (img, txt: [n, d] unit rows)."""
    group = np.asarray(group)
    out = np.zeros(len(group), np.int64)
    I, T = as_tensor(img, "cpu"), as_tensor(txt, "cpu")
    for a, b in sibling_pairs(group):
        ta, tb = torch.as_tensor(a), torch.as_tensor(b)
        stt = native.pair_dots(T, ta, T, tb, "cpu")
        sii = native.pair_dots(I, ta, I, tb, "cpu")
        counted, _ = positive_scores(sii, stt.clone(), tau_i, tau_t, dup)
        ok = ((stt > tau_sib) & ~counted).numpy()
        out += np.bincount(a[ok], minlength=len(group))
    return out.astype(np.int32)


def sibling_pairs(group: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Every ordered pair (a, b), a != b, of rows with equal ``group``, in chunks of about
    CHUNK pairs (a group of s rows gives s (s - 1) pairs)."""
    order = np.argsort(group, kind="stable")
    g = group[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]]) if len(g) else np.zeros(0, np.int64)
    sizes = np.diff(np.r_[starts, len(g)])
    held: list = []
    count = 0
    for s in np.unique(sizes[sizes > 1]):
        rows = order[starts[sizes == s][:, None] + np.arange(s)]       # [groups, s]
        for i in range(s):
            others = np.delete(rows, i, axis=1)
            held.append((np.repeat(rows[:, i], s - 1), others.ravel()))
            count += others.size
            if count >= CHUNK:
                yield _cat(held)
                held, count = [], 0
    if held:
        yield _cat(held)


def _cat(held: list) -> tuple[np.ndarray, np.ndarray]:
    return (np.concatenate([h[0] for h in held]).astype(np.int64),
            np.concatenate([h[1] for h in held]).astype(np.int64))
