"""Columns and tables of hard-pair mining (HELIP HPM / FastHPM, noise pairs) and of the
positives (FFF Eq. 1 false negatives, HELIP near-duplicates).

Two stages write them (see stages/mining/):

* ``hpm``: one row per ingest row, the target's hard set (ids and scores, best first), how many
  pairs support it, whether it is a noise pair, and whether FastHPM could certify its top-k;
* ``positives``: one row per ingest row, the other samples that are positives of it, with the
  rule that made each one a positive and that rule's similarity.
"""
from __future__ import annotations

import pyarrow as pa

from . import fields as F
from .tables import stage_table

# --- hpm stage -------------------------------------------------------------------------------------
HARD_IDS = pa.field("hpm_hard_ids", pa.list_(pa.string()), metadata={
    "doc": "sample_ids of the target's k hard pairs, best first (HELIP Alg. 1); empty for a "
           "noise pair; null when the row was not mined"})
HARD_SCORES = pa.field("hpm_hard_scores", pa.list_(pa.float32()), metadata={
    "doc": "thresholded product S~I_j * S~T_j of each hard pair, aligned with hpm_hard_ids"})
SUPPORT = pa.field("hpm_support", pa.int32(), metadata={
    "doc": "pairs with a positive score (duplicates and the target excluded); exact HPM: all of "
           "them; FastHPM: those among the retrieved candidates (a lower bound)"})
SIBLINGS = pa.field("hpm_sibling_support", pa.int32(), metadata={
    "doc": "other captions of the target's image (image_group) that agree with its caption (S_tt "
           "> hpm.siblings.tau_text) and are not in hpm_support: support in the noise rule; 0 "
           "with one caption per image"})
IS_NOISE = pa.field("hpm_is_noise", pa.bool_(), metadata={
    "doc": "HELIP noise pair: fewer than k pairs (hpm_support + hpm_sibling_support) support "
           "the target"})
CERTIFIED = pa.field("hpm_certified", pa.bool_(), metadata={
    "doc": "the hard set is provably the exact top-k (exact: always; blocks: k-th product >= "
           "the triangle bound on every unprobed cluster, or no pair left out can score > 0; "
           "FastHPM: the same test with a bound estimated from the IVF-PQ search)"})

# what hpm's neighbour pass found besides hard pairs: every pair with S_I or S_T (and,
# with cross-modal vectors, X_ii, X_tt or S_it) above hpm's pair floors, with its exact
# similarities. They are the positives stage's candidates: it applies FFF Eq. 1 and the
# duplicate rule to them, so a positives threshold change reruns positives only, with no
# search. Aligned lists, sorted by the other row's global position.
PAIR_IDS = pa.field("hpm_pair_ids", pa.list_(pa.string()), metadata={
    "doc": "sample_ids j of the candidate pairs (i, j): S_ii or X_ii > positives.candidates.image, "
           "S_tt or X_tt > positives.candidates.text, or S_it > positives.candidates.cross; null "
           "when not mined or method fast"})
PAIR_SII = pa.field("hpm_pair_sii", pa.list_(pa.float32()), metadata={
    "doc": "exact image-image cosine S_ii of each candidate pair (HELIP's image encoder)"})
PAIR_STT = pa.field("hpm_pair_stt", pa.list_(pa.float32()), metadata={
    "doc": "exact text-text cosine S_tt of each candidate pair (HELIP's text encoder)"})
PAIR_SIT = pa.field("hpm_pair_sit", pa.list_(pa.float32()), metadata={
    "doc": "exact cross-modal S_it = <cross image i, cross text j> (directed); null without "
           "cross-modal embeddings"})
PAIR_XII = pa.field("hpm_pair_xii", pa.list_(pa.float32()), metadata={
    "doc": "exact image-image cosine X_ii of each candidate pair on the cross-modal model (FFF's "
           "S_ii); null without cross-modal embeddings"})
PAIR_XTT = pa.field("hpm_pair_xtt", pa.list_(pa.float32()), metadata={
    "doc": "exact caption-caption cosine X_tt of each candidate pair on the cross-modal model "
           "(FFF's S_tt on the original captions); null without cross-modal embeddings"})
PAIRS_CUT = pa.field("hpm_pairs_cut", pa.int32(), metadata={
    "doc": "candidate pairs above the floors that positives.candidates.max_pairs left out of "
           "this row's hpm_pair_* lists (the lowest max(S_ii, S_tt, S_it, X_ii, X_tt)); null when "
           "not mined or method fast"})

# --- positives stage --------------------------------------------------------------------------------
POSITIVE_IDS = pa.field("positive_ids", pa.list_(pa.string()), metadata={
    "doc": "sample_ids j whose pair with this row is a positive (M[i, j] of FFF Eq. 1, or a "
           "HELIP near-duplicate); best relation first, then highest score"})
POSITIVE_RELATIONS = pa.field("positive_relations", pa.list_(pa.string()), metadata={
    "doc": "why each positive is one: duplicate | image | cross | text (see REL_*)"})
POSITIVE_CAPTIONS = pa.field("positive_captions", pa.list_(pa.int8()), metadata={
    "doc": "FFF sec. 4.3: which caption of each positive sample j is a positive text of this "
           "row's image: 0 = its caption, r = its r-th recaption (aligned with positive_ids; a "
           "sample appears once per positive caption)"})
POSITIVE_COUNT = pa.field("positive_count", pa.int32(), metadata={
    "doc": "positives found before positives.max_positives cut the lists (exact method: all of "
           "them; fast method: those among the retrieved candidates, a lower bound)"})
POSITIVE_SCORES = pa.field("positive_scores", pa.list_(pa.float32()), metadata={
    "doc": "the similarity that fired the relation (duplicate: max(S_ii, S_tt) of the unimodal "
           "encoders; image: S_ii; cross: S_it; text: S_tt)"})

# relation codes, in priority order (a pair that matches several rules gets the first)
REL_DUPLICATE = "duplicate"   # S_ii > dup or S_tt > dup (HELIP: not a hard pair, a positive)
REL_IMAGE = "image"           # S_ii > p2
REL_CROSS = "cross"           # S_it > p1 (only with a cross-modal embedding)
REL_TEXT = "text"             # S_tt > p3 (and S_it > p1' with a cross-modal embedding)
# a text duplicate (S_tt > dup) also needs S_it > p1' with a cross-modal embedding
RELATIONS = (REL_DUPLICATE, REL_IMAGE, REL_CROSS, REL_TEXT)

# --- tables -------------------------------------------------------------------------------------------
HARD_PAIRS = stage_table(HARD_IDS, HARD_SCORES, SUPPORT, SIBLINGS, IS_NOISE, CERTIFIED, PAIR_IDS, PAIR_SII,
                         PAIR_STT, PAIR_SIT, PAIR_XII, PAIR_XTT, PAIRS_CUT)
POSITIVES = stage_table(POSITIVE_IDS, POSITIVE_CAPTIONS, POSITIVE_RELATIONS, POSITIVE_SCORES,
                        POSITIVE_COUNT)

ALL = {"hard_pairs": HARD_PAIRS, "positives": POSITIVES}

# the reason codes of stages hpm and dedup (collected into schemas.reasons)
REASON_CODES = {"HPM_NOISE": "hpm.noise_pair",
           "DEDUP_NEAR": "dedup.near_duplicate"}   # all but the first row of a near-duplicate group
