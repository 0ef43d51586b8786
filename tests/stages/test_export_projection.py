"""Export projects only the columns it writes: embeddings are not read back, and the
shards and every annotation are what the unprojected export wrote."""
from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import Node, default_dag, select
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.runner import run
from vlcurate.schemas import F
from vlcurate.schemas import embed as E
from vlcurate.stages.export import _NEVER_ANNOTATED, ExportStage


class UnprojectedExport(ExportStage):
    """Export unprojected (the reference): reads every upstream column except the never-annotated
    ones, embeddings included (``annotation`` then left them out of the shard json)."""
    version = "1"

    @classmethod
    def input_columns(cls, upstream, schema, config):
        skip = _NEVER_ANNOTATED | set(config.export.exclude_columns)
        return [f.name for f in (schema or []) if f.name not in skip]


def table(path: Path) -> pa.Table:
    return ds.dataset(path, format="parquet").to_table()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The demo (ingest, ids, lang, embed: the stages export joins with embeddings), locally."""
    root = tmp_path_factory.mktemp("export")
    data = make_demo(root / "data", n=40, seed=3)
    over = {**demo_overrides(data, root / "run"), "source.rows_per_part": 16,
            "run.progress": False, "export.samples_per_shard": 20,
            "run.stages": ["ids", "lang", "embed"]}
    cfg = C.load(None, over)
    run(cfg, executor="local", log=lambda _: None)
    return root, cfg


def test_export_input_columns_exclude_embeddings(demo_run):
    root, cfg = demo_run
    schema = ds.dataset(root / "run" / "embed" / "data", format="parquet").schema
    assert {E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME} <= set(schema.names)
    cols = ExportStage.input_columns("embed", schema, cfg)
    assert E.IMAGE_EMB_NAME not in cols and E.TEXT_EMB_NAME not in cols
    assert E.IMAGE_MODEL.name in cols and E.RANDOM_WEIGHTS.name in cols
    ingest = ds.dataset(root / "run" / "ingest" / "data", format="parquet").schema
    assert F.IMAGE.name not in ExportStage.input_columns("ingest", ingest, cfg)
    annotated = table(root / "run" / "export" / "data")
    assert not {E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME, F.IMAGE.name} & set(annotated.column_names)


def test_projected_export_writes_the_same_shards_and_annotations(demo_run):
    root, cfg = demo_run
    old_dir = root / "run_unprojected"
    shutil.copytree(root / "run", old_dir)
    dag = [Node(UnprojectedExport, n.after) if n.stage is ExportStage else n
           for n in select(default_dag(), cfg.run.stages)]
    old_cfg = cfg.replace(**{"run.run_dir": str(old_dir)})
    out = run(old_cfg, dag=dag, executor="local", log=lambda _: None)
    res = {r.manifest["stage"]: r for r in out}
    assert res["export"].status == "ran"   # the upstream stages were reused, export rewritten
    new, old = root / "run" / "export", old_dir / "export"
    tars = sorted(p.name for p in (new / "shards").glob("*.tar"))
    assert len(tars) >= 2 and tars == sorted(p.name for p in (old / "shards").glob("*.tar"))
    for name in [*tars, "sizes.json", "manifest.json"]:
        assert (new / "shards" / name).read_bytes() == (old / "shards" / name).read_bytes(), name
    assert table(new / "shards" / "index").equals(table(old / "shards" / "index"))
    # the annotated table: every column the unprojected export wrote, less the embeddings
    a, b = table(new / "data"), table(old / "data")
    assert {E.IMAGE_EMB_NAME, E.TEXT_EMB_NAME} <= set(b.column_names)
    vectors = {f.name for f in b.schema if pa.types.is_fixed_size_list(f.type)}   # cross_* too
    assert a.column_names == [c for c in b.column_names if c not in vectors]
    for c in a.column_names:
        assert a.column(c).equals(b.column(c)), c
