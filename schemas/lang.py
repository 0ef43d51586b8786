"""Columns of the language-ID filter (stage ``lang``): which language each caption is in.

DiHT's CAT parse is an English parse, applied to English data; on multilingual web alt text it
keeps far fewer rows (19% here against DiHT's 30% of LAION). ``lang`` runs before ``cat``.
"""
from __future__ import annotations

import pyarrow as pa

from .tables import stage_table

LANG = pa.field("lang", pa.string(), metadata={
    "doc": "ISO 639-1 code of the caption's most likely language, by the detector that decided "
           "(fastText lid.176 or langid.py; lang.detector)"})
LANG_PROB = pa.field("lang_prob", pa.float32(), metadata={
    "doc": "probability that the caption is in one of lang.keep (normalised over all languages)"})

LANG_TABLE = stage_table(LANG, LANG_PROB)

ALL = {"lang": LANG_TABLE}

# the reason codes of stage lang (collected into schemas.reasons)
REASON_CODES = {"LANG_OTHER": "lang.other"}      # the caption is not (likely) in one of lang.keep
