"""The WordNet 3.0 tables shipped with vlcurate answer exactly as Debian's database files do
(skipped where wordnet-base is not installed), and the default ``concepts.wordnet_dir`` falls
back to them when its folder holds no WordNet."""
from __future__ import annotations

from pathlib import Path

import pytest

from vlcurate.stages.concepts import wordnet as W

DEBIAN = Path(W.DEFAULT_DIR)


@pytest.fixture(scope="module")
def stores():
    if not (DEBIAN / "index.noun").exists():
        pytest.skip(f"Debian's wordnet-base is not installed ({DEBIAN})")
    return W.DictFiles(DEBIAN), W.Tables()


@pytest.mark.parametrize("pos", W.POS)
def test_tables_hold_every_index_exception_and_record_of_the_files(stores, pos):
    files, tables = stores
    index = files.index(pos)
    assert tables.index(pos) == index and len(index) > 20_000
    assert tables.exceptions(pos) == files.exceptions(pos)
    offsets = sorted({o for offs in index.values() for o in offs})
    assert [tables.record(pos, o) for o in offsets] == [files.record(pos, o) for o in offsets]
    for _, _, _, ptrs in (tables.record(pos, o) for o in offsets):   # closed under hypernyms
        assert all(tables.record(q, o) for _, o, q in ptrs)


def test_lookups_agree_word_by_word(stores):
    wd, wt = W.WordNet(stores[0]), W.WordNet(stores[1])
    words = [("dogs", "n"), ("puppies", "n"), ("mice", "n"), ("glasses", "n"), ("automobiles", "n"),
             ("yoghurt", "n"), ("juice", "n"), ("red", "a"), ("redder", "a"), ("big", "a"),
             ("xyzzy", "n"), ("dog", "a")]
    for w, pos in words:
        assert wt.synsets(w, pos) == wd.synsets(w, pos), w
    pup = wt.canonical("puppies", "n")
    assert pup.name == "puppy.n.01" and "dog.n.01" in [h.name for h in wt.hypernyms(pup)]
    assert wt.canonical("reddish", "a").name == "red.s.01"


def test_default_folder_without_wordnet_uses_the_shipped_tables(monkeypatch, tmp_path):
    W.open_wordnet.cache_clear()
    monkeypatch.setattr(W, "DEFAULT_DIR", str(tmp_path / "no-wordnet"))
    try:
        wn = W.open_wordnet(str(tmp_path / "no-wordnet"))
        assert isinstance(wn.store, W.Tables) and "shipped with vlcurate" in wn.label
        assert wn.canonical("cars", "n").name == "car.n.01"
        with pytest.raises(W.WordNetMissing, match="concepts.wordnet_dir"):
            W.open_wordnet(str(tmp_path / "typo"))        # a folder the user set: no fallback
    finally:
        W.open_wordnet.cache_clear()


def test_tables_ship_with_the_wordnet_license():
    assert W.TABLES.exists()
    notice = W.TABLES.with_name("LICENSE-WordNet").read_text()
    assert "WordNet 3.0 Copyright 2006 by Princeton University" in notice
