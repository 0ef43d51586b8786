"""Columns and tables of DiHT's concept-distillation targets (stage ``concepts``).

Per sample: the teacher heads' top-k objects and attributes (concept ids into the vocabulary
table, uint16) with their renormalised probabilities (float16, best first; they sum to 1 up to
float16 rounding). The vocabulary table (``<run>/concepts/vocab.parquet``) maps ids to WordNet
synsets. Ids are per run: a rerun that changes the vocabulary changes them.

The concept words come from the CAT parse (``schemas/cat.py``: ``cat_objects``,
``cat_attributes``).
"""
from __future__ import annotations

import pyarrow as pa

from .cat import CONCEPT_KIND, CAT_ATTRIBUTES, CAT_OBJECTS
from .fields import embedding
from .tables import stage_table

OBJECT_WORDS, ATTRIBUTE_WORDS = CAT_OBJECTS, CAT_ATTRIBUTES   # what the stage reads from cat

ID_TYPE, PROB_TYPE = pa.uint16(), pa.float16()

CONCEPT_OBJECT_IDS = pa.field("concept_object_ids", pa.list_(ID_TYPE), metadata={
    "doc": "top-k object concept ids (vocab.parquet, kind=object), most probable first"})
CONCEPT_OBJECT_PROBS = pa.field("concept_object_probs", pa.list_(PROB_TYPE), metadata={
    "doc": "their teacher probabilities, renormalised over the top k"})
CONCEPT_ATTRIBUTE_IDS = pa.field("concept_attribute_ids", pa.list_(ID_TYPE), metadata={
    "doc": "top-k attribute concept ids (vocab.parquet, kind=attribute), most probable first"})
CONCEPT_ATTRIBUTE_PROBS = pa.field("concept_attribute_probs", pa.list_(PROB_TYPE), metadata={
    "doc": "their teacher probabilities, renormalised over the top k"})
CONCEPT_TEACHER = pa.field("concept_teacher", pa.string(), metadata={"doc": "teacher model id"})
CONCEPT_RANDOM = pa.field("concept_random_weights", pa.bool_(), metadata={
    "doc": "true when the teacher backbone had random weights (tests, demo)"})

# the teacher stage's table: each kept image's frozen teacher features (float16), the heads' input
TEACHER_FEATURES_NAME = "teacher_features"


def teacher_features(dim: int) -> pa.Field:
    return embedding(TEACHER_FEATURES_NAME, dim, float16=True)


TEACHER_FEATURES = pa.field(TEACHER_FEATURES_NAME, pa.list_(pa.float16()))  # its name, any width


def teacher_table(dim: int) -> pa.Schema:
    return stage_table(teacher_features(dim), CONCEPT_TEACHER, CONCEPT_RANDOM)


CONCEPT_TARGETS = stage_table(CONCEPT_OBJECT_IDS, CONCEPT_OBJECT_PROBS, CONCEPT_ATTRIBUTE_IDS,
                              CONCEPT_ATTRIBUTE_PROBS, CONCEPT_TEACHER, CONCEPT_RANDOM)

# --- the vocabulary (<run>/concepts/vocab.parquet), one row per concept ---------------------------
V_ID = pa.field("concept_id", ID_TYPE, nullable=False, metadata={"doc": "id within its kind"})
V_KIND = CONCEPT_KIND   # "object | attribute", declared with the per-run concept counts
V_SYNSET = pa.field("synset", pa.string(), nullable=False, metadata={
    "doc": "WordNet 3.0 synset, nltk-style name (dog.n.01, red.s.01)"})
V_GLOSS = pa.field("gloss", pa.string(), metadata={"doc": "WordNet definition"})
V_WORDS = pa.field("words", pa.list_(pa.string()), metadata={
    "doc": "caption words canonicalised to it, most frequent first (at most 10)"})
V_N_IMAGES = pa.field("n_images", pa.int64(), nullable=False, metadata={
    "doc": "training images whose caption mentions it"})
V_SHAREDNESS = pa.field("sharedness", pa.int32(), metadata={
    "doc": "attributes: distinct vocabulary objects it co-occurs with; null for objects"})
V_VISUALNESS = pa.field("visualness", pa.float32(), metadata={
    "doc": "attributes: held-out ROC AUC of its teacher head; null when not measured"})

CONCEPT_VOCAB = pa.schema([V_ID, V_KIND, V_SYNSET, V_GLOSS, V_WORDS, V_N_IMAGES, V_SHAREDNESS,
                           V_VISUALNESS])

ALL = {"concept_targets": CONCEPT_TARGETS, "concept_vocab": CONCEPT_VOCAB}
