"""Reference implementations written straight from the papers, one target / one pair at a time."""
from __future__ import annotations

import numpy as np


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def naive_hpm(img, txt, k, tau_i, tau_t, dup=None):
    """HELIP Alg. 1 for every target i: S~ = sim if sim > tau else 0; s_j = S~I_j * S~T_j;
    H_i = Argmax(s, k) over j != i; H_i = {} when a top-k score is 0 (noise). ``dup``: the
    released code's zeroing of similarities above it. Ties: lower index first.
    Returns [(hard ids, hard scores, support, noise)] per target."""
    n = len(img)
    out = []
    for i in range(n):
        s = np.zeros(n)
        for j in range(n):
            if j == i:
                continue
            si, st = cos(img[i], img[j]), cos(txt[i], txt[j])
            if dup is not None:
                si = 0.0 if si > dup else si
                st = 0.0 if st > dup else st
            si = si if si > tau_i else 0.0
            st = st if st > tau_t else 0.0
            s[j] = si * st
        others = [j for j in range(n) if j != i]
        order = sorted(others, key=lambda j: (-s[j], j))[:k]
        support = sum(1 for j in others if s[j] > 0)
        noise = len(order) < k or any(s[j] == 0 for j in order)
        hard = [] if noise else order
        out.append((hard, [s[j] for j in hard], support, noise))
    return out


def naive_fff(img, txt, p1=0.27, p1_text=0.24, p2=0.92, p3=0.99, dup=None, ximg=None, xtxt=None):
    """FFF Eq. 1 for every (i, j), j != i, plus HELIP duplicates; one relation per pair in the
    order duplicate, image, cross, text. Returns {i: {j: (relation, score)}}."""
    n = len(img)
    cross = ximg is not None
    out = {}
    for i in range(n):
        out[i] = {}
        for j in range(n):
            if j == i:
                continue
            sii, stt = cos(img[i], img[j]), cos(txt[i], txt[j])
            sit = cos(ximg[i], xtxt[j]) if cross else None
            if dup is not None and (sii > dup or stt > dup):
                out[i][j] = ("duplicate", max(sii, stt))
            elif sii > p2:
                out[i][j] = ("image", sii)
            elif cross and sit > p1:
                out[i][j] = ("cross", sit)
            elif stt > p3 and (not cross or sit > p1_text):
                out[i][j] = ("text", stt)
    return out


def naive_fff_captions(ximg, captions, p1=0.27, p1_text=0.24, p2=0.92, p3=0.99, dup=None,
                       img=None, txt=None):
    """FFF Eq. 1 with one image-text model (sec. 4.1) over images x k captions (sec. 4.3), one
    (image i, caption c of image j) pair at a time, j != i. ``captions[j]``: image j's caption
    vectors (its caption first). S_it = cos(x_i, t_jc); S_ii = cos(x_i, x_j); S_tt = the mean of
    cos(a, b) over every caption a of i and b of j. HELIP duplicates on (img, txt): S_ii > dup,
    or S_tt > dup and S_it > p1'. Returns {i: {(j, c): (relation, score)}}."""
    n = len(ximg)
    out = {}
    for i in range(n):
        out[i] = {}
        for j in range(n):
            if j == i:
                continue
            sii = cos(ximg[i], ximg[j])
            stt = float(np.mean([cos(a, b) for a in captions[i] for b in captions[j]]))
            for c, t in enumerate(captions[j]):
                sit = cos(ximg[i], t)
                dii = cos(img[i], img[j]) if dup is not None else None
                dtt = cos(txt[i], txt[j]) if dup is not None else None
                if dup is not None and (dii > dup or (dtt > dup and sit > p1_text)):
                    out[i][(j, c)] = ("duplicate", max(dii, dtt))
                elif sii > p2:
                    out[i][(j, c)] = ("image", sii)
                elif sit > p1:
                    out[i][(j, c)] = ("cross", sit)
                elif stt > p3 and sit > p1_text:
                    out[i][(j, c)] = ("text", stt)
    return out


def clustered(n, d, n_clusters, spread, seed):
    """Unit vectors in clusters: a shared centre per cluster plus noise of norm ~spread."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_clusters, d))
    lab = rng.integers(0, n_clusters, n)
    x = centres[lab] / np.sqrt(d) + spread * rng.standard_normal((n, d)) / np.sqrt(d)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32), lab


def pairs(n, d, seed, spread=0.6, n_clusters=6):
    """Image and text vectors of the same clusters, with independent noise."""
    img, lab = clustered(n, d, n_clusters, spread, seed)
    rng = np.random.default_rng(seed + 100)
    centres = rng.standard_normal((n_clusters, d))
    t = centres[lab] / np.sqrt(d) + spread * rng.standard_normal((n, d)) / np.sqrt(d)
    return img, (t / np.linalg.norm(t, axis=1, keepdims=True)).astype(np.float32)
