"""Resources never change a byte: the same DAG (demo-like tiny models) with three batch sizes,
an actor pool, stages asking for GPUs and both executors writes identical tables, commit records
and shards (export with keep_top_fraction: its run-wide step runs as a Ray task, its reads as Ray
tasks)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest

from tests.pipeline.test_runner import cfg_for, quiet
from vlcurate.foundation import storage
from vlcurate.pipeline import homes
from vlcurate.pipeline.demo import make_demo
from vlcurate.pipeline.rundir import KINDS, StageDir, without_attempt
from vlcurate.pipeline.runner import run
from vlcurate.pipeline.summary import problems

STAGES = ("ingest", "ids", "embed", "hpm", "positives", "export")
# written per run, not outputs: timestamps, wall times, pids, the config with its run_dir
VOLATILE = {"run.json", "summary.parquet", "_manifest.json", "_info.json", "_state.pkl"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The demo, plus a second caption for six images of the first part in the last part: their
    per-image work goes through the image pass (pipeline/homes.py)."""
    out = make_demo(tmp_path_factory.mktemp("det") / "data", n=60, seed=3)
    with open(out / "captions.csv", "ab") as fh:
        for i in range(0, 12, 2):
            fh.write(f"again-{i},img_{i:05d}.jpg,a second caption of picture {i}\n".encode())
    return out


def resources(batch_size: int, concurrency=None) -> dict:
    out = {}
    for s in STAGES:
        out[f"{s}.resources.batch_size"] = batch_size
        out[f"{s}.resources.concurrency"] = concurrency if s == "embed" else None
    return out


def run_once(data: Path, run_dir: Path, executor: str, batch_size: int, concurrency=None,
             gpus: Optional[dict] = None) -> dict:
    # 24-row parts in chunks of 4 rows: batch sizes 3 and 10 round to 4 and 12 rows, i.e. 6 and
    # 2 batches per part; 0 is a whole part per batch. Micro-batches of 4 inside each chunk.
    # hpm's chunks of 10 rows span parts (rows 20-29: parts 0 and 1).
    cfg = cfg_for(data, run_dir, **{"run.stages": list(STAGES[1:-1]), "source.rows_per_part": 24,
                                    "run.chunk_rows": 4, "hpm.engine.chunk_rows": 10,
                                    "embed.text_batch_size": 2,
                                    "embed.image_batch_size": 2, "export.samples_per_shard": 20,
                                    "export.keep_top_fraction": 0.6,   # a global step too
                                    **resources(batch_size, concurrency), **(gpus or {})})
    res = run(cfg, executor=executor, log=quiet)
    assert not problems(res) and [r.manifest["stage"] for r in res] == list(STAGES)
    return snapshot(run_dir)


def went_through_homes(run_dir) -> bool:
    """embed's images spanned parts (the data's second captions), each computed once."""
    sd = StageDir(str(run_dir), "embed")
    said = sd.read_json("_info.json")["images"]
    return homes.spanned(sd.uri("_homes")) and said["computed"] == said["distinct"]


def snapshot(run_dir) -> dict:
    """{relative path: bytes} of every output of a run (a folder or a URI), less the volatile
    files: the committed files of each part under their names less the attempt id (the files a
    commit record names; any other file in a part folder is not an output), and the records with
    those names."""
    root = storage.resolve(str(run_dir))[1].rstrip("/")
    out = {}
    for info in storage.list_files(str(run_dir)):
        rel = info.path[len(root) + 1:]
        bits = rel.split("/")
        if info.base_name in VOLATILE or "_prepare" in bits or "_homes" in bits:
            continue
        uri = storage.join(str(run_dir), rel)
        if len(bits) == 4 and bits[1] in KINDS:          # <stage>/<kind>/part-N/<file>
            sd = StageDir(run_dir, bits[0])
            if info.base_name in sd.files(int(bits[2].split("-")[1]), bits[1]):
                out["/".join(bits[:3] + [without_attempt(bits[3])])] = storage.read_bytes(uri)
        elif len(bits) == 3 and bits[1] == "_commit":
            rec = storage.read_json(uri)
            rec["files"] = {k: {without_attempt(n): v for n, v in f.items()}
                            for k, f in rec["files"].items()}
            out[rel] = json.dumps(rec, sort_keys=True).encode()
        else:
            out[rel] = storage.read_bytes(uri)
    return out


def differing(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    ref_dir = tmp_path_factory.mktemp("ref") / "run"
    ref = run_once(data, ref_dir, "local", 0)
    assert went_through_homes(ref_dir)
    assert sum(k.endswith(".tar") for k in ref) >= 2
    assert {k.split("/")[0] for k in ref if k.endswith(".parquet")} >= set(STAGES)
    return ref


# Half a GPU for a stage in tasks (ids) and one on an actor pool (embed): on the session's Ray,
# which has one logical GPU (tests/conftest.py; no device, so the models run on the CPU), they go
# through Ray Data's public map_batches, which wants an int batch size when GPUs are asked for.
HALF_GPU = {f"{s}.resources.num_gpus": 0.5 for s in ("ids", "embed")}
# (executor, resources.batch_size, embed's actor-pool size, GPUs asked for)
VARIANTS = {"local-3": ("local", 3, None, None), "local-10": ("local", 10, None, None),
            "ray-3-gpus": ("ray", 3, 1, HALF_GPU)}


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_outputs_are_identical_whatever_the_resources(variant, data, reference, tmp_path, request):
    executor, bs, conc, gpus = VARIANTS[variant]
    if executor == "ray":
        request.getfixturevalue("ray_local")
    got = run_once(data, tmp_path / "run", executor, bs, conc, gpus)
    assert differing(got, reference) == []
    assert went_through_homes(tmp_path / "run")


def test_batches_round_to_whole_chunks_and_a_cut_chunk_is_refused():
    import numpy as np
    import pyarrow as pa

    from vlcurate.pipeline.parts import AlignmentError, batch_rows, chunks
    from vlcurate.schemas import F
    assert [batch_rows(b, 4) for b in (0, 1, 4, 5, 10)] == [0, 4, 4, 8, 12]

    def batch(part_rows: int, lo: int, hi: int, part: int = 0) -> pa.Table:
        return pa.table({F.PART.name: np.full(hi - lo, part), F.ROW.name: np.arange(lo, hi),
                         F.PART_ROWS.name: np.full(hi - lo, part_rows)})
    # two parts in one batch: chunks never span them; a part's last chunk may be short
    both = pa.concat_tables([batch(10, 4, 10), batch(6, 0, 6, part=1)])
    assert chunks(both, 4) == [(0, 4), (4, 6), (6, 10), (10, 12)]
    with pytest.raises(AlignmentError, match="cut a chunk"):
        chunks(batch(10, 2, 8), 4)
    with pytest.raises(AlignmentError, match="cut a chunk"):
        chunks(batch(10, 0, 6), 4)
    # a spanning stage's batch is one chunk: consecutive rows, a part's end then the next's start
    from vlcurate.pipeline.parts import spanning_chunk
    assert spanning_chunk(both, 12) == [(0, 12)]
    for bad, size in ((both, 11), (pa.concat_tables([batch(10, 4, 9), batch(6, 0, 6, 1)]), 12),
                      (pa.concat_tables([batch(10, 4, 10), batch(6, 1, 6, 1)]), 12)):
        with pytest.raises(AlignmentError, match="not one chunk"):
            spanning_chunk(bad, size)


def test_spanning_chunks_are_cut_by_the_part_sizes_alone():
    """A spans_parts stage's items (executors.spanning_items): chunk_rows consecutive rows over
    all parts, empty parts skipped; only chunks with a pending part's rows are work, and they
    are the same chunks as a full run's (a committed part's rows come along as context)."""
    from vlcurate.pipeline.executors import spanning_items
    sizes = [7, 0, 5, 10, 3]
    full = spanning_items([0, 1, 2, 3, 4], sizes, 6)
    assert full == [((0, 0, 6),), ((0, 6, 7), (2, 0, 5)), ((3, 0, 6),), ((3, 6, 10), (4, 0, 2)),
                    ((4, 2, 3),)]
    assert [sum(hi - lo for _, lo, hi in item) for item in full] == [6, 6, 6, 6, 1]
    assert spanning_items([2, 4], sizes, 6) == [full[1], full[3], full[4]]
    assert spanning_items([1], sizes, 6) == []          # an empty part: committed empty
    assert spanning_items([0, 1, 2, 3, 4], sizes, 100) == [((0, 0, 7), (2, 0, 5), (3, 0, 10),
                                                            (4, 0, 3))]
