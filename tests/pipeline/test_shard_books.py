"""The books of the shards, in every layout (``foundation/layout.LAYOUTS``), through ``vlcurate
run`` and ``vlcurate export``: the shards hold every kept row once (pair: a sample a row; image:
a sample an image, a caption a row), the manifest counts rows and samples, and the summary's "no
row lost" is true; a shard that loses a caption fails the run."""
from __future__ import annotations

import json
import tarfile
from collections import Counter

import pyarrow.dataset as ds
import pytest

from tests.pipeline.conftest import Export, _cli
from vlcurate.foundation.layout import LAYOUTS
from vlcurate.schemas import F
from vlcurate.stages import export as EX

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(params=["demo_export", "coco_export"])
def exported(request) -> Export:
    return request.getfixturevalue(request.param)


def kept_rows(e: Export) -> list[dict]:
    t = ds.dataset(e.run_dir / "export" / "data", format="parquet").to_table(
        columns=[F.SAMPLE_ID.name, F.IMAGE_GROUP.name, F.CAPTION.name, F.KEEP.name])
    return [r for r in t.to_pylist() if r[F.KEEP.name]]


def shard_rows(e: Export, layout: str) -> tuple[int, list[tuple[str, str]]]:
    """(samples, [(sample_id, caption)] of every row the tars' json holds), read from the tars."""
    samples, rows = 0, []
    for tar in e.tars(layout):
        with tarfile.open(tar) as tf:
            for m in tf:
                if not m.name.endswith(".json"):
                    continue
                samples += 1
                doc = json.loads(tf.extractfile(m).read())
                own = doc["captions"] if layout == "image" else [doc]
                rows += [(c[F.SAMPLE_ID.name], c[F.CAPTION.name]) for c in own]
    return samples, rows


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_holds_every_kept_row_once_and_the_books_say_so(exported, layout):
    assert exported.codes[layout] == 0, exported.out[layout]
    assert "no row lost: yes" in exported.out[layout], exported.out[layout]
    kept = kept_rows(exported)
    samples, rows = shard_rows(exported, layout)
    assert Counter(rows) == Counter((r[F.SAMPLE_ID.name], r[F.CAPTION.name]) for r in kept)
    man = exported.manifest(layout)
    assert (man["samples"], man["rows"], man["layout"]) == (samples, len(kept), layout)
    assert sum(f["rows"] for f in man["files"]) == len(kept)
    index = ds.dataset(exported.shards(layout) / "index", format="parquet").to_table()
    assert index.num_rows == len(kept)
    if layout == "pair":
        assert samples == len(kept)
    else:   # an image's captions in one shard are one sample: fewer samples than rows
        groups = {(r[F.SH_NAME.name], r[F.IMAGE_GROUP.name]) for r in index.to_pylist()}
        assert samples == len(groups) < len(kept)
        assert len({r[F.IMAGE_GROUP.name] for r in kept}) <= samples


def test_a_shard_that_loses_a_caption_fails_the_run(demo_export, monkeypatch, tmp_path):
    """The check the summary makes: an image sample that drops its last caption is a lost row."""
    write = EX.samples

    def drops_a_caption(layout, rows, images, metas):          # the bug the books catch
        for key, members, entries in write(layout, rows, images, metas):
            yield key, members, entries[:-1] if len(entries) > 1 else entries
    monkeypatch.setattr(EX, "samples", drops_a_caption)
    code, out = _cli(["export", str(demo_export.run_dir), "--executor", "local", "--out",
                      str(tmp_path / "lossy"), "--set", "export.layout=image"])
    kept = len(kept_rows(demo_export))
    lost = json.loads((tmp_path / "lossy" / "shards" / "manifest.json").read_text())["rows"]
    assert code == 1 and lost < kept
    assert "no row lost: NO" in out and f"export: {lost} rows in shards" in out \
        and f"but {kept} kept" in out, out
