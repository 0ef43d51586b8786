"""Columns and tables of DiHT's CAT filter: the ``cat`` stage (semantic parse: complexity
and actions) and the ``textspot`` stage (OCR text spotting matched against the caption), plus the
per-run concept-vocabulary table that ``cat`` writes beside its table.

Every name is prefixed (``cat_`` / ``ocr_`` / ``textspot_``) because export joins all stages'
columns into one table by name.
"""
from __future__ import annotations

import pyarrow as pa

from .tables import stage_table

# --- cat: the semantic graph of the caption -------------------------------------------------------
RELATION_TYPE = pa.struct([pa.field("head", pa.string(), nullable=False),
                           pa.field("rel", pa.string(), nullable=False),
                           pa.field("tail", pa.string(), nullable=False)])

CAT_OBJECTS = pa.field("cat_objects", pa.list_(pa.string()), metadata={
    "doc": "objects: lemmas of nouns that modify no other noun (proper nouns excluded), in token "
           "order, one entry per object token"})
CAT_ATTRIBUTES = pa.field("cat_attributes", pa.list_(pa.string()), metadata={
    "doc": "attributes of objects and of attributes (adjectival and noun modifiers, predicate "
           "adjectives), in token order"})
CAT_ACTIONS = pa.field("cat_actions", pa.list_(pa.string()), metadata={
    "doc": "action lemmas: verbs other than forms of be/look/seem/have"})
CAT_RELATIONS = pa.field("cat_relations", pa.list_(RELATION_TYPE), metadata={
    "doc": "(head, rel, tail) facts; rel is has_attr, has_part, is_act_subj, act_has_subj, "
           "is_act_obj or act_has_obj (the action facts in both directions)"})
CAT_COMPLEXITY = pa.field("cat_complexity", pa.int16(), metadata={
    "doc": "max number of has_attr/has_part/is_act_subj/is_act_obj facts whose head is one object; "
           "-1 when the caption has no object; null when the parse did not run"})
CAT_N_ACTIONS = pa.field("cat_n_actions", pa.int16(), metadata={"doc": "number of action tokens"})
CAT_MODEL = pa.field("cat_model", pa.string(), metadata={
    "doc": "spaCy pipeline that parsed the caption: 'name version (label scheme)'"})
CAT_SKIPPED = pa.field("cat_skipped", pa.string(), metadata={
    "doc": "null when the parse ran; otherwise which CAT part was skipped for this row, and why"})

# --- textspot: OCR and the caption match ----------------------------------------------------------
OCR_TEXTS = pa.field("ocr_texts", pa.list_(pa.string()), metadata={
    "doc": "text lines the OCR backend spotted, best confidence first (at most "
           "textspot.max_texts)"})
OCR_CONFS = pa.field("ocr_confs", pa.list_(pa.float32()), metadata={
    "doc": "spotting confidence in [0, 1] of each ocr_texts entry"})
OCR_MATCH_CHARS = pa.field("ocr_match_chars", pa.int16(), metadata={
    "doc": "longest run of characters shared by one confident spotted line and the caption, after "
           "normalisation (NFKC, casefold, letters and digits only); 0 when none"})
OCR_MATCH = pa.field("ocr_match", pa.string(), metadata={
    "doc": "that shared run (normalised); null when ocr_match_chars is 0"})
OCR_MATCH_CONF = pa.field("ocr_match_conf", pa.float32(), metadata={
    "doc": "confidence of the spotted line that gave ocr_match"})
TEXTSPOT_SKIPPED = pa.field("textspot_skipped", pa.string(), metadata={
    "doc": "null when OCR ran on the row; otherwise why text spotting was skipped for it"})

# --- concept vocabulary (cat/concepts.parquet) ----------------------------------------------------
CONCEPT_KIND = pa.field("kind", pa.string(), nullable=False, metadata={"doc": "object | attribute"})
CONCEPT = pa.field("concept", pa.string(), nullable=False)
CONCEPT_CAPTIONS = pa.field("n_captions", pa.int64(), nullable=False, metadata={
    "doc": "parsed captions that mention the concept (each caption counts once)"})
CONCEPT_KEPT = pa.field("n_kept", pa.int64(), nullable=False, metadata={
    "doc": "of those, captions the CAT parse rule kept"})

# --- tables ---------------------------------------------------------------------------------------
CAT = stage_table(CAT_OBJECTS, CAT_ATTRIBUTES, CAT_ACTIONS, CAT_RELATIONS, CAT_COMPLEXITY,
                  CAT_N_ACTIONS, CAT_MODEL, CAT_SKIPPED)
TEXTSPOT = stage_table(OCR_TEXTS, OCR_CONFS, OCR_MATCH_CHARS, OCR_MATCH, OCR_MATCH_CONF,
                       TEXTSPOT_SKIPPED)
CONCEPTS = pa.schema([CONCEPT_KIND, CONCEPT, CONCEPT_CAPTIONS, CONCEPT_KEPT])

ALL = {"cat": CAT, "textspot": TEXTSPOT, "concepts": CONCEPTS}

# the reason codes of stages cat and textspot (collected into schemas.reasons)
REASON_CODES = {"CAT_LOW_COMPLEXITY": "cat.low_complexity", "CAT_NO_ACTION": "cat.no_action",
           "CAT_TEXT_SPOTTED": "cat.text_spotted"}
