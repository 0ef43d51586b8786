"""The trainer on a real S3 HTTP endpoint (moto on loopback, ``tests/s3server.py``): shards
exported locally, uploaded to a bucket, streamed and randomly accessed from there by byte ranges
(never a whole tar), checkpoints, log and eval written to the bucket, and a resume from the S3
checkpoint that ends on exactly the model an uninterrupted local run trains."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.trainer.test_trainer import shards  # noqa: F401 (fixture)
from vlcurate.pipeline import config as C
from vlcurate.foundation import storage
from vlcurate.schemas import F
from vlcurate.trainer.data import ShardSet
from vlcurate.trainer.outdir import OutDirInUse, check_out_dir
from vlcurate.trainer.train import load_checkpoint, train

TINY = {"id": "tiny", "random_init": True}


def ft(shard_uri: str, out: str, **over) -> C.FinetuneConfig:
    base = {"shards": shard_uri, "out_dir": out, "model": TINY, "batch_size": 4, "steps": 3,
            "ckpt_every": 3, "lr": 1e-3, "eval_fraction": 0.2, "loss": "helip",
            "progress": False}
    return C.from_dict({"finetune": {**base, **over}}).finetune


def tar_gets(s3, since: int) -> list[tuple[str, int]]:
    """(path, bytes asked for) of every GET of a tar since ``since``; a GET without a Range
    header (a whole-object download) counts as -1."""
    out = []
    for method, path, _, rng in s3.log[since:]:
        if method == "GET" and path.endswith(".tar"):
            if not rng.startswith("bytes="):
                out.append((path, -1))
                continue
            a, b = rng[len("bytes="):].split("-")
            out.append((path, int(b) - int(a) + 1))
    return out


def object_writes(s3, since: int, uri: str) -> list[list[str]]:
    """The writes of one object since ``since``, one list per upload: a plain ``PUT`` (the
    object appears whole), or a multipart upload (``POST uploads``, ``PUT part``s, ``POST
    complete``: S3 shows the object only once complete, whole). pyarrow uploads an object of more
    than a few MB in parts; S3 caps a single PUT at 5 GB, so a big checkpoint must be multipart."""
    key = storage.resolve(uri)[1]
    uploads: list[list[str]] = []
    for method, path, query, _ in s3.log[since:]:
        if path.strip("/") != key or method not in ("PUT", "POST"):
            continue
        kind = (method if "uploadId" not in query and "uploads" not in query else
                "POST uploads" if method == "POST" and "uploads" in query else
                "PUT part" if method == "PUT" else "POST complete")
        if kind in ("PUT", "POST uploads"):
            uploads.append([])
        uploads[-1].append(kind)
    return uploads


@pytest.fixture(scope="module")
def bucket_shards(s3, shards) -> str:   # noqa: F811
    uri = f"{s3.bucket()}/export/shards"
    storage.upload_dir(shards.uri, uri)
    return uri


def tar_sizes(shards) -> dict[str, int]:   # noqa: F811
    return {p.name: p.stat().st_size for p in Path(shards.uri).glob("*.tar")}


def test_shards_on_s3_read_the_same_samples_by_byte_ranges(s3, shards, bucket_shards):  # noqa: F811
    remote = ShardSet(bucket_shards)
    assert len(remote) == len(shards) and remote.index.shards == shards.index.shards
    at = len(s3.log)
    got = [(s.key, s.image, s.caption, s.meta) for s in remote.stream(epoch=0, seed=1, rank=1,
                                                                          world=2, buffer=8)]
    want = [(s.key, s.image, s.caption, s.meta) for s in shards.stream(epoch=0, seed=1, rank=1,
                                                                          world=2, buffer=8)]
    assert got == want and len(got) == len(shards) // 2
    gets = tar_gets(s3, at)
    assert len(gets) == len(got) and all(n > 0 for _, n in gets)     # one ranged GET a sample
    # random access (HELIP's hard pairs): one ranged GET each, a sample's span, not its tar
    sizes = tar_sizes(shards)
    ids = [shards.index.ids[r].as_py() for r in (0, len(shards) // 2, len(shards) - 1)]
    at = len(s3.log)
    for i in ids:
        a, b = remote.fetch(i), shards.fetch(i)
        assert (a.key, a.image, a.caption, a.meta) == (b.key, b.image, b.caption, b.meta)
    gets = tar_gets(s3, at)      # exactly each sample's span (its members and their headers)
    assert [n for _, n in gets] == [shards.index.span(shards.index.row(i))[1] for i in ids]
    assert all(n < sizes[path.rsplit("/", 1)[1]] / 10 for path, n in gets)
    assert remote.fetch("no-such-sample") is None


def test_train_from_s3_to_s3_then_resume_equals_a_local_run(s3, shards, bucket_shards,  # noqa: F811
                                                             tmp_path):
    out = f"{s3.bucket()}/ft/run1"
    at = len(s3.log)
    logs: list[str] = []
    assert train(ft(bucket_shards, out), bucket_shards, out, log=logs.append)["steps"] == 3
    gets = tar_gets(s3, at)
    sizes = tar_sizes(shards)
    biggest = max(shards.index.span(r)[1] for r in range(len(shards)))    # one sample's bytes
    assert gets and all(0 < n <= biggest for _, n in gets) and biggest < max(sizes.values()) / 10
    assert sum(n for _, n in gets) < sum(sizes.values())        # never a whole tar
    assert len(s3.lists(at)) <= 4     # the index's folder once, the checkpoint's existence: none a step
    log = [json.loads(x) for x in storage.read_bytes(f"{out}/log.jsonl").decode().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and sum(r["hard_added"] for r in log) > 0
    assert load_checkpoint(f"{out}/checkpoint.pt", "cpu")["step"] == 3
    assert json.loads(storage.read_bytes(f"{out}/eval.json"))["n"] > 0
    writes = object_writes(s3, at, f"{out}/checkpoint.pt")      # finished bytes, written once
    assert writes == [["POST uploads", "PUT part", "PUT part", "POST complete"]] \
        or writes == [["PUT"]], writes
    assert object_writes(s3, at, f"{out}/eval.json") == [["PUT"]]

    # resume from the S3 checkpoint to step 5 ...
    logs.clear()
    train(ft(bucket_shards, out, steps=5), bucket_shards, out, log=logs.append)
    assert "resumed from step 3 (epoch 0, batch 3)" in logs
    log = [json.loads(x) for x in storage.read_bytes(f"{out}/log.jsonl").decode().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5]
    # ... is the model a local run of 5 steps over the local shards trains
    local = tmp_path / "local"
    train(ft(shards.uri, str(local), steps=5), shards.uri, str(local))
    a = load_checkpoint(f"{out}/checkpoint.pt", "cpu")["model"]
    b = load_checkpoint(local / "checkpoint.pt", "cpu")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # another training config is refused on S3 too, naming the out_dir
    with pytest.raises(OutDirInUse, match=f"finetune.out_dir {out} holds a run of another"):
        check_out_dir(ft(bucket_shards, out, loss="clip"), bucket_shards, out, 1, write=False)


@pytest.mark.slow
def test_two_ranks_under_torchrun_read_their_own_samples_from_s3(s3, shards, bucket_shards,  # noqa: F811
                                                                  capfd):
    """``vlcurate finetune`` (launch: the driver's checks, then torchrun with 2 gloo ranks) with
    the shards and out_dir given as URIs that carry credentials: each rank streams its own
    samples (no sample's byte range is asked for twice), and the secret is never shown or
    written."""
    from vlcurate.pipeline.finetune import launch
    bucket, secret = bucket_shards.split("/")[2], "SECRETxyz42"
    src = f"s3://testing:{secret}@{bucket}/export/shards"
    out_plain = f"{s3.bucket()}/ft/ddp"
    out = out_plain.replace("s3://", f"s3://testing:{secret}@")
    cfg = C.load(None, {f"finetune.{k}": v for k, v in C.to_dict(
        ft(src, out, loss="clip", steps=2, ckpt_every=1)).items()})
    at = len(s3.log)
    assert launch(cfg, nproc=2) == 0
    spans = [(p, r) for m, p, _, r in s3.log[at:] if m == "GET" and p.endswith(".tar")
             and r.startswith("bytes=") and _is_full_span(shards, r)]
    assert len(spans) >= 2 * 2 * 4 and len(set(spans)) == len(spans)   # 2 ranks x 2 steps x 4
    log = [json.loads(x) for x in storage.read_bytes(f"{out_plain}/log.jsonl").decode().splitlines()]
    assert [r["step"] for r in log] == [1, 2] and log[0]["images"] == 2 * 4
    ranks = [json.loads(storage.read_bytes(f"{out_plain}/params-rank{r}.json")) for r in (0, 1)]
    assert ranks[0]["param_sum"] == ranks[1]["param_sum"]
    shown = capfd.readouterr()
    assert f"s3://***@{bucket}/export/shards" in shown.out
    written = [storage.read_bytes(f"{out_plain}/{i.base_name}")
               for i in storage.list_files(out_plain) if not i.base_name.endswith(".pt")]
    for blob in (*written, shown.out.encode(), shown.err.encode()):
        assert secret.encode() not in blob


def _is_full_span(shards, rng: str) -> bool:   # noqa: F811
    """A Range header that covers one whole sample (its jpg, txt and json): a streamed read."""
    a, b = (int(x) for x in rng[len("bytes="):].split("-"))
    starts = shards.index.num[F.SH_JPG_OFFSET.name]
    hit = np.nonzero(starts == a)[0]
    return len(hit) > 0 and any(shards.index.span(int(r)) == (a, b - a + 1) for r in hit)


@pytest.mark.slow
def test_cli_finetune_on_a_run_directory_in_a_bucket(s3, shards, capfd):  # noqa: F811
    """``vlcurate finetune s3://bucket/run``: the config comes from the bucket's run.json, the
    shards from ``<run>/export/shards`` there and the out_dir defaults to ``<run>/finetune``
    there; a prefix with no run.json is refused with one line."""
    from vlcurate.pipeline.cli import main
    run_dir = f"{s3.bucket()}/runs/r1"
    storage.upload_dir(str(Path(shards.uri).parents[1]), run_dir)
    sets = [f"finetune.{k}={v}" for k, v in {
        "model": json.dumps(TINY), "batch_size": 4, "steps": 2, "ckpt_every": 1,
        "loss": "helip", "eval_fraction": 0.2, "progress": "false"}.items()]
    assert main(["finetune", run_dir, "--nproc", "1", *sum((["--set", x] for x in sets), [])]) == 0
    log = storage.read_bytes(f"{run_dir}/finetune/log.jsonl").decode().splitlines()
    assert [json.loads(x)["step"] for x in log] == [1, 2]
    assert load_checkpoint(f"{run_dir}/finetune/checkpoint.pt", "cpu")["step"] == 2
    capfd.readouterr()
    assert main(["finetune", f"{s3.bucket()}/nothing"]) == 2
    assert "is not a vlcurate run directory (no run.json)" in capfd.readouterr().err


def test_a_bucket_prefix_without_shards_is_refused_with_a_reason(s3):
    bucket = s3.bucket().split("//")[1]
    uri = f"s3://testing:SECRETxyz42@{bucket}/no/shards"
    with pytest.raises(FileNotFoundError) as e:
        ShardSet(uri)
    assert str(e.value).startswith(f"s3://***@{bucket}/no/shards: no manifest.json; point "
                                   "finetune.shards at the shards folder")
