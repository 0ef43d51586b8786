"""The annotations the trainer reads from each sample's ``{key}.json``, named only through the
schema objects of the stages that write them (``schemas/mining.py``, ``recaption.py``,
``concepts.py``): export writes every JSON-friendly column under its schema name, so these are
the keys. There is no fallback name: an annotation the configured loss needs and the shards lack
stops the trainer with a reason (``require``), instead of training on empty targets.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vlcurate.schemas import concepts as CO
from vlcurate.schemas import mining as MI
from vlcurate.schemas import recaption as RC


@dataclass(frozen=True)
class AnnotationNames:
    hard_ids: str = MI.HARD_IDS.name
    positive_ids: str = MI.POSITIVE_IDS.name
    positive_relations: str = MI.POSITIVE_RELATIONS.name
    recaptions: str = RC.RECAPTIONS.name
    object_ids: str = CO.CONCEPT_OBJECT_IDS.name
    object_probs: str = CO.CONCEPT_OBJECT_PROBS.name
    attribute_ids: str = CO.CONCEPT_ATTRIBUTE_IDS.name
    attribute_probs: str = CO.CONCEPT_ATTRIBUTE_PROBS.name


A = AnnotationNames()


class MissingAnnotation(ValueError):
    """A configured annotation is absent from the exported shards."""


def needed(cfg: Any) -> dict[str, str]:
    """``{column: why}`` for every annotation the finetune config reads."""
    out: dict[str, str] = {}
    if cfg.loss == "helip":
        out[A.hard_ids] = "finetune.loss=helip (stage hpm)"
    multi = cfg.loss in ("sigmoid", "mp_nce")
    if multi and cfg.fff_mined_positives:
        out[A.positive_ids] = f"finetune.loss={cfg.loss} with fff_mined_positives (stage positives)"
        if cfg.loss == "mp_nce":
            out[A.positive_relations] = "finetune.loss=mp_nce: the relation picks the domains"
    if multi and cfg.fff_recaptions:
        out[A.recaptions] = f"finetune.loss={cfg.loss} with fff_recaptions > 0 (stage recaption)"
    if cfg.concept_weight:
        for col in (A.object_ids, A.object_probs, A.attribute_ids, A.attribute_probs):
            out[col] = "finetune.concept_weight > 0 (stage concepts)"
    return out


def require_rows(cfg: Any, missing: dict, where: str) -> list[str]:
    """Refuse (``MissingAnnotation``) kept rows that lack an annotation the config reads, as the
    export's manifest counts them (``missing``: {column: {"rows", "why"}}), unless
    ``finetune.allow_missing``; then return what the trainer goes on without, for the log."""
    same: dict[tuple, list[str]] = {}        # columns lacking on the same rows, for one reason
    for c, why in needed(cfg).items():
        m = missing.get(c) or {}
        if m.get("rows"):
            same.setdefault((m["rows"], why, json.dumps(m.get("why"), sort_keys=True)), []).append(c)
    lines = [f"{rows} kept rows lack {', '.join(cols)} (needed by {why}; why: "
             + ", ".join(f"{n} {w}" for w, n in sorted(json.loads(whys).items(),
                                                       key=lambda x: -x[1])) + ")"
             for (rows, why, whys), cols in same.items()]
    if lines and not cfg.allow_missing:
        raise MissingAnnotation(f"{where}: {'; '.join(lines)}. Re-export with a policy that drops "
                                "them, or set finetune.allow_missing=true to train on them anyway")
    return lines


def require(cfg: Any, meta: dict, where: str) -> None:
    """Raise ``MissingAnnotation`` naming each configured annotation absent from ``meta`` (a
    sample's ``{key}.json``; every sample of an export has the same keys)."""
    missing = {c: why for c, why in needed(cfg).items() if c not in meta}
    if missing:
        lines = "; ".join(f"{c} (needed by {why})" for c, why in missing.items())
        raise MissingAnnotation(
            f"{where}: the shards lack {lines}. Run the stage that writes it before export (and "
            "keep it out of export.exclude_columns), or turn the option off in finetune.*")
