"""Export's cut on the cross-modal score (DataComp's CLIP-score filters), over ``cross_score``.

Two cuts, both the reason ``export.low_cross_score`` (always dropped while set):

- ``export.min_score``: a threshold; a row below it, or with no score, is cut.
- ``export.keep_top_fraction`` f: of the pool (the rows the rest of the policy keeps and that
  have a score), the top ``ceil(f·N)`` by (score descending, ``sample_id`` ascending); with
  ``export.top_fraction_per: image_group``, the top ``ceil(f·n)`` of each image's ``n``
  pooled captions instead (every image keeps at least one). The order is total and ``sample_id``
  stable, so the kept set is exact and the same for any parts, nodes or executor: a driver-side
  step (:func:`plan_cut`) gathers the pool's scores from every part, then each part applies the
  :data:`Cuts` it found. f is read as the decimal it is written (0.3 of 10 rows keeps 3).

Memory of the step: 4 bytes a pooled row for the whole run (100M rows: 400 MB in one task); per
image group also each row's group id, and a state of one entry per image group that loses a
caption (about 100 bytes each, sent to every export worker).
"""
from __future__ import annotations

import functools
import itertools
from fractions import Fraction
from typing import Any, Callable, Iterable, Optional

import numpy as np
import pyarrow as pa

from vlcurate.schemas import F
from vlcurate.schemas import embed as E
from vlcurate.schemas import reasons as R

LOW_SCORE = R.LOW_CROSS_SCORE

# The cut of each scope: {scope: (t, s)}. A row of the scope stays when its score is above t, or
# equal to t and its sample_id is at most s (s None: every row at t stays). The scope is the
# image group (top_fraction_per: image_group), else None (the whole run). A scope with no entry
# keeps every row.
Cuts = dict


def with_min_score(batch: pa.Table, reasons: list[list[str]], min_score: Optional[float]
                   ) -> list[list[str]]:
    """``reasons`` plus ``export.low_cross_score`` where the row's score is below ``min_score``
    or missing."""
    if min_score is None:
        return reasons
    scores = batch.column(E.CROSS_SCORE.name).to_pylist()
    return [rs + [LOW_SCORE] if s is None or s < min_score else rs
            for rs, s in zip(reasons, scores)]


def with_top_fraction(batch: pa.Table, reasons: list[list[str]], cuts: Optional[Cuts],
                      per_group: bool) -> list[list[str]]:
    """``reasons`` plus ``export.low_cross_score`` on each row outside its scope's cut (a row
    without a score has no rank: cut too). ``cuts`` None: no top-fraction cut."""
    if cuts is None:
        return reasons
    scores = batch.column(E.CROSS_SCORE.name).to_pylist()
    sids = batch.column(F.SAMPLE_ID.name).to_pylist()
    scopes = batch.column(F.IMAGE_GROUP.name).to_pylist() if per_group else [None] * len(sids)
    return [rs + [LOW_SCORE] if s is None or not inside(cuts.get(g), s, sid) else rs
            for rs, s, sid, g in zip(reasons, scores, sids, scopes)]


def inside(cut: Optional[tuple[float, Optional[str]]], score: float, sid: str) -> bool:
    if cut is None:
        return True
    t, last = cut
    return score > t or (score == t and (last is None or sid <= last))


# --- the driver-side step ----------------------------------------------------------------------
def pooled(table: pa.Table, pool: Callable[[pa.Table], list[bool]], per_group: bool
           ) -> tuple[Optional[list], np.ndarray, list]:
    """(scopes, scores, sample_ids) of a part's pooled rows: those the rest of the policy keeps
    (``pool``), with a score; scopes None for the whole run (no list of a row each)."""
    scores = table.column(E.CROSS_SCORE.name).to_numpy(zero_copy_only=False)
    ok = np.array(pool(table), bool) & ~np.isnan(scores)
    idx = np.flatnonzero(ok)
    scopes = table.column(F.IMAGE_GROUP.name).take(idx).to_pylist() if per_group else None
    return scopes, scores[idx].astype(np.float32), table.column(F.SAMPLE_ID.name).take(idx)\
        .to_pylist()


def _part_scores(part: int, read: Callable, pool: Callable, per_group: bool) -> tuple:
    scopes, scores, _ = pooled(read(part), pool, per_group)
    return scopes, scores


def _part_ties(part: int, read: Callable, pool: Callable, per_group: bool, at: dict) -> list:
    """(scope, sample_id) of a part's pooled rows whose score is their scope's tied cut score."""
    scopes, scores, sids = pooled(read(part), pool, per_group)
    return [(g, sid) for g, s, sid in zip(scopes or itertools.repeat(None), scores.tolist(), sids)
            if at.get(g) == s]


def plan_cut(read: Any, n_parts: int, fraction: float, per_group: bool,
             pool: Callable[[pa.Table], list[bool]]) -> Cuts:
    """The exact :data:`Cuts` of ``keep_top_fraction`` over every part: one pass gathers the
    pool's scores (4 bytes a row, plus the image group per_group), a second the sample_ids of the
    rows tied at a cut score, only where the tie straddles the cut."""
    got = read.map(functools.partial(_part_scores, read=read, pool=pool, per_group=per_group),
                   list(range(n_parts)))
    scopes = [g for gs, _ in got for g in gs] if per_group else None
    scores = np.concatenate([s for _, s in got]) if got else np.zeros(0, np.float32)
    cuts, ties = cut_scores(scopes, scores, Fraction(str(fraction)))
    if not ties:
        return cuts
    found = read.map(functools.partial(_part_ties, read=read, pool=pool, per_group=per_group,
                                       at={g: cuts[g][0] for g in ties}), list(range(n_parts)))
    tied: dict = {}
    for g, sid in (x for part in found for x in part):
        tied.setdefault(g, []).append(sid)
    for g, need in ties.items():
        cuts[g] = (cuts[g][0], sorted(tied[g])[need - 1])
    return cuts


def cut_scores(scopes: Optional[list], scores: np.ndarray, fraction: Fraction
               ) -> tuple[Cuts, dict]:
    """Each scope's cut score t (its ``ceil(f·n)``-th largest), and, for the scopes whose rows
    at t do not all fit, how many of those rows stay (``{scope: need}``)."""
    cuts: Cuts = {}
    ties: dict = {}
    for g, s in _by_scope(scopes, scores):
        n = len(s)
        k = -(-fraction.numerator * n // fraction.denominator)
        if k >= n:
            continue
        s = np.sort(s)[::-1]
        t = float(s[k - 1])
        cuts[g] = (t, None)
        if s[k] == s[k - 1]:
            ties[g] = k - int((s > s[k - 1]).sum())
    return cuts, ties


def _by_scope(scopes: Optional[list], scores: np.ndarray) -> Iterable[tuple[Any, np.ndarray]]:
    if scopes is None or not scopes:
        yield None, scores
        return
    codes, inverse = np.unique(np.array(scopes, object), return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.flatnonzero(np.diff(inverse[order])) + 1
    for g, idx in zip(codes, np.split(order, bounds)):
        yield g, scores[idx]
