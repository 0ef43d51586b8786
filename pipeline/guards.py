"""Loud guards: a stage that flags more of its rows than it should says so, names its top
reason and every setting that changes that decision, and (``run.max_reject_fraction``) can stop
the run; a run that exports nothing says why (:func:`empty_export`).

A first run on one's own data that exports 11 of 3,762 pairs with exit code 0 is worse than an
error: the usual causes are a default tuned for LAION scale (``hpm.k``), a filter meant for
another kind of caption (CAT on product names), or a source misread (wrong ``images_dir``).
Each filter declares its own expected share of flagged rows (``expected_reject``) and the
settings behind each of its reasons (``knobs``, ``stages/base.py``): above that share, or above
``run.warn_reject_fraction`` when that is lower, the stage prints a WARNING. Nothing here names a
stage.
"""
from __future__ import annotations

import fnmatch
from typing import Iterable, Optional

from vlcurate.schemas import F


def _stages(dag: Optional[list]) -> list[type]:
    """The stage classes of ``dag`` (default: the default DAG), in order."""
    from .dag import default_dag
    return [n.stage for n in (default_dag() if dag is None else dag)]


def knob(reason: str, dag: Optional[list] = None) -> str:
    """Every setting that changes the decision behind ``reason``: the ``knobs`` a stage of
    ``dag`` declares for it (an exact code before a pattern); for a reason no stage declares,
    its stage's section (``<stage>.*``) and ``export.drop``."""
    knobs = [kv for stage in _stages(dag) for kv in stage.knobs.items()]
    found = next((k for pattern, k in knobs if pattern == reason), None) or \
        next((k for pattern, k in knobs if fnmatch.fnmatchcase(reason, pattern)), None)
    stage = reason.split(".")[0]
    return found or (f"the {stage}.* settings, or export.drop without {reason} to export "
                     "these rows")


def expected(stage: str, threshold: float, dag: Optional[list] = None) -> float:
    """The share above which ``stage`` warns: its own ``expected_reject``, or ``threshold``
    (``run.warn_reject_fraction``) when that is lower or the stage declares none."""
    share = next((s.expected_reject for s in _stages(dag) if s.name == stage), None)
    return min(threshold if share is None else share, threshold)


def reject_share(manifest: dict) -> float:
    return manifest[F.MK.ROWS_REJECTED] / manifest[F.MK.ROWS_IN] if manifest[F.MK.ROWS_IN] else 0.0


def _top(reasons: dict) -> tuple[str, int]:
    return max(reasons.items(), key=lambda kv: (kv[1], kv[0]))


def warning(manifest: dict, threshold: float, dag: Optional[list] = None) -> Optional[str]:
    """One sentence when ``manifest``'s stage flagged more than its expected share of its rows
    (or ``threshold``, when lower)."""
    share, stage = reject_share(manifest), manifest["stage"]
    limit = expected(stage, threshold, dag)
    if stage == "export" or not manifest[F.MK.ROWS_IN] or share <= limit:
        return None
    reasons = manifest[F.MK.REASON_COUNTS] or {"?": manifest[F.MK.ROWS_REJECTED]}
    top, n = _top(reasons)
    usual = f"; expected at most {limit:.0%}" if limit < threshold else ""
    return (f"{stage} flagged {manifest[F.MK.ROWS_REJECTED]} of the "
            f"{manifest[F.MK.ROWS_IN]} rows it saw ({share:.0%}{usual}); top reason {top} "
            f"({n} rows): check {knob(top, dag)}")


def stop_reason(manifest: dict, limit: Optional[float],
                dag: Optional[list] = None) -> Optional[str]:
    """Why the run stops after this stage (``run.max_reject_fraction``), or None."""
    if limit is None or manifest["stage"] == "export" or reject_share(manifest) <= limit:
        return None
    return (f"{warning(manifest, limit, dag)}. The run stops here because "
            f"run.max_reject_fraction is {limit}; committed stages are kept, rerun after "
            "changing the setting")


def empty_export(manifests: Iterable[dict], drop: Iterable[str], n: int = 5,
                 dag: Optional[list] = None) -> Optional[str]:
    """When the export kept no row of a run that had some: the reasons that dropped the most
    rows, each with the settings that decide it (lines), else None."""
    export = next((m for m in manifests if m["stage"] == "export"), None)
    if export is None or export[F.MK.ROWS_KEPT] or not export[F.MK.ROWS_IN]:
        return None
    ranked = sorted((export[F.MK.REASON_COUNTS] or {}).items(), key=lambda kv: (-kv[1], kv[0]))
    lines = [f"  {reason}: {count} rows; check {knob(reason, dag)}" for reason, count in ranked[:n]]
    more = [f"  ... and {len(ranked) - n} more reasons (`vlcurate inspect RUN_DIR`)"] \
        if len(ranked) > n else []
    policy = (f"  export.drop is {list(drop)}: a reason it does not match stays an annotation "
              "on an exported row (ingest.* reasons always drop)")
    return "\n".join(["the reasons that dropped the rows (a row may have several):", *lines,
                      *more, policy])
