"""Golden schemas: a change to any table's columns shows up as a reviewed diff of tests/golden/.
Regenerate with UPDATE_GOLDEN=1 after an intended change."""
import os
from pathlib import Path

import pyarrow as pa
import pytest

from vlcurate.schemas import ALL_TABLES, F, SchemaError, conform, tables

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.mark.parametrize("name", sorted(ALL_TABLES))
def test_schema_matches_golden(name):
    text = str(ALL_TABLES[name]) + "\n"
    path = GOLDEN / f"{name}.schema.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"no golden file for {name}: run with UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"schema {name} changed: review and UPDATE_GOLDEN=1"


def test_every_column_name_declared_once_across_modules():
    """A column name is declared by one field object; other modules import it, never redeclare."""
    from vlcurate import schemas
    seen: dict[str, tuple[str, int]] = {}
    clashes = []
    for mod in schemas.MODULES:
        for k, v in vars(mod).items():
            if not isinstance(v, pa.Field) or k.startswith(("M_", "SH_")):
                continue
            where, ident = seen.setdefault(v.name, (f"{mod.__name__}.{k}", id(v)))
            if ident != id(v):
                clashes.append(f"{v.name!r}: {where} and {mod.__name__}.{k}")
    assert not clashes, clashes


def test_every_field_declared_once():
    names = [v.name for k, v in vars(F).items() if isinstance(v, pa.Field) and not k.startswith(("M_", "SH_"))]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_conform_orders_casts_and_fills():
    t = pa.table({"reasons": [["x"], []], "sample_id": ["a", "b"], "width": pa.array([1, 2], pa.int64())})
    out = conform(t, tables.stage_table(F.WIDTH, F.HEIGHT))
    assert out.schema == tables.stage_table(F.WIDTH, F.HEIGHT)
    assert out.column("height").null_count == 2 and out.column("width").type == pa.int32()


def test_conform_errors_name_the_column():
    with pytest.raises(SchemaError, match="sample_id"):
        conform(pa.table({"reasons": [[]]}), tables.IDS)
    with pytest.raises(SchemaError, match="bogus"):
        conform(pa.table({"sample_id": ["a"], "reasons": [[]], "bogus": [1]}), tables.IDS)
    with pytest.raises(SchemaError, match="sample_id.*nulls"):
        conform(pa.table({"sample_id": pa.array([None], pa.string()), "reasons": [[]]}), tables.IDS)
    assert conform(pa.table({"sample_id": ["a"], "reasons": [[]], "bogus": [1]}), tables.IDS,
                   extra="drop").column_names == ["sample_id", "image_group", "reasons", "reason_detail"]


def test_embedding_field_is_fixed_size_list():
    f = F.embedding("image_emb", 384)
    assert f.type == pa.list_(pa.float32(), 384)
    assert F.embedding("e", 8, float16=True).type == pa.list_(pa.float16(), 8)
