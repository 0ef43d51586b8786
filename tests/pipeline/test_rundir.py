"""The commit protocol of pipeline/rundir.py on a local folder, on a real S3 HTTP endpoint
(moto on loopback) and on an fsspec filesystem (``memory://``): attempt-unique files, commit records written last, stale attempts ignored and
swept, idempotent re-commits, damage found from the records, and no LIST per part per read."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vlcurate.foundation import storage
from vlcurate.pipeline.rundir import StageDir, fragment_name, without_attempt
from vlcurate.schemas import F, tables


@pytest.fixture(params=["local", "s3", "fsspec"])
def run_dir(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    if request.param == "fsspec":      # a filesystem pyarrow does not open: fsspec's in memory
        return f"memory://{tmp_path.name}/runs/a"
    return request.getfixturevalue("s3").bucket() + "/runs/a"


def rows(lo: int, hi: int) -> pa.Table:
    return pa.table({F.SAMPLE_ID.name: [f"s{i:03d}" for i in range(lo, hi)],
                     "x": pa.array(range(lo, hi), pa.int64())})


def rejects(ids: list[int]) -> pa.Table:
    return pa.Table.from_pylist([{F.SAMPLE_ID.name: f"s{i:03d}", F.REASONS.name: ["t.bad"],
                                  F.REASON_DETAIL.name: None, F.STAGE.name: "st"} for i in ids],
                                schema=tables.REJECTS)


def counts(n: int, rejected: int = 0) -> dict:
    return {"rows": n, "rows_in": n, "rows_kept": n - rejected, "rows_rejected": rejected,
            "reason_counts": {"t.bad": rejected} if rejected else {}}


def names(sd: StageDir, kind: str, part: int) -> list[str]:
    return sorted(i.base_name for i in storage.list_files(sd.part_uri(kind, part)))


def committed_part(sd: StageDir, part: int, n: int = 10, cut: int = 4) -> None:
    """Part ``part`` of n rows written as two fragments (the second with a reject), committed."""
    sd.write_fragment(part, 0, cut, rows(0, cut), None)
    sd.write_fragment(part, cut, n, rows(cut, n), rejects([n - 1]))
    sd.commit(part, counts(n, 1))


def test_fragments_are_invisible_until_the_record_then_merged_into_one_file(run_dir):
    sd = StageDir(run_dir, "st")
    sd.begin({"fingerprint": "f", "parts": 2})
    att = sd.attempt()["attempt"]
    sd.write_fragment(0, 0, 4, rows(0, 4), None)
    sd.write_fragment(0, 4, 10, rows(4, 10), rejects([9]))
    assert names(sd, "data", 0) == [fragment_name(0, 4, att), fragment_name(4, 10, att)]
    assert sd.committed() == [] and sd.damaged(1) == [0]
    with pytest.raises(FileNotFoundError):
        sd.read(0)
    sd.commit(0, counts(10, 1))
    assert sd.committed() == [0] and sd.damaged(1) == []
    assert names(sd, "data", 0) == [fragment_name(0, 10, att)]       # fragments deleted
    assert names(sd, "rejects", 0) == [fragment_name(0, 10, att)]
    assert sd.read(0).equals(rows(0, 10))
    assert sd.read(0, [F.SAMPLE_ID.name]).column_names == [F.SAMPLE_ID.name]
    assert sd.read(0, kind="rejects").column(F.SAMPLE_ID.name).to_pylist() == ["s009"]
    rec = sd.part_counts(0)
    assert rec["rows"] == 10 and rec["rows_rejected"] == 1
    assert rec["files"]["data"] == {fragment_name(0, 10, att): storage.size(
        sd.part_uri("data", 0, fragment_name(0, 10, att)))}
    # the same rows in one fragment: the same committed bytes, whatever the batching
    sd.write_fragment(1, 0, 10, rows(0, 10), rejects([9]))
    sd.commit(1, counts(10, 1))
    one = storage.read_bytes(sd.part_uri("data", 1, fragment_name(0, 10, att)))
    assert one == storage.read_bytes(sd.part_uri("data", 0, fragment_name(0, 10, att)))
    assert sd.schema() == pq.read_schema(pa.BufferReader(one))
    sd.finish(manifest("st", 2))
    assert sd.attempt() is None and sd.manifest()["parts"] == 2
    assert sd.read_all().num_rows == 20 and sd.read_all(kind="rejects").num_rows == 2


def manifest(stage: str, parts: int) -> dict:
    return {"stage": stage, "status": "complete", "fingerprint": "f", "upstream": {},
            "config": "{}", "parts": parts, "parts_reused": 0, "rows": 10 * parts,
            "rows_in": 10 * parts, "rows_kept": 9 * parts, "rows_rejected": parts,
            "reason_counts": {"t.bad": parts}, "wall_s": 0.1, "started_at": "t0",
            "finished_at": "t1", "versions": {}}


def test_a_recommit_is_idempotent(run_dir):
    sd = StageDir(run_dir, "st")
    sd.begin({"fingerprint": "f"})
    committed_part(sd, 0)
    rec, files = sd.record(0), names(sd, "data", 0)
    data = storage.read_bytes(sd.part_uri("data", 0, files[0]))
    sd.commit(0, counts(10, 1))                         # the same commit again
    assert sd.record(0) == rec and names(sd, "data", 0) == files
    # a retried task rewrites a fragment after the commit: still the same part
    sd.write_fragment(0, 0, 4, rows(0, 4), None)
    sd.commit(0, counts(10, 1))
    assert sd.record(0) == rec and names(sd, "data", 0) == files
    assert storage.read_bytes(sd.part_uri("data", 0, files[0])) == data


def test_stale_attempts_are_ignored_then_swept(run_dir):
    first = StageDir(run_dir, "st")
    first.begin({"fingerprint": "f"})
    committed_part(first, 0)
    first.write_fragment(1, 0, 4, rows(100, 104), None)   # killed before part 1 committed
    stale = first.attempt()["attempt"]
    sd = StageDir(run_dir, "st")                          # the rerun
    sd.begin({"fingerprint": "f"})
    att = sd.attempt()["attempt"]
    assert att != stale and sd.committed() == [0]
    assert names(sd, "data", 1) == []                      # begin swept the uncommitted part
    # a zombie writer of the stale attempt, and a torn write, land beside this attempt's files
    first.write_fragment(1, 4, 10, rows(104, 110), None)
    storage.write_bytes(sd.part_uri("data", 1, fragment_name(0, 10, "deadbeef")), b"PAR1torn")
    sd.write_fragment(1, 0, 10, rows(0, 10), None)
    sd.commit(1, counts(10))
    assert sd.read(1).equals(rows(0, 10))                  # only this attempt's rows
    assert names(sd, "data", 1) == [fragment_name(0, 10, att)]
    # stale files in a committed part are never read, and finish deletes them
    first.write_fragment(0, 0, 4, rows(200, 204), None)
    assert sd.read(0).equals(rows(0, 10)) and sd.damaged(2) == []
    sd.finish(manifest("st", 2))
    assert names(sd, "data", 0) == [fragment_name(0, 10, stale)]


def test_damage_is_found_from_the_records(run_dir):
    sd = StageDir(run_dir, "st")
    sd.begin({"fingerprint": "f"})
    for p in range(4):
        committed_part(sd, p)
    f1, f2 = (sd.part_uri("data", p, names(sd, "data", p)[0]) for p in (1, 2))
    storage.delete(f1)                                           # a file deleted
    storage.write_bytes(f2, storage.read_bytes(f2)[:-50])        # a file truncated
    r3 = sd.part_uri("rejects", 3, names(sd, "rejects", 3)[0])
    b = storage.read_bytes(r3)
    storage.write_bytes(r3, b[:-12] + b"\0" * 12)                # a footer overwritten
    assert sd.damaged(5) == [1, 2, 3, 4]                         # and part 4 never committed
    sd.uncommit([1, 2])
    assert sd.committed() == [0, 3] and names(sd, "data", 1) == names(sd, "data", 2) == []


def test_reading_parts_makes_no_list_request(s3):
    sd = StageDir(s3.bucket() + "/run", "st")
    sd.begin({"fingerprint": "f"})
    for p in range(6):
        committed_part(sd, p)
    sd.finish(manifest("st", 6))
    reader = StageDir(sd.run_dir, "st")
    at = len(s3.log)
    parts = reader.committed()
    assert len(s3.lists(at)) == 1                                # one LIST for every part
    at = len(s3.log)
    for p in parts:
        reader.read(p, [F.SAMPLE_ID.name])
        reader.read(p, kind="rejects")
    assert s3.lists(at) == [] and len(s3.log) > at               # GETs only, never a LIST
    at = len(s3.log)
    assert reader.damaged(6) == []
    assert len(s3.lists(at)) == 3           # the records, the data and the rejects: not per part


def test_a_run_dir_of_the_rename_protocol_is_read_then_given_records(tmp_path):
    """data/part-N/_counts.json beside the part's one file (vlcurate before the records)."""
    run_dir = tmp_path / "run"
    part = run_dir / "st" / "data" / "part-00000"
    part.mkdir(parents=True)
    pq.write_table(rows(0, 10), part / fragment_name(0, 10))
    size = (part / fragment_name(0, 10)).stat().st_size
    (part / "_counts.json").write_text(json.dumps({**counts(10), "files": {
        "data": {fragment_name(0, 10): size}, "rejects": {}}}))
    sd = StageDir(str(run_dir), "st")
    assert sd.committed() == [0] and sd.damaged(1) == [] and sd.read(0).equals(rows(0, 10))
    sd.begin({"fingerprint": "f"})
    assert (run_dir / "st" / "_commit" / "part-00000.json").exists()
    assert sd.committed() == [0] and sd.read(0).equals(rows(0, 10))
    assert without_attempt(fragment_name(0, 10, "ab12")) == fragment_name(0, 10)
