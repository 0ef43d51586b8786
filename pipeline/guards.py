"""Loud guards: a stage that flags more of its rows than it should says so, names its top
reason and every setting that changes that decision, and (``run.max_reject_fraction``) can stop
the run; a run that exports nothing says why (:func:`empty_export`).

A first run on one's own data that exports 11 of 3,762 pairs with exit code 0 is worse than an
error: the usual causes are a default tuned for LAION scale (``hpm.k``), a filter meant for
another kind of caption (CAT on product names), or a source misread (wrong ``images_dir``).
Each filter has its own expected share of flagged rows (:data:`EXPECTED`): above it, or above
``run.warn_reject_fraction`` when that is lower, the stage prints a WARNING.
"""
from __future__ import annotations

import fnmatch
from typing import Iterable, Optional

from vlcurate.schemas import F

# stage -> the share of the rows it saw that it is expected to flag, at most, on a clean set in
# one language; more means a setting does not fit this data. Stages not listed (plug-ins) warn
# above run.warn_reject_fraction only.
EXPECTED = {
    "ingest": 0.50,     # broken files and captions (img2dataset sets lose 20-40% to downloads)
    "ids": 0.05,        # repeated keys: the key column is not unique
    "lang": 0.20,       # language ID: a monolingual set rarely loses more than a few percent
    "cat": 0.50,        # DiHT's CAT parse: complexity and action (Flickr: ~11%, COCO: ~20%)
    "textspot": 0.30,   # text in the image that repeats the caption
    "hpm": 0.50,        # HELIP's noise pairs
    "dedup": 0.30,      # near-duplicates
}

# reason pattern -> every setting that changes that decision (first match wins)
KNOBS = (
    ("hpm.noise_pair", "hpm.k (a row needs k supporting pairs: a small set needs a small k), "
                       "hpm.tau_image / hpm.tau_text (similarities at or below them count as 0), "
                       "or hpm.noise_action=mark to keep the rows and only mark them"),
    ("cat.no_action", "cat.require_action=false (DiHT keeps captions with an action), "
                      "cat.participle_actions, cat.verb_nouns (verbs the tagger read as nouns), "
                      "or cat.title_case=lower for Title Case captions "
                      "(product names)"),
    ("cat.low_complexity", "cat.min_complexity (-1 keeps captions with no object), or "
                           "cat.title_case=lower for Title Case captions (product names), "
                           "whose capitalised words parse as proper nouns, never objects"),
    ("cat.text_spotted", "textspot.min_chars / textspot.min_conf"),
    ("lang.other", "lang.keep (the caption languages to keep), lang.min_prob (flag when "
                   "P(caption in lang.keep) is below it; lower for short captions), or "
                   "lang.detector (which detectors must all agree to flag)"),
    ("dedup.near_duplicate", "hpm.dup_threshold (S_ii or S_tt above it is a duplicate), "
                             "positives.duplicates=false, or export.drop without "
                             "dedup.near_duplicate to export every copy"),
    ("ingest.duplicate_id", "source.key_column (the column that names each record)"),
    ("ingest.missing_file", "source.path / source.images_dir / source.image_column"),
    ("ingest.caption_too_long", "ingest.max_caption_chars"),
    ("ingest.image_too_small", "ingest.min_side"),
    ("ingest.image_too_large", "ingest.max_pixels"),
    ("ingest.file_too_large", "source.max_image_bytes"),
    ("ingest.outside_source", "source.allow_outside_source"),
    ("ingest.bad_caption", "source.caption_column (the column of caption text)"),
    ("ingest.missing_caption", "source.caption_column (the column of caption text)"),
    ("ingest.*", "the source settings (source.path, source.kind, source.caption_column; "
                 "`vlcurate inspect RUN_DIR` shows examples)"),
)


def knob(reason: str) -> str:
    """Every setting that changes the decision behind ``reason``; for a plug-in's reason, its
    stage's section (``<stage>.*``) and ``export.drop``."""
    found = next((k for pattern, k in KNOBS if fnmatch.fnmatchcase(reason, pattern)), None)
    stage = reason.split(".")[0]
    return found or (f"the {stage}.* settings, or export.drop without {reason} to export "
                     "these rows")


def expected(stage: str, threshold: float) -> float:
    """The share above which ``stage`` warns: its own expected share, or ``threshold``
    (``run.warn_reject_fraction``) when that is lower."""
    return min(EXPECTED.get(stage, threshold), threshold)


def reject_share(manifest: dict) -> float:
    return manifest[F.MK.ROWS_REJECTED] / manifest[F.MK.ROWS_IN] if manifest[F.MK.ROWS_IN] else 0.0


def _top(reasons: dict) -> tuple[str, int]:
    return max(reasons.items(), key=lambda kv: (kv[1], kv[0]))


def warning(manifest: dict, threshold: float) -> Optional[str]:
    """One sentence when ``manifest``'s stage flagged more than its expected share of its rows
    (or ``threshold``, when lower)."""
    share, stage = reject_share(manifest), manifest["stage"]
    limit = expected(stage, threshold)
    if stage == "export" or not manifest[F.MK.ROWS_IN] or share <= limit:
        return None
    reasons = manifest[F.MK.REASON_COUNTS] or {"?": manifest[F.MK.ROWS_REJECTED]}
    top, n = _top(reasons)
    usual = f"; expected at most {limit:.0%}" if limit < threshold else ""
    return (f"{stage} flagged {manifest[F.MK.ROWS_REJECTED]} of the "
            f"{manifest[F.MK.ROWS_IN]} rows it saw ({share:.0%}{usual}); top reason {top} "
            f"({n} rows): check {knob(top)}")


def stop_reason(manifest: dict, limit: Optional[float]) -> Optional[str]:
    """Why the run stops after this stage (``run.max_reject_fraction``), or None."""
    if limit is None or manifest["stage"] == "export" or reject_share(manifest) <= limit:
        return None
    return (f"{warning(manifest, limit)}. The run stops here because run.max_reject_fraction is "
            f"{limit}; committed stages are kept, rerun after changing the setting")


def empty_export(manifests: Iterable[dict], drop: Iterable[str], n: int = 5) -> Optional[str]:
    """When the export kept no row of a run that had some: the reasons that dropped the most
    rows, each with the settings that decide it (lines), else None."""
    export = next((m for m in manifests if m["stage"] == "export"), None)
    if export is None or export[F.MK.ROWS_KEPT] or not export[F.MK.ROWS_IN]:
        return None
    ranked = sorted((export[F.MK.REASON_COUNTS] or {}).items(), key=lambda kv: (-kv[1], kv[0]))
    lines = [f"  {reason}: {count} rows; check {knob(reason)}" for reason, count in ranked[:n]]
    more = [f"  ... and {len(ranked) - n} more reasons (`vlcurate inspect RUN_DIR`)"] \
        if len(ranked) > n else []
    policy = (f"  export.drop is {list(drop)}: a reason it does not match stays an annotation "
              "on an exported row (ingest.* reasons always drop)")
    return "\n".join(["the reasons that dropped the rows (a row may have several):", *lines,
                      *more, policy])
