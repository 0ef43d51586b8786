"""Columns of FFF's BLIP-2 recaptioning (stage ``recaption``).

Every caption the beam search returns is kept, ordered by its sequence score (best first); a
caption that looks degenerate is flagged in ``recaption_flags`` (same position), never dropped.
Rows the stage did not compute (flagged upstream) have nulls in every column.
"""
from __future__ import annotations

import pyarrow as pa

from .tables import stage_table

# per-caption flags (position-aligned with RECAPTIONS; null = the caption looks fine)
FLAG_EMPTY = "empty"                # no letter or digit after decoding
FLAG_REPETITIVE = "repetitive"      # a 1-3 word n-gram back to back recaption.max_repeats times
FLAG_DUPLICATE = "duplicate"        # the same text (case/space-insensitive) as a better beam
FLAG_TRUNCATED = "truncated"        # hit max_new_tokens without an end-of-sequence token
FLAGS = (FLAG_EMPTY, FLAG_REPETITIVE, FLAG_DUPLICATE, FLAG_TRUNCATED)

RECAPTIONS = pa.field("recaptions", pa.list_(pa.string()), metadata={
    "doc": "BLIP-2 beam-search captions (num_return_sequences of them, FFF: 5), best score first; "
           "the prompt is not included unless recaption.prompt_in_caption"})
RECAPTION_SCORES = pa.field("recaption_scores", pa.list_(pa.float32()), metadata={
    "doc": "sequence score of each caption: sum of token log-probabilities / length ** "
           "length_penalty (transformers' beam-search sequences_scores), descending"})
RECAPTION_FLAGS = pa.field("recaption_flags", pa.list_(pa.string()), metadata={
    "doc": "per caption: null when it looks fine, else the first of empty | repetitive | "
           "duplicate | truncated that applies"})
RECAPTION_N_CLEAN = pa.field("recaption_n_clean", pa.int8(), metadata={
    "doc": "number of captions with no flag"})
RECAPTION_MODEL = pa.field("recaption_model", pa.string(), metadata={"doc": "captioner model id"})
RECAPTION_RANDOM = pa.field("recaption_random_weights", pa.bool_(), metadata={
    "doc": "true when the captioner ran with random weights (tests, demo): captions are noise"})

RECAPTION = stage_table(RECAPTIONS, RECAPTION_SCORES, RECAPTION_FLAGS, RECAPTION_N_CLEAN,
                        RECAPTION_MODEL, RECAPTION_RANDOM)

ALL = {"recaption": RECAPTION}
