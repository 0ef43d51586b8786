"""Names of the annotations the trainer reads from each sample's ``{key}.json``: the columns of
the mining, recaption and concepts stages, taken from their schema modules."""
from __future__ import annotations

import importlib
from dataclasses import dataclass


def _name(module: str, attr: str, fallback: str) -> str:
    try:
        return getattr(importlib.import_module(f"vlcurate.schemas.{module}"), attr).name
    except (ImportError, AttributeError):
        return fallback


@dataclass(frozen=True)
class AnnotationNames:
    hard_ids: str = _name("mining", "HARD_IDS", "hpm_hard_ids")
    positive_ids: str = _name("mining", "POSITIVE_IDS", "positive_ids")
    recaptions: str = _name("recaption", "RECAPTIONS", "recaptions")
    object_ids: str = _name("concepts", "OBJECT_IDS", "object_ids")
    object_probs: str = _name("concepts", "OBJECT_PROBS", "object_probs")
    attribute_ids: str = _name("concepts", "ATTRIBUTE_IDS", "attribute_ids")
    attribute_probs: str = _name("concepts", "ATTRIBUTE_PROBS", "attribute_probs")
