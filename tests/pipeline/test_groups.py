"""Image groups in the runner's funnel: a per-image stage computes every row of an image any of
whose rows is still kept, so each caption of that image gets the result; the rows it joins are
neither counted nor flagged by it, and an image none of whose rows is kept is not computed."""
from __future__ import annotations

import csv
from pathlib import Path

import pyarrow as pa
import pytest

from tests.pipeline.test_runner import ShortCaptionFilter, by_stage, cfg_for, quiet, table
from vlcurate.pipeline.dag import Node
from vlcurate.pipeline.demo import make_demo
from vlcurate.pipeline.runner import run
from vlcurate.schemas import F, tables
from vlcurate.stages.base import Stage
from vlcurate.stages.export import ExportStage
from vlcurate.stages.ids import IdsStage
from vlcurate.stages.ingest import IngestStage

N_BYTES = pa.field("n_image_bytes", pa.int64())
SEEN = "groupstage.seen"


class ImageBytes(Stage):
    """A per-image stage: the image's size; it flags every row it computes."""
    name = "imagebytes"
    per_image = True
    inputs = {"ingest": (F.IMAGE,)}
    output = tables.stage_table(N_BYTES)

    def __call__(self, batch: pa.Table) -> pa.Table:
        n = [len(b) for b in batch.column(F.IMAGE.name).to_pylist()]
        return pa.table({F.SAMPLE_ID.name: batch.column(F.SAMPLE_ID.name),
                         N_BYTES.name: pa.array(n, pa.int64()),
                         F.REASONS.name: pa.array([[SEEN]] * len(n), F.REASONS.type),
                         F.REASON_DETAIL.name: pa.array([None] * len(n), pa.string())})


def dag():
    return [Node(IngestStage), Node(IdsStage, after=("ingest",)),
            Node(ShortCaptionFilter, after=("ids",)), Node(ImageBytes, after=("shortcap",)),
            Node(ExportStage, after=("ingest", "ids", "shortcap", "imagebytes"))]


@pytest.fixture(scope="module")
def grouped(tmp_path_factory) -> Path:
    """Demo images, three captions each: image i % 3 == 0 has one short caption (flagged by
    shortcap), i % 3 == 1 only short ones, the others none."""
    data = make_demo(tmp_path_factory.mktemp("groups") / "data", n=12, seed=3)
    with open(data / "captions.csv", encoding="latin-1") as fh:    # the demo's odd rows too
        recs = [r for r in csv.DictReader(fh) if r["id"].startswith("demo-")
                and r["image"].endswith(".jpg") and (data / "images" / r["image"]).is_file()
                and (data / "images" / r["image"]).stat().st_size > 1000][:9]
    with open(data / "captions.csv", "w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", "image", "caption"])
        for i, r in enumerate(recs):
            caps = {0: ["tiny", "a long first caption", "a long second caption"],
                    1: ["tiny", "short one", "two"]}.get(i % 3, [f"caption {k} of this image"
                                                                   for k in range(3)])
            for k, cap in enumerate(caps):
                w.writerow([f"{r['id']}-{k}", r["image"], cap])
    return data


def test_a_per_image_stage_joins_its_result_to_every_caption_of_a_kept_image(grouped, tmp_path):
    res = by_stage(run(cfg_for(grouped, tmp_path / "run", **{"export.drop": []}), dag(),
                       executor="local", log=quiet))
    ing = table(tmp_path / "run" / "ingest" / "data").to_pylist()
    ids = table(tmp_path / "run" / "ids" / "data").to_pylist()
    short = table(tmp_path / "run" / "shortcap" / "data").to_pylist()
    out = table(tmp_path / "run" / "imagebytes" / "data").to_pylist()
    kept_groups = {i[F.IMAGE_GROUP.name] for i, s in zip(ids, short) if not s[F.REASONS.name]}
    joined = 0
    for r, i, s, o in zip(ing, ids, short, out):
        assert i[F.IMAGE_GROUP.name] == r[F.IMAGE_HASH.name]
        if i[F.IMAGE_GROUP.name] in kept_groups:
            assert o[N_BYTES.name] == len(r[F.IMAGE.name])     # every caption of a kept image
            joined += bool(s[F.REASONS.name])
        else:
            assert o[N_BYTES.name] is None                     # no row of it is kept
        assert o[F.REASONS.name] == ([] if s[F.REASONS.name] else [SEEN])
    assert joined == 3                       # the short caption of each i % 3 == 0 image
    m = res["imagebytes"].manifest
    n_kept = sum(not s[F.REASONS.name] for s in short)
    assert (m["rows_in"], m["rows_rejected"], m["rows_kept"]) == (n_kept, n_kept, 0)
