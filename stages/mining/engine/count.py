"""``complete``'s last step, count only: a short row's supporters over the clusters it has not
searched, without the search's top-k, bound or pairs.

A noise pair's hard set is empty (HELIP Alg. 1), so for a row still short after the widened
probe only its support matters, unless that reaches k. ``count`` screens the row against
every cluster it has not searched in one space (the one with fewer dimensions, the image on
a tie) with the precision's one-space screen (Precision.space_screen / space_block: a proven
superset of the pairs above the floor, as spaces.py's searches), and only the pairs that pass
it get both similarities, as gathered fp32 dot products (native.pair_dots: the re-score's
own bits). Judged against each threshold within core.MARGIN (a GEMM's fp32 and a dot
product differ by ~1e-6): a pair above every threshold by MARGIN is a *sure* supporter, one
above each tau less MARGIN a *possible* one. A row stops being counted once its sure
supporters reach what it lacks (``need``): it is no noise pair, and ``complete`` searches it
in every cluster left, as before. For the others, the clusters that hold a possible
supporter are all that ``complete`` searches: every other cluster holds no pair with a
positive score, so the search there gives the exact support, top-k and certificate, the same
bytes as a search of every cluster where the precision re-scores its pairs (int8, bf16: a
pair's similarities are its dot products, whatever GEMMs screened it). fp32 reads them off
GEMMs whose last bits follow their shapes, so there ``complete`` searches every cluster left
instead (passes._last_step). One exception remains: a stack of units whose candidates exceed
the screen's dense share (screen.DENSE_SHARE; int8: x DENSE_GAIN) is computed in fp32 too,
and the searches here stack other rows than a search of every cluster would; a short row's
few supporters make that rare (no byte differed on the bench shapes, test_count.py's set or
tests/stages/mining).

The screen runs in batches, between which the rows that reached their need stop: where the
precision has a screen of whole member ranges (Precision.space_count: int8 on a CPU with AMX,
kernels.count_hits) RANGE sorted members at a time, ROWS rows and at most CAP pairs a call;
elsewhere cluster by cluster and block by block (space_block, hits), JUDGE pairs at a time.
Either screen is a proven superset and each pair is judged alike, so both give the same
answers (reached; possible for the rows not reached), whatever the batches.

Cost per short row: one int8 GEMM of one space against the N rows, then the other space's dot
product of each screened pair (~530 per row on web; the screened space's only for the few that
pass). On one core of this machine (web, 1M rows of 384 dimensions, 1,312 short rows of 32,768
targets): cluster by cluster ~3 ms of CPU (VNNI's ~220 GMAC/s and ~0.3 ms of Python per cluster
and call), by range ~0.8 ms (AMX: ~1 TMAC/s)."""
from __future__ import annotations

import numpy as np
import torch

from .. import native
from .core import MARGIN, PassParams, Vectors, _take, _whole
from .layout import Layout
from .precision import get


def first_space(vec: Vectors) -> tuple[str, str]:
    """(the space screened, the other): the one with fewer dimensions (cheaper), image on a
    tie."""
    return ("txt", "img") if vec.txt.shape[1] < vec.img.shape[1] else ("img", "txt")


def count(lay: Layout, vec: Vectors, pos: np.ndarray, done: np.ndarray, need: np.ndarray,
          p: PassParams, device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """Rows at sorted positions ``pos``, against the clusters not ``done`` ([rows, clusters]
    bool): (reached: [rows] bool, at least ``need`` sure supporters found; possible: [rows,
    clusters] bool, the clusters holding a possible supporter, complete for the rows not
    reached)."""
    one, _ = first_space(vec)
    x = {s: _take(getattr(vec, s), pos, device) for s in ("img", "txt")}
    tau = {"img": p.tau_i, "txt": p.tau_t}
    prec = get(p.precision)
    low = (vec.low or {}).get(one)
    xs, floor, hits = prec.space_screen(x[one], None, tau[one] - MARGIN)
    got = np.zeros(len(pos), np.int64)
    possible = np.zeros(done.shape, bool)
    fast = prec.space_count(low, xs, lay.bounds, floor)
    held = _by_range(fast, lay, done, got, need) if fast else _by_cluster(
        lay, getattr(vec, one), low, prec, xs, hits, floor, done, got, need, p, device)
    with torch.no_grad():
        for h in held:                  # got grows between batches: reached rows stop
            _add(h, got, possible, *_judge(vec, x, pos, h, tau, p, device))
    return got >= need, possible


def _by_range(fast, lay: Layout, done: np.ndarray, got: np.ndarray, need: np.ndarray):
    """Batches of screened pairs [(row, member, cluster)] of the rows that still count, RANGE
    sorted members at a time, ROWS rows and at most CAP pairs a call (Precision.space_count)."""
    a, n = 0, int(lay.bounds[-1])
    while a < n:
        live = np.flatnonzero(got < need)
        if not len(live):
            return
        b = min(n, a + RANGE)
        for rows in np.split(live, range(ROWS, len(live), ROWS)):
            at = a
            while at < b:
                r, j, at = fast(rows, done[rows], at, b, CAP)
                yield [(rows[r], j, lay.cluster_of(j))]
        a = b


def _by_cluster(lay: Layout, members, low, prec, xs, hits, floor: float, done: np.ndarray,
                got: np.ndarray, need: np.ndarray, p: PassParams, device: str):
    """Batches of screened pairs [(row, member, cluster)], cluster by cluster and block by
    block (Precision.space_block and hits), of at least JUDGE pairs, the rows that still
    count."""
    held, pairs = [], 0
    for c in np.flatnonzero(np.diff(lay.bounds) > 0):
        live = np.flatnonzero(~done[:, c] & (got < need))
        a, b = int(lay.bounds[c]), int(lay.bounds[c + 1])
        for s0 in range(a, b, p.block_size) if len(live) else ():
            m = prec.space_block(low, members, slice(s0, min(b, s0 + p.block_size)), c, xs,
                                 device)
            r, col = hits(xs, live, m, floor)
            held.append((live[r], s0 + np.asarray(col, np.int64), c))
            pairs += len(r)
        if pairs >= JUDGE:
            yield held
            held, pairs = [], 0
    yield held


JUDGE = 1 << 15      # screened pairs judged at once (rows stop being counted between batches)
RANGE = 1 << 16      # sorted members screened by space_count between two judged batches
ROWS = 4096          # rows a space_count call screens
CAP = 1 << 20        # pairs a space_count call holds (at least 32 x ROWS: it moves on)


def _add(held: list, got: np.ndarray, possible: np.ndarray, sure: np.ndarray,
         maybe: np.ndarray) -> None:
    """The judged pairs ``held`` counted into got (sure) and possible (maybe)."""
    q = np.concatenate([h[0] for h in held] + [np.zeros(0, np.int64)])
    c = np.concatenate([np.broadcast_to(h[2], len(h[0])) for h in held] +
                       [np.zeros(0, np.int64)]).astype(np.int64)
    got += np.bincount(q[sure], minlength=len(got))
    possible[q[maybe], c[maybe]] = True


def _judge(vec: Vectors, x: dict, pos: np.ndarray, held: list, tau: dict, p: PassParams,
           device: str) -> tuple[np.ndarray, np.ndarray]:
    """(sure, possible) supporters among the ``held`` pairs (query: an index into x's rows,
    member: a sorted position, cluster), both similarities as fp32 dot products, against tau
    (and dup) within MARGIN. A row's own pair is neither. The space not screened first: a
    pair below its tau less MARGIN is neither, whatever the screened space's similarity
    (web 1M: 111 of 700,921 screened pairs pass it), so that one is computed only for the
    pairs that pass (each dot product's bits are its own: native.pair_dots)."""
    q, j = (np.concatenate([h[i] for h in held] + [np.zeros(0, np.int64)]) for i in (0, 1))
    at = np.flatnonzero(pos[q] != j)
    one, two = first_space(vec)
    s = {two: _dots(vec, x, two, q[at], j[at], device)}
    near = s[two] > tau[two] - MARGIN
    at, s[two] = at[near], s[two][near]
    s[one] = _dots(vec, x, one, q[at], j[at], device)
    sure = np.zeros(len(q), bool)
    maybe = np.zeros(len(q), bool)
    maybe[at] = (s["img"] > tau["img"] - MARGIN) & (s["txt"] > tau["txt"] - MARGIN)
    ok = (s["img"] > tau["img"] + MARGIN) & (s["txt"] > tau["txt"] + MARGIN) & \
        (s["img"] * s["txt"] > 0)
    if p.dup is not None:
        ok &= (s["img"] <= p.dup - MARGIN) & (s["txt"] <= p.dup - MARGIN)
    sure[at] = ok
    return sure, maybe


def _dots(vec: Vectors, x: dict, name: str, q: np.ndarray, j: np.ndarray,
          device: str) -> np.ndarray:
    """<x[name][q], vec.name[j]> as fp32 dot products (native.pair_dots)."""
    return native.pair_dots(x[name], torch.as_tensor(q), _whole(getattr(vec, name)),
                            torch.as_tensor(j), device).cpu().numpy()
