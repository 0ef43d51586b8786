"""A source in a bucket (a real S3 HTTP API, moto on loopback) reads exactly as the
same source in a local folder, in every format, hostile records included: the same rows, the
same reasons, the same image bytes; images over the limit are never fetched."""
from __future__ import annotations

import json

import pytest

from vlcurate.foundation import storage
from vlcurate.pipeline.runner import build_stage
from vlcurate.schemas import F
from vlcurate.schemas import reasons as R
from vlcurate.stages.ingest import IngestStage, census, readers, sources
from vlcurate.stages.ingest.objpath import forget_listings

from . import hostile
from .hostile import FORMATS, TARS, good

LIMIT = 20_000


def rows_of(cfg, plan_dir) -> list[tuple]:
    specs = readers.plan(cfg.source, str(plan_dir / "plan.parquet"))
    stage, out = build_stage(IngestStage, cfg), []
    for s in specs:
        out += stage(readers.read_part(cfg.source, s)).to_pylist()
    return sorted((r[F.KEY.name], tuple(r[F.REASONS.name]), r[F.IMAGE.name], r[F.CAPTION.name])
                  for r in out)


def records() -> list[dict]:
    big = dict(good("big", 1), image=b"\xff" * (LIMIT + 1), expect=[R.FILE_TOO_LARGE])
    junk = dict(good("junk", 2), image=b"not an image" * 20, expect=[R.UNDECODABLE])
    return [good("g0", 0), good("g1", 3, caption=b"a second good photo"), big, junk]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bucket_source_reads_as_the_local_one(fmt, s3, tmp_path):
    root = hostile.write(fmt, tmp_path / "src", records())
    if fmt in TARS:      # a damaged shard beside the good one
        (root / "00001.tar").write_bytes(b"SECRET" * 50)
    uri = s3.bucket() + "/data/src"
    storage.upload_dir(str(root), uri)
    forget_listings()
    over = {"source__max_image_bytes": LIMIT}
    local = rows_of(hostile.config(fmt, root, **over), tmp_path / "plan-local")
    since = len(s3.log)
    remote = rows_of(hostile.config(fmt, root, **over).replace(**{"source.path": uri}),
                     tmp_path / "plan-s3")
    assert remote == local and len(local) >= 4
    # the image over the limit is never fetched (its size came from the listing), and the
    # source is listed once, not once per file
    gets = [r for r in s3.log[since:] if r[0] == "GET"]
    assert not [r for r in gets if r[1].endswith("/big.jpg")]
    assert len(s3.lists(since)) <= 2
    reasons = {k: r for k, r, _, _ in local}
    assert reasons["big"] == (R.FILE_TOO_LARGE,) and reasons["g0"] == ()
    sig = readers.signature(hostile.config(fmt, root).replace(**{"source.path": uri}).source)
    assert isinstance(sig, str) and len(sig) == 16
    # the second count walks the bucket as it walks the folder, and both balance
    assert second_count(hostile.config(fmt, root, **over).replace(**{"source.path": uri}),
                        tmp_path / "books-s3") == \
        second_count(hostile.config(fmt, root, **over), tmp_path / "books-local")


def second_count(cfg, plan_dir) -> dict:
    """{file name: [low, high, note]} of the source's second count, once its rows balanced."""
    plan_dir.mkdir()
    specs = sources.plan(cfg.source, str(plan_dir / "_plan.parquet"))
    rows = [sources.read_part(cfg.source, s).num_rows for s in specs]
    books = census.count_all(json.loads((plan_dir / sources.CENSUS).read_text()))
    assert census.check(books, rows)["lost"] == []
    return {u.rsplit("/", 1)[-1]: c for u, c in books[0]["counts"].items()}


def test_an_image_path_outside_the_bucket_prefix_is_rejected(s3, tmp_path):
    recs = [good("g0", 0), dict(good("out", 1), image=None, name="../../elsewhere/x.jpg",
                                expect=[R.OUTSIDE_SOURCE])]
    root = hostile.write("csv", tmp_path / "src", recs)
    uri = s3.bucket() + "/data/src"
    storage.upload_dir(str(root), uri)
    cfg = hostile.config("csv", root).replace(**{"source.path": uri})
    got = {k: r for k, r, _, _ in rows_of(cfg, tmp_path)}
    assert got["g0"] == () and got["out"] == (R.OUTSIDE_SOURCE,)
