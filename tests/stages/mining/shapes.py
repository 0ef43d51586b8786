"""Clustered image-text pairs of uneven shapes, for the pass's parity tests: cluster sizes from
a power law, each cluster with its own spread, a share of isolated rows and of mismatched pairs
(image and text of two different clusters)."""
from __future__ import annotations

import numpy as np


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def uneven(n: int, d: int, seed: int, clusters: int = 30, alpha: float = 1.2,
           spread: tuple = (0.4, 1.1), isolated: float = 0.03, mismatched: float = 0.03):
    """(img, txt, kind): kind 0 a cluster's pair, 1 isolated, 2 mismatched. Cluster c holds a
    share ~ (c + 1)^-alpha of the clustered rows; its rows' noise has norm spread_c."""
    rng = np.random.default_rng(seed)
    n_iso, n_mis = int(n * isolated), int(n * mismatched)
    m = n - n_iso - n_mis
    share = (np.arange(1, clusters + 1) ** -alpha)
    lab = rng.choice(clusters, size=m, p=share / share.sum())
    width = rng.uniform(*spread, clusters)
    ci, ct = rng.standard_normal((2, clusters, d))
    noise = lambda k: rng.standard_normal((k, d)) / np.sqrt(d)    # noqa: E731
    img = [ci[lab] / np.sqrt(d) + width[lab, None] * noise(m)]
    txt = [ct[lab] / np.sqrt(d) + width[lab, None] * noise(m)]
    img.append(rng.standard_normal((n_iso, d)))
    txt.append(rng.standard_normal((n_iso, d)))
    a, b = rng.integers(0, clusters, (2, n_mis))
    b = np.where(a == b, (b + 1) % clusters, b)
    img.append(ci[a] / np.sqrt(d) + width[a, None] * noise(n_mis))
    txt.append(ct[b] / np.sqrt(d) + width[b, None] * noise(n_mis))
    kind = np.repeat([0, 1, 2], [m, n_iso, n_mis])
    perm = rng.permutation(n)
    return _unit(np.concatenate(img))[perm], _unit(np.concatenate(txt))[perm], kind[perm]


def exact_support(img, txt, tau_i: float, tau_t: float, dup=None) -> np.ndarray:
    """Each row's supporters (j != i with S_I > tau_I, S_T > tau_T, neither above dup), brute
    force in float64."""
    a, b = img.astype(np.float64), txt.astype(np.float64)
    si, st = a @ a.T, b @ b.T
    ok = (si > tau_i) & (st > tau_t)
    if dup is not None:
        ok &= (si <= dup) & (st <= dup)
    np.fill_diagonal(ok, False)
    return ok.sum(1)


def exact_scores(img, txt, k: int, tau: float, dup: float) -> np.ndarray:
    """Each row's k best HELIP scores (float64, 0 padded), descending: exact HPM by brute force."""
    a, b = img.astype(np.float64), txt.astype(np.float64)
    si, st = a @ a.T, b @ b.T
    s = np.where((si > tau) & (st > tau) & (si <= dup) & (st <= dup), si * st, 0.0)
    np.fill_diagonal(s, 0.0)
    return -np.sort(-s, axis=1)[:, :k]
