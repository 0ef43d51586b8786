"""One-space layouts: the candidate pairs near in one space only, when the pass is partial.

The neighbour pass (passes.py) routes a row on its joint HELIP vector. When it is partial (probe
< clusters: above hpm.engine.exact_max_n rows) it misses pairs close in one space only: an image
near-duplicate under an unrelated caption (S_I 0.97, S_T 0.06: joint similarity ~0.5), FFF's
main case. Measured on the real-derived set with planted pairs
(tests/benchmarks/bench_one_space_pairs.py), the joint pass alone finds 53-63% of them.

So a partial pass also lays out, each on its own, the spaces the positives rule judges
(``spaces_of``): the image and text spaces of HELIP's encoders, or with cross-modal vectors
the cross-modal image and text spaces (FFF Eq. 1 is judged there; a HELIP duplicate, S_I >
0.98, is the same picture and so a cross-modal image near-duplicate too). A space's layout is
the same spherical k-means as the joint one (``layout.build_layout`` on that space's vectors
alone), with rows sorted by cluster and a sorted copy of that space's vectors; its ``order``
holds positions in the joint layout's sorted vectors, so a found pair's other similarities are
read from there.

Mining a row (``add_pairs``) then also routes it, in each space, to the ``space_probe``
clusters it ranks best there (as the joint pass ranks them: routing.mean_scores), and keeps
the members above that space's floor: one GEMM in one space, no HPM scoring (no hard pair
comes from here). The cross-modal text space is searched twice: with text queries (X_tt)
and with image queries (S_it = <x_i, t_j>, the main clause). A pair whose member lies in a
joint cluster the row already searched is left to the joint pass (which kept it with every
similarity, or cut it and counted it once). The others get their similarities from gathered
dot products and join the row's pairs, which are capped again by max_pairs (exactly, as in
passes.gather).

Like the joint pass, a row's result depends only on the layouts and its own routing. With
space_probe = every cluster the union is every pair above a floor (tested against brute
force). Disk: one more sorted copy of each laid-out space.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import torch

from .. import native
from . import persist
from .core import MARGIN, SIMS, PassParams, Vectors, _take, _whole, freed_memory_kept
from .layout import Layout, build_layout
from .pairs import Held, csr
from .passes import PassResult
from .precision import Precision, get
from .routing import route_step

# member vectors -> (query vectors, the similarity that gives, its floor in PassParams)
SPACES = {"img": (("img", "sii", "floor_i"),),
          "txt": (("txt", "stt", "floor_t"),),
          "ximg": (("ximg", "xii", "floor_i"),),
          "xtxt": (("xtxt", "xtt", "floor_t"), ("ximg", "sit", "floor_x"))}
# each similarity: (query's vectors, member's vectors)
DOTS = {"sii": ("img", "img"), "stt": ("txt", "txt"), "sit": ("ximg", "xtxt"),
        "xii": ("ximg", "ximg"), "xtt": ("xtxt", "xtxt")}


def spaces_of(vec: Vectors, p: PassParams) -> list[str]:
    """The spaces to lay out: the cross-modal ones when there are cross-modal vectors (the
    positives rule judges there), else HELIP's; only those with a floor below 1."""
    names = ("ximg", "xtxt") if vec.cross else ("img", "txt")
    return [s for s in names if any(getattr(p, f) < 1 for _, _, f in SPACES[s])]


@dataclass
class Space:
    name: str
    lay: Layout
    members: np.ndarray       # the space's vectors in its layout's order
    pos: np.ndarray           # each joint position's position in this layout
    low: object = None        # a precision's copy of the members (space_copies: int8's)


def _space_params(p: PassParams) -> PassParams:
    """A space's clusters: about p.space_rows rows each, whatever the joint layout's size."""
    return dataclasses.replace(p, n_clusters=None, cluster_rows=p.space_rows)


def layouts(vec: Vectors, p: PassParams, device: str = "cpu") -> list[Space]:
    """Each space's layout, with its vectors sorted in memory (vec: the joint layout's sorted
    vectors, so a space's ``order`` holds their positions)."""
    out = []
    for name, lay in _layouts(vec, p, device):
        members = persist.take_rows(getattr(vec, name), lay.order)
        prec = get(p.precision)
        low = prec.low_copy(members, lay) if prec.space_copies else None
        out.append(Space(name, lay, members, lay.positions(), low))
    return out


def _layouts(vec: Vectors, p: PassParams, device: str):
    """(space, its layout) for each space to lay out."""
    for name in spaces_of(vec, p):
        yield name, build_layout(getattr(vec, name), None, _space_params(p), device)


def build(dir_: str, vec: Vectors, p: PassParams, device: str) -> None:
    """Each space's layout and sorted vectors on disk, in ``dir_``/space_<name>."""
    for name, lay in _layouts(vec, p, device):
        save(dir_, name, lay, vec, p.precision)


def save(dir_: str, name: str, lay: Layout, vec: Vectors, precision: str) -> None:
    """A space's layout, and its vectors sorted by it (streamed from vec, the joint layout's
    sorted vectors: not held in memory), in ``dir_``/space_<name>, as ``load`` reads them."""
    sub = os.path.join(dir_, f"space_{name}")
    persist.save_layout(sub, lay)
    persist.save_vectors(sub, lay, {name: getattr(vec, name)},
                        precision if get(precision).space_copies else "fp32")


def load(dir_: str, n: int) -> list[Space]:
    out = []
    for name in SPACES:
        sub = os.path.join(dir_, f"space_{name}")
        if os.path.isdir(sub):
            lay, at = persist.load_layout(sub)
            vec = persist.load_vectors(sub, n)
            out.append(Space(name, lay, getattr(vec, name), at, (vec.low or {}).get(name)))
    return out


def add_pairs(r: PassResult, spaces: list[Space], joint: Layout,
              vec: Vectors, pos: np.ndarray, routes: np.ndarray, p: PassParams,
              device: str = "cpu") -> PassResult:
    """The joint pass's result ``r`` for the rows at joint positions ``pos`` (routed to the
    joint clusters ``routes``), with the pairs the spaces find that no earlier search found:
    not in a joint cluster the row searched, nor found by an earlier space search (in a
    cluster it searched there, above its floor). So each pair is seen once, and a pair the
    cap cuts is counted once (up to the last bits of a similarity at its floor)."""
    acc, prec = Held(len(pos), p.max_pairs, r.cut), get(p.precision)
    acc.add({"q": np.repeat(np.arange(len(pos)), np.diff(r.offsets)), "j": r.pair_j,
             **{f: getattr(r, f"pair_{f}") for f in SIMS}})
    seen = [lambda q, j, sims: (routes[q] == joint.cluster_of(j)[:, None]).any(1)]
    with torch.no_grad(), freed_memory_kept():     # as the joint pass: no fresh pages
        for s, qname, sim, floor in searches(spaces, vec, p):
            x = _take(getattr(vec, qname), pos, device)
            x8 = prec.space_rows(x)                              # once, for both
            probe = _probe(s.lay, x, p.space_probe, prec, x8)
            for q, j in _batches(_hits(s, x, probe, floor - MARGIN, p, device, x8)):
                other = j != pos[q]
                q, j = q[other], j[other]
                sims = similarities(vec, pos[q], j, device)
                above = sims[sim] > floor                    # as _found_by reads it
                q, j, sims = q[above], j[above], {f: v[above] for f, v in sims.items()}
                new = ~np.any([was(q, j, sims) for was in seen], 0)
                acc.add({"q": q[new], "j": np.asarray(joint.order)[j[new]],
                         **{f: v[new] for f, v in sims.items()}})
            seen.append(_found_by(s, probe, sim, floor))
    r.offsets, r.pair_j, sims_ = csr(acc.pairs(), len(pos))
    for f, x in zip(SIMS, sims_):
        setattr(r, f"pair_{f}", x)
    return r


def searches(spaces: list[Space], vec: Vectors, p: PassParams):
    """(space, query vectors, similarity, floor) of each search with a floor below 1."""
    for s in spaces:
        for qname, sim, floor in SPACES[s.name]:
            if getattr(vec, qname) is not None and getattr(p, floor) < 1:
                yield s, qname, sim, getattr(p, floor)


def _found_by(s: Space, probe: np.ndarray, sim: str, floor: float):
    """Whether a search found pairs (q, j): j in a cluster of s that q searched, above floor."""
    def was(q, j, sims):
        return (probe[q] == s.lay.cluster_of(s.pos[j])[:, None]).any(1) & (sims[sim] > floor)
    return was


BATCH = 1 << 14       # hits per batch whose similarities are gathered (~BATCH x d floats each)


def _batches(hits):
    """The units' hits in batches of BATCH pairs (the last one smaller): a unit of a few
    queries has few hits, each batch costs ~20 small operations, and its gathers are
    bounded."""
    held, count = [], 0
    for q, j in hits:
        for a in range(0, len(q), BATCH):
            held.append((q[a:a + BATCH], j[a:a + BATCH]))
            count += len(held[-1][0])
            if count >= BATCH:
                yield tuple(np.concatenate(x) for x in zip(*held))
                held, count = [], 0
    if held:
        yield tuple(np.concatenate(x) for x in zip(*held))


def _probe(lay: Layout, x: torch.Tensor, probe: int, prec: Precision, x8=None) -> np.ndarray:
    """[n, probe] the best non-empty clusters of each query by routing.mean_scores (<x, mean> +
    ROUTE_SPREAD spread, in ``prec``; equal scores by the lower cluster), ascending (a
    slice of queries at a time: ~4M scores held, whatever the number of clusters). x8: x's
    rows as the precision prepared them (space_rows; None: x), scored and selected as the
    joint routing's (Precision.space_top)."""
    step, probe = route_step(lay), min(probe, lay.n_clusters)
    out = [np.zeros((0, probe), np.int64)]
    for a in range(0, len(x), step):
        out.append(prec.space_top(lay, x[a:a + step], probe,
                                  None if x8 is None else x8[a:a + step]))
    return np.concatenate(out)


def _hits(s: Space, x: torch.Tensor, probe: np.ndarray, floor: float, p: PassParams,
          device: str, x8=None):
    """Per block of a unit (a cluster of s x the queries that probe it, query_block x
    block_size at a time): (query index, member joint position) of the pairs <x, m> > floor, a
    superset: each hit is accepted or not on its gathered fp32 dot product. With hpm.engine.precision
    bf16 the blocks are bf16 GEMMs (the queries cast once, each member block as it is read) at
    the floor lowered by the screen's proven margin (screen.py), so no pair above it is
    missed; with int8, int8 GEMMs (the queries quantized once, the members' int8 copy read)
    against each query's proven threshold (q8.hits; x8: x's rows already quantized): the
    precision's space_screen."""
    lay, prec = s.lay, get(p.precision)
    x, floor, hits = prec.space_screen(x, x8, floor)
    q, c = np.repeat(np.arange(len(x)), probe.shape[1]), probe.ravel()
    o = np.lexsort((q, c))
    q, c = q[o], c[o]
    cuts = np.searchsorted(c, np.arange(lay.n_clusters + 1))
    for u in np.flatnonzero(np.diff(cuts)):
        qs, b = q[cuts[u]:cuts[u + 1]], int(lay.bounds[u + 1])
        for s0 in range(int(lay.bounds[u]), b, p.block_size):
            block = prec.space_block(s.low, s.members, slice(s0, min(b, s0 + p.block_size)),
                                     u, x, device)
            for a in range(0, len(qs), p.query_block):
                rows = qs[a:a + p.query_block]
                r, col = hits(x, rows, block, floor)
                if len(r):
                    yield rows[r], np.asarray(lay.order[s0 + col])


def similarities(vec: Vectors, qpos: np.ndarray, jpos: np.ndarray, device: str) -> dict:
    """Every similarity of the pairs (joint positions qpos, jpos): native.pair_dots, the
    joint pass's re-score (the same bits), the members' rows read where they lie, the
    queries' gathered once however many pairs a query has (the demo's dense case: thousands;
    per-pair reads of a memory map were ~2/3 of 1M hpm's time in torch's path). NaN for the
    cross-modal ones without cross-modal vectors."""
    uq, inv = np.unique(np.asarray(qpos, np.int64), return_inverse=True)
    qi, ji = torch.as_tensor(inv.ravel()), torch.as_tensor(np.asarray(jpos, np.int64).ravel())
    out = {}
    for f, (a, b) in DOTS.items():
        x, y = getattr(vec, a), getattr(vec, b)
        out[f] = np.full(len(qi), np.nan, np.float32) if x is None else native.pair_dots(
            _take(x, uq, device), qi, _whole(y), ji, device).cpu().numpy()
    return out
