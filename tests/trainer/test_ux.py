"""Trainer UX and scale: disjoint rank reads with exact resume, the
memory-mapped index, the held-out fraction by sample_id hash, the fingerprinted out_dir, the
progress bar and one clean error line through ``vlcurate finetune``."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.trainer.test_trainer import clip, composer, dag, shards  # noqa: F401 (fixtures)
from vlcurate.pipeline import config as C
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.finetune import launch
from vlcurate.pipeline.runner import run
from vlcurate.schemas import F
from vlcurate.trainer import index as IX
from vlcurate.trainer.compose import batches
from vlcurate.trainer.data import ShardSet
from vlcurate.trainer.outdir import OutDirInUse, check_out_dir
from vlcurate.trainer.train import train

TINY = {"id": "tiny", "random_init": True}


class CountingIndex(IX.ShardIndex):
    """The real index, recording which rows a rank reads."""
    def __init__(self, d):
        super().__init__(d)
        self.read_rows: list[int] = []

    def read(self, row, parts=IX.PARTS):
        self.read_rows.append(int(row))
        return super().read(row, parts)


# --- disjoint reads, exact resume, the memory-mapped index --------------------------------------
@pytest.mark.parametrize("world", [2, 3, 7])
def test_ranks_read_every_sample_exactly_once_per_epoch(shards, world):
    train_set, _ = shards.split(0.1, 0)          # an odd count: the remainder sits out
    n, per_rank = len(train_set), len(train_set) // world
    for epoch in (0, 1):
        seen, read = [], []
        for rank in range(world):
            idx = CountingIndex(shards.uri)
            part = ShardSet(shards.uri, train_set.rows, idx)
            keys = [s.key for s in part.stream(epoch=epoch, seed=4, rank=rank, world=world, buffer=8)]
            assert len(keys) == per_rank                          # equal samples per rank
            assert sorted(idx.read_rows) == sorted(part.rank_rows(epoch, 4, rank, world).tolist())
            seen += keys
            read += idx.read_rows
        assert len(set(seen)) == len(seen) == per_rank * world   # each sample at most once
        assert len(read) == len(set(read))                       # no byte range read twice
        assert n - len(seen) == n % world                        # all but the remainder
    # with world dividing the count, two ranks together read every sample exactly once
    even = ShardSet(shards.uri, train_set.rows[: len(train_set) // 2 * 2], shards.index)
    both = [s.key for r in (0, 1) for s in even.stream(epoch=3, seed=0, rank=r, world=2)]
    assert sorted(both) == sorted(shards.index.ids[int(r)].as_py() for r in even.rows)


def test_ranks_read_contiguous_shard_runs(shards):
    """Each rank reads a run of whole shards plus at most a split boundary shard."""
    codes = shards.index.code
    per = [set(codes[shards.rank_rows(0, 1, r, 2)].tolist()) for r in (0, 1)]
    assert len(per[0] & per[1]) <= 1 and per[0] | per[1] == set(codes.tolist())


def test_rank_slices_gather_only_their_shards_yet_equal_the_whole_order(shards):
    train_set, _ = shards.split(0.1, 0)
    full = train_set.epoch_order(5, 3)
    assert sorted(full.tolist()) == train_set.rows.tolist()        # a permutation of the set
    for world in (1, 2, 3, 4):
        q = len(train_set) // world
        for rank in range(world):
            assert train_set.rank_rows(5, 3, rank, world).tolist() == full[rank * q:(rank + 1) * q].tolist()


def test_two_rank_batches_resume_exactly(shards, clip):   # noqa: F811
    comp = composer(shards, clip, loss="helip")
    for rank in (0, 1):
        g = batches(shards, comp, batch_size=4, seed=2, rank=rank, world=2, buffer=8)
        seq = [next(g) for _ in range(10)]    # 60 / 2 / 4 = 7 per epoch: crosses an epoch
        g2 = batches(shards, comp, batch_size=4, seed=2, rank=rank, world=2, buffer=8,
                     start_epoch=seq[5][0], start_step=seq[5][1])
        for want, got in zip(seq[5:], (next(g2) for _ in range(5))):
            assert want[:2] == got[:2] and torch.equal(want[2].pixels, got[2].pixels)
            assert torch.equal(want[2].image_keys, got[2].image_keys)


def test_index_is_memory_mapped_and_finds_every_sample(shards):
    idx = shards.index
    cache = list(Path(shards.uri).glob(".index-*.arrow"))
    assert len(cache) == 1                                        # built once, beside the shards
    for arr in (idx.code, idx.id_hash, idx.num[F.SH_JPG_OFFSET.name]):
        assert isinstance(arr, np.ndarray) and not arr.flags.owndata   # views of the mapped file
    for s in shards.stream(epoch=0, seed=0, rank=0, world=1):
        got = shards.fetch(s.key)
        assert (got.key, got.image, got.caption, got.meta) == (s.key, s.image, s.caption, s.meta)
    assert shards.fetch("no-such-sample") is None


def test_index_lookup_survives_hash_collisions(shards, tmp_path, monkeypatch):
    d = tmp_path / "shards"
    shutil.copytree(shards.uri, d, ignore=shutil.ignore_patterns(".index-*"))
    monkeypatch.setattr(IX, "id_hash", lambda s: 7)               # every id collides
    idx = IX.ShardIndex(d)
    for r in (0, 17, len(idx) - 1):
        assert idx.row(idx.ids[r].as_py()) == r
    assert idx.row("no-such-sample") is None


# --- the held-out fraction -----------------------------------------------------------------------
def test_held_out_fraction_is_by_sample_id_hash(shards, tmp_path):
    train_set, eval_set = shards.split(0.3, 0)
    held = {shards.index.ids[int(r)].as_py() for r in eval_set.rows}
    assert len(train_set) + len(eval_set) == len(shards) and 8 <= len(held) <= 30
    assert held == {shards.index.ids[int(r)].as_py() for r in shards.split(0.3, 0)[1].rows}
    assert held != {shards.index.ids[int(r)].as_py() for r in shards.split(0.3, 1)[1].rows}
    assert len(shards.split(0.0, 0)[1]) == 0
    assert all(train_set.fetch(k) is None for k in held)          # never a hard pair in training
    # the same samples exported in other shard sizes: the same held-out set
    data = make_demo(tmp_path / "data", n=60, seed=5)
    cfg = C.load(None, {**demo_overrides(data, tmp_path / "run"), "run.progress": False,
                        "export.samples_per_shard": 7})
    run(cfg, dag=dag(), executor="local", log=lambda _: None)
    other = ShardSet(tmp_path / "run" / "export" / "shards")
    assert len(other.index.shards) != len(shards.index.shards)
    assert {other.index.ids[int(r)].as_py() for r in other.split(0.3, 0)[1].rows} == held
    with pytest.raises(ValueError, match=r"finetune.eval_fraction must be in \[0, 1\), got 1.5"):
        shards.split(1.5, 0)


# --- the fingerprinted out_dir, the progress bar -------------------------------------------------
def ft(shards, out, **over) -> C.FinetuneConfig:
    base = {"shards": shards.uri, "out_dir": str(out), "model": TINY, "batch_size": 4,
            "steps": 2, "ckpt_every": 1, "lr": 1e-3, "eval_fraction": 0.2}
    return C.from_dict({"finetune": {**base, **over}}).finetune


def test_out_dir_refuses_another_config_and_resumes_the_same(shards, tmp_path, capsys):
    out = tmp_path / "ft"
    train(ft(shards, out), shards.uri, str(out))
    err = capsys.readouterr().err
    assert "8/8" in err and "samples/s" in err and "loss " in err      # the progress bar
    with pytest.raises(OutDirInUse) as e:                       # another loss: refused, no crash
        train(ft(shards, out, loss="helip"), shards.uri, str(out))
    assert str(e.value) == (
        f"finetune.out_dir {out} holds a run of another training config (loss: \"clip\" -> "
        f"\"helip\"); resuming needs the same one: set a new finetune.out_dir, or delete {out} "
        "to start over")
    logs = []
    res = train(ft(shards, out, steps=3, ckpt_every=5, eval_batch_size=2, progress=False),
                shards.uri, str(out), log=logs.append)          # not training settings
    assert res["steps"] == 3 and "resumed from step 2 (epoch 0, batch 2)" in logs
    assert [json.loads(x)["step"] for x in (out / "log.jsonl").read_text().splitlines()] == [1, 2, 3]
    with pytest.raises(OutDirInUse, match=r"world_size: 1 -> 2"):    # the global batch changes
        check_out_dir(ft(shards, out), shards.uri, out, 2, write=False)


def test_out_dir_with_an_old_checkpoint_is_refused(shards, tmp_path):
    out = tmp_path / "old"
    out.mkdir()
    torch.save({"step": 1}, out / "checkpoint.pt")
    with pytest.raises(OutDirInUse, match="holds a checkpoint with no config.json"):
        check_out_dir(ft(shards, out), shards.uri, out, 1, write=False)


def test_launch_refuses_another_config_before_torchrun(shards, tmp_path, capsys):
    out = tmp_path / "ft"
    check_out_dir(ft(shards, out), shards.uri, out, 1, write=True)
    cfg = C.load(None, {"finetune.shards": shards.uri, "finetune.out_dir": str(out),
                        "finetune.model": TINY, "finetune.batch_size": 4, "finetune.steps": 2,
                        "finetune.ckpt_every": 1, "finetune.lr": 1e-3,
                        "finetune.eval_fraction": 0.2, "finetune.loss": "sigmoid"})
    assert launch(cfg) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: finetune.out_dir {out} holds a run of another training "
                          "config (loss: \"clip\" -> \"sigmoid\")") and err.count("\n") == 1


# --- one clean error line through `vlcurate finetune` -------------------------------------------
@pytest.mark.slow
def test_cli_missing_model_gives_one_error_line(shards, tmp_path):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "ft"
    conf = tmp_path / "ft.yaml"            # JSON is YAML
    conf.write_text(json.dumps({"finetune": {"shards": shards.uri, "out_dir": str(out),
                                             "model": {"id": "nobody/no-such-clip"}}}))
    p = subprocess.run([sys.executable, "-m", "vlcurate.pipeline.cli", "finetune", str(conf),
                        "--nproc", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("error: dual encoder 'nobody/no-such-clip': no local weights")
    # the lowest rank that reported: torchrun may stop rank 0 before it writes, once rank 1
    # has failed, so either rank's line (and log) is a correct answer
    log = re.search(r"\(traceback: (.*/error-rank[01]\.log)\)$", lines[0])
    assert log and log.group(1).startswith(str(out)), lines[0]
    assert "ModelNotFound" in Path(log.group(1)).read_text()
