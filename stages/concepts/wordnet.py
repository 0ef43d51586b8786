"""A small offline reader of Princeton WordNet 3.0: the database files (Debian: ``apt-get install
wordnet-base`` puts them in ``/usr/share/wordnet``), or the compact tables built from them that
ship with vlcurate (``wordnet30.txt.xz``, WordNet's license in ``LICENSE-WordNet``), used when the
default folder holds no WordNet, so that a fresh machine needs no system package.

Why our own reader and not nltk: nltk's reader needs its own data layout (``lexnames`` and the
rest under ``corpora/wordnet``) and a new dependency; the four things DiHT's vocabulary needs are
short to read straight from the database files: the index (lemma -> synsets, most frequent sense
first), the exception lists (irregular plurals: mice -> mouse), nltk's morphy detachment rules
(puppies -> puppy), and a synset's lemmas, gloss and hypernym pointers. Only nouns and adjectives
are read (the vocabulary's two kinds), and of the pointers only hypernyms: the tables hold exactly
that (``tests/stages/concepts/test_wordnet_tables.py`` checks them equal to the files).

Synset names follow nltk's convention, ``<first lemma>.<pos>.<sense number of that lemma>``
(``dog.n.01``, ``red.s.01`` for an adjective satellite), so they can be checked against nltk.
The data files are read lazily: a synset offset is its byte offset in ``data.<pos>``.
"""
from __future__ import annotations

import functools
import lzma
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

DEFAULT_DIR = "/usr/share/wordnet"
TABLES = Path(__file__).with_name("wordnet30.txt.xz")
FILES = {"n": "noun", "a": "adj", "s": "adj", "v": "verb", "r": "adv"}
HYPERNYM = ("@", "@i")
POS = ("n", "a")                    # what the vocabulary reads, and what the tables hold
# nltk's morphy detachment rules (WordNet's morph.c)
SUFFIXES = {
    "n": [("s", ""), ("ses", "s"), ("ves", "f"), ("xes", "x"), ("zes", "z"), ("ches", "ch"),
          ("shes", "sh"), ("men", "man"), ("ies", "y")],
    "a": [("er", ""), ("est", ""), ("er", "e"), ("est", "e")],
}
# a synset's record: (ss_type, lemmas, gloss, hypernym pointers (symbol, offset, pos))
Record = tuple[str, tuple[str, ...], str, tuple[tuple[str, int, str], ...]]


class WordNetMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class Synset:
    name: str                      # dog.n.01
    offset: int
    pos: str                       # n, a, s (adjective satellite)
    lemmas: tuple[str, ...]
    gloss: str
    pointers: tuple[tuple[str, int, str], ...]   # hypernyms: (symbol, offset, pos)


class DictFiles:
    """WordNet 3.0's database files in a folder, read lazily."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        missing = [f for f in ("index.noun", "data.noun", "index.adj", "data.adj")
                   if not (self.root / f).exists()]
        if missing:
            raise WordNetMissing(
                f"WordNet database not found in {self.root} (missing {', '.join(missing)}): "
                "set `concepts.wordnet_dir` to a folder holding WordNet 3.0's dict files (Debian: "
                f"`apt-get install wordnet-base`), or leave it at {DEFAULT_DIR} to use the "
                "tables shipped with vlcurate")
        self._data: dict[str, bytes] = {}
        self.label = str(self.root)

    def index(self, pos: str) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        with open(self.root / f"index.{FILES[pos]}", encoding="utf-8") as fh:
            for line in fh:
                if not line.startswith(" "):
                    f = line.split()
                    out[f[0]] = [int(o) for o in f[len(f) - int(f[2]):]]
        return out

    def exceptions(self, pos: str) -> dict[str, list[str]]:
        path = self.root / f"{FILES[pos]}.exc"
        lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        return {f[0]: f[1:] for f in map(str.split, lines) if len(f) > 1}

    def record(self, pos: str, offset: int) -> Record:
        key = FILES[pos]
        if key not in self._data:
            self._data[key] = (self.root / f"data.{key}").read_bytes()
        data = self._data[key]
        head, _, gloss = data[offset:data.index(b"\n", offset)].decode("utf-8").partition(" | ")
        f = head.split()
        n = int(f[3], 16)
        lemmas = tuple(f[4 + 2 * i].split("(")[0] for i in range(n))   # drop "(a)"/"(p)" markers
        i = 4 + 2 * n
        ptrs = tuple((f[i + 1 + 4 * k], int(f[i + 2 + 4 * k]), f[i + 3 + 4 * k])
                     for k in range(int(f[i])))
        return f[2], lemmas, gloss.strip(), tuple(p for p in ptrs if p[0] in HYPERNYM)


class Tables:
    """The compact tables shipped with vlcurate, built from WordNet 3.0 by :func:`write_tables`:
    one xz-compressed text file of sections ``#index <pos>``, ``#exc <pos>`` and ``#data <pos>``
    (``offset ss_type lemmas gloss pointers``, tab-separated), read whole on first use."""

    def __init__(self, path: str | os.PathLike = TABLES) -> None:
        if not Path(path).exists():
            raise WordNetMissing(f"WordNet tables not found at {path}: reinstall vlcurate")
        self.path, self.label = Path(path), f"WordNet 3.0 tables shipped with vlcurate ({path})"
        self._sections: Optional[dict[str, list[str]]] = None

    def _section(self, name: str) -> list[str]:
        if self._sections is None:
            self._sections, cur = {}, None
            with lzma.open(self.path, "rt", encoding="utf-8") as fh:
                for line in fh.read().split("\n"):
                    if not line:
                        continue
                    if line.startswith("#"):
                        cur = self._sections.setdefault(line[1:], [])
                    else:
                        cur.append(line)
        return self._sections.get(name, [])

    def index(self, pos: str) -> dict[str, list[int]]:
        lines = self._section(f"index {pos}")
        return {f[0]: [int(o) for o in f[1:]] for f in map(str.split, lines)}

    def exceptions(self, pos: str) -> dict[str, list[str]]:
        return {f[0]: f[1:] for f in map(str.split, self._section(f"exc {pos}"))}

    @functools.cached_property
    def _records(self) -> dict[tuple[str, int], Record]:
        out = {}
        for pos in POS:
            for line in self._section(f"data {pos}"):
                off, ss_type, lemmas, gloss, ptrs = line.split("\t")
                p = tuple((s, int(o), q) for s, o, q in (x.split(",") for x in ptrs.split()))
                out[pos, int(off)] = (ss_type, tuple(lemmas.split()), gloss, p)
        return out

    def record(self, pos: str, offset: int) -> Record:
        return self._records[pos, offset]


def _table_lines(files: DictFiles) -> Iterator[str]:
    for pos in POS:
        index = files.index(pos)
        yield f"#index {pos}"
        yield from (" ".join([lemma, *map(str, offs)]) for lemma, offs in index.items())
        yield f"#exc {pos}"
        yield from (" ".join([w, *bases]) for w, bases in files.exceptions(pos).items())
        yield f"#data {pos}"
        for off in sorted({o for offs in index.values() for o in offs}):
            ss_type, lemmas, gloss, ptrs = files.record(pos, off)
            yield "\t".join([str(off), ss_type, " ".join(lemmas), gloss,
                             " ".join(f"{s},{o},{q}" for s, o, q in ptrs)])


def write_tables(root: str | os.PathLike, out: str | os.PathLike = TABLES) -> Path:
    """Build the shipped tables from WordNet 3.0's dict files in ``root``:
    ``python -c 'from vlcurate.stages.concepts.wordnet import write_tables;
    write_tables("/usr/share/wordnet", "stages/concepts/wordnet30.txt.xz")'``."""
    text = "\n".join(_table_lines(DictFiles(root))) + "\n"
    with lzma.open(out, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as fh:
        fh.write(text)
    return Path(out)


class WordNet:
    """Lookups over a store: :class:`DictFiles` (a folder) or :class:`Tables` (shipped)."""

    def __init__(self, root: "str | os.PathLike | DictFiles | Tables" = DEFAULT_DIR) -> None:
        self.store = root if isinstance(root, (DictFiles, Tables)) else DictFiles(root)
        self.label = self.store.label
        self._index: dict[str, dict[str, list[int]]] = {}
        self._exc: dict[str, dict[str, list[str]]] = {}
        self._synsets: dict[tuple[str, int], Synset] = {}

    def index(self, pos: str) -> dict[str, list[int]]:
        """lemma -> synset offsets, most frequent sense first."""
        pos = "a" if pos == "s" else pos
        if pos not in self._index:
            self._index[pos] = self.store.index(pos)
        return self._index[pos]

    def exceptions(self, pos: str) -> dict[str, list[str]]:
        if pos not in self._exc:
            self._exc[pos] = self.store.exceptions(pos)
        return self._exc[pos]

    # --- lookups --------------------------------------------------------------------------------
    def synset_at(self, pos: str, offset: int) -> Synset:
        if (pos, offset) not in self._synsets:
            self._synsets[pos, offset] = self._read_synset(pos, offset)
        return self._synsets[pos, offset]

    def _read_synset(self, pos: str, offset: int) -> Synset:
        ss_type, lemmas, gloss, ptrs = self.store.record("a" if pos == "s" else pos, offset)
        first = lemmas[0].lower()
        sense = self.index(ss_type).get(first, [offset])
        num = sense.index(offset) + 1 if offset in sense else 1
        return Synset(f"{first}.{ss_type}.{num:02d}", offset, ss_type, lemmas, gloss, ptrs)

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
                ss = self.synset_at(pos, off)
                if ss not in out:
                    out.append(ss)
        return out

    def canonical(self, word: str, pos: str) -> Optional[Synset]:
        """The word's most frequent sense (WordNet's first synset), or None."""
        found = self.synsets(word, pos)
        return found[0] if found else None

    def hypernyms(self, ss: Synset) -> list[Synset]:
        return [self.synset_at(p, o) for sym, o, p in ss.pointers if sym in HYPERNYM]


@functools.lru_cache(maxsize=4)
def open_wordnet(root: str) -> WordNet:
    """WordNet from the folder ``root``; the default folder (``concepts.wordnet_dir``'s default)
    without WordNet in it means the tables shipped with vlcurate."""
    try:
        return WordNet(root)
    except WordNetMissing:
        if os.path.normpath(root) != DEFAULT_DIR:
            raise
        return WordNet(Tables())
