"""A small offline reader of the Princeton WordNet 3.0 database files (Debian: ``apt-get install
wordnet-base`` puts them in ``/usr/share/wordnet``).

Why our own reader and not nltk: nltk's reader needs its own data layout (``lexnames`` and the
rest under ``corpora/wordnet``) and a new dependency; the four things DiHT's vocabulary needs are
short to read straight from the database files: the index (lemma -> synsets, most frequent sense
first), the exception lists (irregular plurals: mice -> mouse), nltk's morphy detachment rules
(puppies -> puppy), and a synset's lemmas, gloss and pointers (hypernyms; "similar to").

Synset names follow nltk's convention, ``<first lemma>.<pos>.<sense number of that lemma>``
(``dog.n.01``, ``red.s.01`` for an adjective satellite), so they can be checked against nltk.
The data files are read lazily: a synset offset is its byte offset in ``data.<pos>``.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

FILES = {"n": "noun", "a": "adj", "s": "adj", "v": "verb", "r": "adv"}
# nltk's morphy detachment rules (WordNet's morph.c)
SUFFIXES = {
    "n": [("s", ""), ("ses", "s"), ("ves", "f"), ("xes", "x"), ("zes", "z"), ("ches", "ch"),
          ("shes", "sh"), ("men", "man"), ("ies", "y")],
    "a": [("er", ""), ("est", ""), ("er", "e"), ("est", "e")],
}


class WordNetMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class Synset:
    name: str                      # dog.n.01
    offset: int
    pos: str                       # n, a, s (adjective satellite)
    lemmas: tuple[str, ...]
    gloss: str
    pointers: tuple[tuple[str, int, str], ...]   # (symbol, offset, pos)


class WordNet:
    def __init__(self, root: str | os.PathLike = "/usr/share/wordnet") -> None:
        self.root = Path(root)
        missing = [f for f in ("index.noun", "data.noun", "index.adj", "data.adj")
                   if not (self.root / f).exists()]
        if missing:
            raise WordNetMissing(
                f"WordNet database not found in {self.root} (missing {', '.join(missing)}): "
                "install Debian's wordnet-base (`apt-get install wordnet-base`) or set "
                "`concepts.wordnet_dir` to a folder holding WordNet 3.0's dict files")
        self._index: dict[str, dict[str, list[int]]] = {}
        self._exc: dict[str, dict[str, list[str]]] = {}
        self._data: dict[str, bytes] = {}
        self._synsets: dict[tuple[str, int], Synset] = {}

    # --- files ----------------------------------------------------------------------------------
    def index(self, pos: str) -> dict[str, list[int]]:
        """lemma -> synset offsets, most frequent sense first."""
        pos = "a" if pos == "s" else pos
        if pos not in self._index:
            out: dict[str, list[int]] = {}
            with open(self.root / f"index.{FILES[pos]}", encoding="utf-8") as fh:
                for line in fh:
                    if line.startswith(" "):
                        continue
                    f = line.split()
                    n = int(f[2])
                    out[f[0]] = [int(o) for o in f[len(f) - n:]]
            self._index[pos] = out
        return self._index[pos]

    def exceptions(self, pos: str) -> dict[str, list[str]]:
        if pos not in self._exc:
            path = self.root / f"{FILES[pos]}.exc"
            out: dict[str, list[str]] = {}
            if path.exists():
                for line in path.read_text(encoding="utf-8").splitlines():
                    f = line.split()
                    if len(f) > 1:
                        out[f[0]] = f[1:]
            self._exc[pos] = out
        return self._exc[pos]

    def _line(self, pos: str, offset: int) -> str:
        key = FILES[pos]
        if key not in self._data:
            self._data[key] = (self.root / f"data.{key}").read_bytes()
        data = self._data[key]
        return data[offset:data.index(b"\n", offset)].decode("utf-8")

    # --- lookups --------------------------------------------------------------------------------
    def synset_at(self, pos: str, offset: int) -> Synset:
        if (pos, offset) not in self._synsets:
            self._synsets[pos, offset] = self._read_synset(pos, offset)
        return self._synsets[pos, offset]

    def _read_synset(self, pos: str, offset: int) -> Synset:
        head, _, gloss = self._line(pos, offset).partition(" | ")
        f = head.split()
        ss_type, n = f[2], int(f[3], 16)
        lemmas = tuple(f[4 + 2 * i].split("(")[0] for i in range(n))   # drop "(a)"/"(p)" markers
        i = 4 + 2 * n
        ptrs = tuple((f[i + 1 + 4 * k], int(f[i + 2 + 4 * k]), f[i + 3 + 4 * k])
                     for k in range(int(f[i])))
        first = lemmas[0].lower()
        sense = self.index(ss_type).get(first, [offset])
        num = sense.index(offset) + 1 if offset in sense else 1
        return Synset(f"{first}.{ss_type}.{num:02d}", offset, ss_type, lemmas, gloss.strip(), ptrs)

    def morphy(self, word: str, pos: str) -> list[str]:
        """Base forms of ``word`` that WordNet has as ``pos`` (nltk's morphy), in order."""
        index = self.index(pos)
        form = word.strip().lower().replace(" ", "_")
        exc = self.exceptions(pos)
        if form in exc:
            cands = [form] + exc[form]
        else:
            cands = [form] + [form[:-len(old)] + new for old, new in SUFFIXES.get(pos, [])
                              if form.endswith(old)]
        return [c for c in dict.fromkeys(cands) if c in index]

    def synsets(self, word: str, pos: str) -> list[Synset]:
        out: list[Synset] = []
        for form in self.morphy(word, pos):
            for off in self.index(pos)[form]:
                ss = self.synset_at(pos if pos != "a" else self._adj_type(off), off)
                if ss not in out:
                    out.append(ss)
        return out

    def _adj_type(self, offset: int) -> str:
        return self._line("a", offset).split(maxsplit=3)[2]

    def canonical(self, word: str, pos: str) -> Optional[Synset]:
        """The word's most frequent sense (WordNet's first synset), or None."""
        found = self.synsets(word, pos)
        return found[0] if found else None

    def hypernyms(self, ss: Synset) -> list[Synset]:
        return [self.synset_at(p, o) for sym, o, p in ss.pointers if sym in ("@", "@i")]


@functools.lru_cache(maxsize=4)
def open_wordnet(root: str) -> WordNet:
    return WordNet(root)
