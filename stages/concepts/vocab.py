"""DiHT's concept vocabulary (appendix A.1.2) from the CAT parse of the captions.

* **Objects.** Each parsed noun (``cat_objects``: lemmas) is canonicalised to its WordNet noun
  synset: the most frequent sense of the word's base form (nltk's morphy: "puppies" -> puppy.n.01,
  "automobiles" -> car.n.01, "mice" -> mouse.n.01). WordNet, not the caption, decides: puppy.n.01
  is its own synset (a hyponym of dog.n.01). With ``hypernym_backoff`` a synset under the cutoff
  is relabelled to its nearest hypernym that made the vocabulary (puppy.n.01 -> dog.n.01), an
  option DiHT does not describe (it drops them), so it is off by default. A synset is kept when
  at least ``min_object_count`` images mention it (DiHT: 250 over LAION), most frequent first.
* **Attributes.** Adjectives only: each ``cat_attributes`` word canonicalised to its WordNet
  adjective synset (words with no adjective sense, e.g. noun modifiers, are left out), kept when
  ``min_attribute_count`` images mention it and its *sharedness* (the number of distinct object
  synsets of the vocabulary it co-occurs with in a caption) is at least ``min_sharedness``.
  The *visualness* filter that follows (DiHT keeps 1200 attributes ranked by sharedness and
  visualness) needs the teacher: see ``heads.visualness``.

Counts are per image (a caption that repeats a word counts once).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from vlcurate.schemas import concepts as CO

from .wordnet import Synset, WordNet

OBJECT, ATTRIBUTE = "object", "attribute"
MAX_VOCAB = 65535            # concept ids are stored as uint16


@dataclass
class Concepts:
    """One kind of concept: names (synsets) in id order, with their statistics."""
    kind: str
    names: list[str] = field(default_factory=list)
    count: dict[str, int] = field(default_factory=dict)          # images mentioning it
    words: dict[str, Counter] = field(default_factory=dict)      # caption words mapped to it
    gloss: dict[str, str] = field(default_factory=dict)
    sharedness: dict[str, int] = field(default_factory=dict)     # attributes only
    visualness: dict[str, float] = field(default_factory=dict)   # attributes only, when measured

    def ids(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    def keep(self, names: Sequence[str]) -> "Concepts":
        return Concepts(self.kind, list(names), self.count, self.words, self.gloss,
                        self.sharedness, self.visualness)

    def rows(self) -> list[dict]:
        return [{CO.V_ID.name: i, CO.V_KIND.name: self.kind, CO.V_SYNSET.name: n,
                 CO.V_GLOSS.name: self.gloss.get(n),
                 CO.V_WORDS.name: [w for w, _ in self.words.get(n, Counter()).most_common(10)],
                 CO.V_N_IMAGES.name: self.count.get(n, 0),
                 CO.V_SHAREDNESS.name: self.sharedness.get(n),
                 CO.V_VISUALNESS.name: self.visualness.get(n)} for i, n in enumerate(self.names)]


class Canonicaliser:
    """word -> synset name, cached (a vocabulary sees few distinct words)."""

    def __init__(self, wn: WordNet, pos: str) -> None:
        self.wn, self.pos, self.cache = wn, pos, {}
        self.synsets: dict[str, Synset] = {}

    def __call__(self, word: str) -> Optional[str]:
        if word not in self.cache:
            ss = self.wn.canonical(word, self.pos) if word and word.strip() else None
            self.cache[word] = ss.name if ss else None
            if ss:
                self.synsets[ss.name] = ss
        return self.cache[word]


def _labels(rows: Iterable[Optional[Sequence[str]]], canon: Canonicaliser,
            words: dict[str, Counter]) -> list[list[str]]:
    out = []
    for r in rows:
        names: list[str] = []
        for w in r or ():
            n = canon(w)
            if n is not None and n not in names:
                names.append(n)
                words.setdefault(n, Counter())[w] += 1
        out.append(names)
    return out


def _lifter(kept: set[str], canon: Canonicaliser, backoff: bool):
    """synset -> itself when kept, else (with ``backoff``) its nearest kept hypernym (breadth
    first), else None."""
    memo: dict[str, Optional[str]] = {}

    def up(name: str) -> Optional[str]:
        if name not in memo:
            frontier, seen, memo[name] = [canon.synsets[name]], set(), None
            while frontier and memo[name] is None:
                nxt = []
                for ss in frontier:
                    for h in canon.wn.hypernyms(ss):
                        if h.name in kept:
                            memo[name] = h.name
                            break
                        if h.name not in seen:
                            seen.add(h.name)
                            nxt.append(h)
                    if memo[name] is not None:
                        break
                frontier = nxt
        return memo[name]

    return lambda n: n if n in kept else (up(n) if backoff else None)


class Tally:
    """The vocabulary's counts over every kept image, added part by part (memory: the
    vocabulary, never the images): images per synset, the caption words mapped to each, and
    which object synsets each attribute synset shares an image with (its sharedness)."""

    def __init__(self, wn: WordNet) -> None:
        self.canon_n, self.canon_a = Canonicaliser(wn, "n"), Canonicaliser(wn, "a")
        self.obj, self.att = Concepts(OBJECT), Concepts(ATTRIBUTE)
        self.obj_count: Counter = Counter()
        self.att_count: Counter = Counter()
        self.pairs: set[tuple[str, str]] = set()        # (attribute, object) in one image
        self.n_images = 0

    def add(self, objects: list, attributes: list) -> "Tally":
        o_rows = _labels(objects, self.canon_n, self.obj.words)
        a_rows = _labels(attributes, self.canon_a, self.att.words)
        for o_row, a_row in zip(o_rows, a_rows, strict=True):
            self.obj_count.update(o_row)
            self.att_count.update(a_row)
            self.pairs.update((a, o) for a in a_row for o in o_row)
        self.n_images += len(o_rows)
        return self


def build(objects: list, attributes: list, wn: WordNet, cfg, tally: Optional[Tally] = None
          ) -> tuple[Concepts, Concepts, list[list[str]], list[list[str]]]:
    """Per-image word lists -> (object vocabulary, attribute candidates, per-image object
    synsets, per-image attribute synsets); ``to_ids`` maps the latter onto a vocabulary.
    The vocabulary comes from ``tally`` (every kept image: DiHT counts over the whole dataset)
    when given, else from these rows; the labels are these rows'. ``cfg``: ``concepts``."""
    tally = tally if tally is not None else Tally(wn).add(objects, attributes)
    obj, att = tally.obj, tally.att
    obj_labels = _labels(objects, tally.canon_n, {})
    att_labels = _labels(attributes, tally.canon_a, {})
    obj.count, att.count = dict(tally.obj_count), dict(tally.att_count)
    ranked = sorted((n for n, c in obj.count.items() if c >= cfg.min_object_count),
                    key=lambda n: (-obj.count[n], n))
    obj.names = ranked[:min(cfg.max_objects or MAX_VOCAB, MAX_VOCAB)]
    lift = _lifter(set(obj.names), tally.canon_n, cfg.hypernym_backoff)
    obj_labels = [list(dict.fromkeys(m for m in map(lift, row) if m)) for row in obj_labels]
    partners: dict[str, set] = {a: set() for a in att.count}
    for a, o in tally.pairs:
        m = lift(o)
        if m:
            partners[a].add(m)
    att.sharedness = {a: len(p) for a, p in partners.items()}
    att.names = sorted((a for a, c in att.count.items() if c >= cfg.min_attribute_count
                        and att.sharedness.get(a, 0) >= cfg.min_sharedness),
                       key=lambda a: (-att.sharedness[a], -att.count[a], a))
    for c, canon in ((obj, tally.canon_n), (att, tally.canon_a)):
        c.gloss = {n: canon.synsets[n].gloss for n in c.names}
    return obj, att, obj_labels, att_labels


def to_ids(labels: list[list[str]], concepts: Concepts) -> list[list[int]]:
    ids = concepts.ids()
    return [[ids[n] for n in row if n in ids] for row in labels]


def emptiness(obj: Concepts, att: Concepts, n_images: int, cfg, step: str = "counts") -> \
        Optional[str]:
    """Why a vocabulary built from ``n_images`` kept images is empty, naming the config key to
    turn (a default that rejects everything must say so), or None. ``step``: "counts"
    after ``build``, "visualness" after the visualness filter."""
    if not n_images:
        return None                                   # nothing reached the stage: nothing to say
    if not obj.names:
        top = max(obj.count.values(), default=0)
        return (f"concepts: empty object vocabulary: no noun synset is in concepts."
                f"min_object_count={cfg.min_object_count} of the {n_images} kept images (the most "
                f"frequent is in {top}); lower concepts.min_object_count (DiHT's 250 is for "
                f"LAION scale)")
    if att.names:
        return None
    if step == "visualness":
        return (f"concepts: empty attribute vocabulary: no attribute head reaches concepts."
                f"min_visualness={cfg.min_visualness} ({len(att.sharedness)} candidates); "
                f"lower concepts.min_visualness, or set it to null")
    shared = [a for a, c in att.count.items() if att.sharedness.get(a, 0) >= cfg.min_sharedness]
    frequent = [a for a, c in att.count.items() if c >= cfg.min_attribute_count]
    return (f"concepts: empty attribute vocabulary over {n_images} kept images: "
            f"{len(frequent)} adjective synsets reach concepts.min_attribute_count="
            f"{cfg.min_attribute_count} (the most frequent is in "
            f"{max(att.count.values(), default=0)} images) and {len(shared)} reach concepts."
            f"min_sharedness={cfg.min_sharedness}, none both; lower concepts.min_attribute_count "
            f"(DiHT's 250 is for LAION scale) or concepts.min_sharedness")
