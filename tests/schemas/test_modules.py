"""Schema modules, tables and reason codes are collected from the package, not listed by hand."""
import textwrap

import pytest

from vlcurate import schemas
from vlcurate.schemas import reasons as R
from vlcurate.schemas.modules import found, merged, reason_codes


def _package(root, name, modules):
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    for mod, text in modules.items():
        (root / name / f"{mod}.py").write_text(textwrap.dedent(text))
    return name


def test_a_new_schema_module_is_collected_with_its_tables_and_reasons(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = _package(tmp_path, "plugschemas", {
        "wordcount": """
            import pyarrow as pa
            N_WORDS = pa.field("n_words", pa.int32())
            ALL = {"wordcount": pa.schema([N_WORDS])}
            REASON_CODES = {"TOO_SHORT": "wordcount.too_short"}
        """,
        "_private": "ALL = {'hidden': None}\n",
        "nothing": "X = 1\n"})
    mods = found(pkg)
    assert [m.__name__ for m in mods] == ["plugschemas.nothing", "plugschemas.wordcount"]
    assert merged(mods, "ALL")["wordcount"].names == ["n_words"]
    assert reason_codes(mods, R.INGEST) == {"TOO_SHORT": "wordcount.too_short"}


def test_a_reason_code_declared_twice_or_malformed_is_refused(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = _package(tmp_path, "twice", {"a": "REASON_CODES = {'X': 'a.x'}\n",
                                       "b": "REASON_CODES = {'Y': 'a.x'}\n",
                                       "c": "REASON_CODES = {'X': 'c.y'}\n"})
    a, b, c = found(pkg)
    with pytest.raises(ValueError, match=r"reason code 'a.x' \(Y\) is declared twice"):
        reason_codes([a, b])
    with pytest.raises(ValueError, match=r"REASON_CODES\['X'\] is declared by twice.a and twice.c"):
        reason_codes([a, c])
    with pytest.raises(ValueError, match="is declared twice"):
        reason_codes([a], taken=["a.x"])       # clashes with a spine (ingest) code
    bad = _package(tmp_path, "bad", {"m": "REASON_CODES = {'Z': 'nodot'}\n"})
    with pytest.raises(ValueError, match="a code is '<stage>.<reason>'"):
        reason_codes(found(bad))


def test_every_reason_keeps_its_name_and_code():
    """The collected codes are the ones stages, tables and old runs carry."""
    assert {k: getattr(R, k) for k in ("HPM_NOISE", "CAT_LOW_COMPLEXITY", "CAT_NO_ACTION",
                                        "CAT_TEXT_SPOTTED", "DEDUP_NEAR", "LANG_OTHER")} == {
        "HPM_NOISE": "hpm.noise_pair", "CAT_LOW_COMPLEXITY": "cat.low_complexity",
        "CAT_NO_ACTION": "cat.no_action", "CAT_TEXT_SPOTTED": "cat.text_spotted",
        "DEDUP_NEAR": "dedup.near_duplicate", "LANG_OTHER": "lang.other"}
    assert R.MISSING_FILE == "ingest.missing_file" and len(R.INGEST) == 19


def test_the_package_collects_every_module_and_table():
    names = {m.__name__.rsplit(".", 1)[1] for m in schemas.MODULES}
    assert names >= {"cat", "concepts", "embed", "fields", "lang", "mining", "recaption", "tables"}
    assert {"lang", "hard_pairs", "cat", "recaption", "concept_vocab", "samples"} <= \
        set(schemas.ALL_TABLES)
    assert schemas.cat.CAT is schemas.ALL_TABLES["cat"]
