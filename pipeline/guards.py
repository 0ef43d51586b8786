"""Loud guards: a stage that flags almost everything it saw says so, names its top reason and the
setting to turn, and (``run.max_reject_fraction``) can stop the run.

A first run on one's own data that exports 11 of 3,762 pairs with exit code 0 is worse than an
error: the usual causes are a default tuned for LAION scale (``hpm.k``), a filter meant for
another kind of caption (CAT on product names), or a source misread (wrong ``images_dir``).
"""
from __future__ import annotations

import fnmatch
from typing import Optional

from vlcurate.schemas import F

# reason pattern -> what to turn (first match wins)
KNOBS = (
    ("hpm.noise_pair", "hpm.k (a row needs k supporting pairs: a small set needs a small k), or "
                       "hpm.noise_action=mark to keep the rows and only mark them"),
    ("cat.no_action", "cat.require_action=false (DiHT keeps captions with an action)"),
    ("cat.low_complexity", "cat.min_complexity (-1 keeps captions with no object)"),
    ("cat.text_spotted", "textspot.min_chars / textspot.min_conf"),
    ("lang.other", "lang.keep (the caption languages to keep) or lang.min_prob"),
    ("ingest.duplicate_id", "source.key_column (the column that names each record)"),
    ("ingest.missing_file", "source.path / source.images_dir / source.image_column"),
    ("ingest.caption_too_long", "ingest.max_caption_chars"),
    ("ingest.image_too_small", "ingest.min_side"),
    ("ingest.image_too_large", "ingest.max_pixels"),
    ("ingest.file_too_large", "source.max_image_bytes"),
    ("ingest.outside_source", "source.allow_outside_source"),
    ("ingest.*", "the source settings (`vlcurate inspect RUN_DIR` shows examples)"),
    ("*", "this stage's thresholds"),
)


def knob(reason: str) -> str:
    return next(k for pattern, k in KNOBS if fnmatch.fnmatchcase(reason, pattern))


def reject_share(manifest: dict) -> float:
    return manifest[F.MK.ROWS_REJECTED] / manifest[F.MK.ROWS_IN] if manifest[F.MK.ROWS_IN] else 0.0


def warning(manifest: dict, threshold: float) -> Optional[str]:
    """One sentence when ``manifest``'s stage flagged more than ``threshold`` of its rows."""
    share = reject_share(manifest)
    if manifest["stage"] == "export" or not manifest[F.MK.ROWS_IN] or share <= threshold:
        return None
    reasons = manifest[F.MK.REASON_COUNTS] or {"?": manifest[F.MK.ROWS_REJECTED]}
    top, n = max(reasons.items(), key=lambda kv: (kv[1], kv[0]))
    return (f"{manifest['stage']} flagged {manifest[F.MK.ROWS_REJECTED]} of the "
            f"{manifest[F.MK.ROWS_IN]} rows it saw ({share:.0%}); top reason {top} ({n} rows): "
            f"check {knob(top)}")


def stop_reason(manifest: dict, limit: Optional[float]) -> Optional[str]:
    """Why the run stops after this stage (``run.max_reject_fraction``), or None."""
    if limit is None or manifest["stage"] == "export" or reject_share(manifest) <= limit:
        return None
    return (f"{warning(manifest, limit)}. The run stops here because run.max_reject_fraction is "
            f"{limit}; committed stages are kept, rerun after changing the setting")
