"""Per-image work once per distinct image across parts (pipeline/homes.py), through the real
runner: a shuffled source with three captions per image (as img2dataset users have it: every
image's rows in several parts) runs the full DAG; text spotting, the embeddings, the recaptioner
and the teacher: each computes each distinct image once in the run (counted where it computes and in
the summary), every row of an image carries that one result, and the outputs do not depend on
the parts, the batch size or an interrupted attempt."""
from __future__ import annotations

import csv
import random

import numpy as np
import pyarrow as pa
import pytest

from tests.pipeline.test_runner import by_stage, cfg_for, quiet
from vlcurate.foundation import storage
from vlcurate.pipeline.rundir import StageDir
from vlcurate.pipeline.runner import run
from vlcurate.pipeline.summary import format_summary, problems
from vlcurate.schemas import F
from vlcurate.schemas import embed as E
from vlcurate.stages import images

STAGES = ["ids", "textspot", "embed", "recaption", "teacher"]
COUNTED = {"textspot": "TextSpotStage", "recaption": "RecaptionStage", "teacher": "TeacherStage"}


@pytest.fixture(scope="module")
def shuffled(tmp_path_factory):
    """The demo's first 24 images (some with printed words), three captions each, shuffled."""
    from vlcurate.pipeline.demo import make_demo
    data = make_demo(tmp_path_factory.mktemp("homes") / "data", n=24, seed=5)
    with open(data / "captions.csv", newline="", encoding="latin-1") as fh:
        rows = list({r["id"]: r for r in csv.DictReader(fh) if r["id"].startswith("demo-")
                     and r["caption"].isascii() and "_small" not in r["image"]}.values())
    out = [(f"{r['id']}-{k}", r["image"], r["caption"] if k == 0 else f"{r['caption']} ({k})")
           for r in rows for k in range(3)]
    random.Random(1).shuffle(out)
    with open(data / "captions.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["id", "image", "caption"])
        w.writerows(out)
    return data, len({r["image"] for r in rows})


def _cfg(data, run_dir, **over):
    return cfg_for(data, run_dir, **{"run.stages": STAGES, "source.rows_per_part": 7, **over})


def _full_dag(data, run_dir):
    """Every stage of the default DAG (cat before text spotting, dedup, concepts, export)."""
    return cfg_for(data, run_dir, **{"source.rows_per_part": 7, "hpm.k": 1})


def _table(run_dir, stage) -> pa.Table:
    sd = StageDir(str(run_dir), stage)
    return pa.concat_tables([sd.read(p) for p in range(sd.manifest()["parts"])]) \
        .sort_by(F.SAMPLE_ID.name)


def _groups(run_dir) -> dict[str, str]:
    t = _table(run_dir, "ids")
    return dict(zip(t.column(F.SAMPLE_ID.name).to_pylist(),
                    t.column(F.IMAGE_GROUP.name).to_pylist()))


def test_each_image_is_computed_once_in_the_run_whatever_its_parts(shuffled, tmp_path):
    data, n_images = shuffled
    before = dict(images.COMPUTED)
    results = by_stage(run(_full_dag(data, tmp_path / "run"), executor="local", log=quiet))
    assert not problems(list(results.values()))
    groups = _groups(tmp_path / "run")
    parts_of: dict[str, set] = {}
    ids = StageDir(str(tmp_path / "run"), "ids")
    for p in range(ids.manifest()["parts"]):
        for g in ids.read(p, columns=[F.IMAGE_GROUP.name]).column(0).to_pylist():
            parts_of.setdefault(g, set()).add(p)
    assert sum(len(v) > 1 for v in parts_of.values()) >= n_images - 2   # the source is shuffled
    said = {stage: results[stage].info["images"] for stage in STAGES[1:]}
    # the images with a caption still kept before each stage (cat drops most demo captions)
    assert all(5 <= n["distinct"] <= said["textspot"]["distinct"] for n in said.values()), said
    for stage, n in said.items():                  # what the run says
        assert n["computed"] == n["distinct"], (stage, n)
    for stage, counter in COUNTED.items():         # where each stage computes
        assert images.COMPUTED[counter] - before.get(counter, 0) == said[stage]["distinct"], stage
    n = said["textspot"]["distinct"]
    assert f"textspot {n} of {n}" in format_summary(list(results.values()))
    # every row of an image carries the one result: the same bytes in every part
    emb = _table(tmp_path / "run", "embed")
    by_group: dict[str, set] = {}
    for sid, v, c in zip(emb.column(F.SAMPLE_ID.name).to_pylist(),
                         emb.column(E.IMAGE_EMB_NAME).to_pylist(),
                         emb.column(E.CROSS_IMAGE_EMB_NAME).to_pylist()):
        if v is not None:
            by_group.setdefault(groups[sid], set()).add((np.float32(v).tobytes(),
                                                         np.float32(c).tobytes()))
    assert len(by_group) == said["embed"]["distinct"]
    assert all(len(v) == 1 for v in by_group.values())


def test_the_image_pass_changes_no_byte_with_batch_size_or_a_resume(shuffled, tmp_path):
    """The same tables with another batch size and after an interrupted attempt; text
    spotting's rows (their image and caption only: textspot.seen_by) as with every caption in
    one part, the home pass reading whole images."""
    data, _ = shuffled
    run(_cfg(data, tmp_path / "a"), executor="local", log=quiet)
    small = {f"{s}.resources": {"batch_size": 3} for s in ("textspot", "embed", "teacher")}
    run(_cfg(data, tmp_path / "b", **small), executor="local", log=quiet)
    for stage in STAGES[1:]:
        assert _table(tmp_path / "a", stage).equals(_table(tmp_path / "b", stage)), stage
    run(_cfg(data, tmp_path / "one", **{"source.rows_per_part": 1000}), executor="local",
        log=quiet)
    cols = [F.SAMPLE_ID.name, "ocr_match", "ocr_match_chars", F.REASONS.name]
    spotted = _table(tmp_path / "a", "textspot").select(cols)
    assert spotted.equals(_table(tmp_path / "one", "textspot").select(cols))
    assert any(spotted.column(F.REASONS.name).to_pylist()), "no row text-spotted: shows nothing"
    # an interrupted attempt: embed's committed parts and its home pass kept, the rest redone
    sd = StageDir(str(tmp_path / "b"), "embed")
    m = sd.manifest()
    sd.uncommit([1, 3])
    sd.write_json("_attempt.json", {F.MK.FINGERPRINT: m[F.MK.FINGERPRINT], "parts": m["parts"],
                                    F.MK.STARTED: m[F.MK.STARTED]})
    storage.delete(sd.manifest_path)
    res = by_stage(run(_cfg(data, tmp_path / "b", **small), executor="local", log=quiet))
    assert res["embed"].status == "resumed"
    assert _table(tmp_path / "a", "embed").equals(_table(tmp_path / "b", "embed"))
