"""The trainer on shards the pipeline produced: batch composition (HELIP, FFF, CLIP-C), the
deterministic stream, retrieval metrics, and a 2-process gloo DDP run with resume."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from tests.conftest import shared_data
from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import Node
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.finetune import launch
from vlcurate.pipeline.runner import run
from vlcurate.schemas import F, tables
from vlcurate.schemas import mining as MI
from vlcurate.stages.base import Stage
from vlcurate.stages.export import ExportStage
from vlcurate.trainer.compose import Composer, batches, step_rng
from vlcurate.trainer.data import A, ShardSet
from vlcurate.trainer.train import retrieval_metrics
from vlcurate.stages.ids import IdsStage
from vlcurate.stages.ingest import IngestStage
from vlcurate.foundation.models import load_clip


RELS = (MI.REL_DUPLICATE, MI.REL_IMAGE, MI.REL_TEXT)


class FakeMining(Stage):
    """Stands in for the mining and recaption stages: each row's hard pairs are the next two
    rows of its part, its mined positive the previous row (relation duplicate, image or text by
    row), and two recaptions."""
    name = "fakemine"
    inputs = {"ingest": (F.CAPTION,)}
    output = tables.stage_table(pa.field(A.hard_ids, pa.list_(pa.string())),
                                pa.field(A.positive_ids, pa.list_(pa.string())),
                                pa.field(A.positive_relations, pa.list_(pa.string())),
                                pa.field(A.recaptions, pa.list_(pa.string())))

    def __call__(self, batch: pa.Table) -> pa.Table:
        ids = batch.column(F.SAMPLE_ID.name).to_pylist()
        n = len(ids)
        return pa.table({F.SAMPLE_ID.name: ids,
                         A.hard_ids: [[ids[(i + 1) % n], ids[(i + 2) % n]] for i in range(n)],
                         A.positive_ids: [[ids[i - 1]] if i else [] for i in range(n)],
                         A.positive_relations: [[RELS[i % 3]] if i else [] for i in range(n)],
                         A.recaptions: [[f"recap one {i}", f"recap two {i}"] for i in range(n)],
                         F.REASONS.name: [[]] * n, F.REASON_DETAIL.name: [None] * n},
                        schema=self.output)


def dag():
    return [Node(IngestStage), Node(IdsStage, after=("ingest",)),
            Node(FakeMining, after=("ids",)),
            Node(ExportStage, after=("ingest", "ids", "fakemine"))]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> ShardSet:
    root = tmp_path_factory.mktemp("ft")
    data = make_demo(root / "data", n=60, seed=5)
    cfg = C.load(None, {**demo_overrides(data, root / "run"), "run.progress": False,
                        "export.samples_per_shard": 20})
    run(cfg, dag=dag(), executor="local", log=lambda _: None)
    return ShardSet(root / "run" / "export" / "shards")


@pytest.fixture(scope="module")
def clip():
    return load_clip(C.ModelSpec(id="tiny", random_init=True))


def composer(shards, clip, **ft) -> Composer:
    cfg = C.from_dict({"finetune": ft}).finetune
    return Composer(cfg, shards, clip.tokenizer, clip.image_size, clip.mean, clip.std)


def test_helip_batches_contain_each_seeds_hard_pairs(shards, clip):
    comp = composer(shards, clip, loss="helip", helip_seed_fraction=0.5, helip_p=2)
    samples = list(shards.stream(epoch=0, seed=0, rank=0, world=1))[:8]
    b = comp(samples, step_rng(0, 0, 0, 0))
    seeds = [i for i in range(8) if (b.hard_index[i] >= 0).any()]
    assert len(seeds) == 4 and b.n_hard_added == 8
    assert b.pixels.shape[0] == 8 + 8 and len(b.caption_col) == 16
    keys = [s.key for s in samples] + [None] * 8
    fetched = comp.helip(samples, step_rng(0, 0, 0, 0))[0]
    for i in seeds:
        for j in b.hard_index[i].tolist():
            assert fetched[j].key in samples[i].meta[A.hard_ids]   # a mined hard pair of seed i
            assert j >= 8                                          # appended to the batch
    assert keys[:8] == [s.key for s in fetched[:8]]
    # no hard pairs are added for other losses
    assert composer(shards, clip, loss="clip")(samples, step_rng(0, 0, 0, 0)).n_hard_added == 0


def test_a_positive_is_never_drawn_as_a_hard_negative(shards, clip):
    """A near-duplicate twin mined as both a hard pair and a positive of the seed is a
    positive only."""
    import dataclasses
    from vlcurate.trainer.compose import hard_negatives
    samples = list(shards.stream(epoch=0, seed=0, rank=0, world=1))[:8]
    twins = [dataclasses.replace(s, meta={**s.meta, A.positive_ids: [s.meta[A.hard_ids][0]]})
             for s in samples]
    assert all(hard_negatives(t.meta) == t.meta[A.hard_ids][1:] for t in twins)
    comp = composer(shards, clip, loss="helip", helip_seed_fraction=1.0, helip_p=4)
    fetched, hard = comp.helip(twins, step_rng(0, 0, 0, 0))
    drawn = {(i, fetched[j].key) for i, h in enumerate(hard) for j in h}
    assert len(drawn) == 8 and all(k == twins[i].meta[A.hard_ids][1] for i, k in drawn)


def with_positives(shards, n: int) -> list:
    """``n`` streamed samples, then the mined positive of each (so pairs are in the batch)."""
    first = list(shards.stream(epoch=0, seed=0, rank=0, world=1))[:n]
    have = {s.key for s in first}
    extra = [shards.fetch(p) for s in first for p in s.meta[A.positive_ids] if p not in have]
    return first + [e for e in extra if e is not None]


def test_fff_texts_and_positive_mask(shards, clip):
    comp = composer(shards, clip, loss="sigmoid", fff_recaptions=5)
    samples = with_positives(shards, 4)
    n = len(samples)
    b = comp(samples, step_rng(0, 0, 0, 0))
    assert b.input_ids.shape[0] == n * 3                 # caption + 2 recaptions each
    where = {s.key: i for i, s in enumerate(samples)}
    mined = 0
    for i, s in enumerate(samples):
        own = (b.text_owner == i)
        assert b.pos_mask[i][own].all() and own.sum() == 3
        # directional (FFF's M[i, j]: image i, the texts of j): only what row i lists
        expected = {i} | {where[p] for p in s.meta[A.positive_ids] if p in where}
        mined += len(expected) - 1
        assert set(b.text_owner[b.pos_mask[i]].tolist()) == expected
    assert mined >= 4
    off = composer(shards, clip, loss="sigmoid", fff_recaptions=0, fff_mined_positives=False)
    b0 = off(samples, step_rng(0, 0, 0, 0))
    assert torch.equal(b0.pos_mask, torch.eye(n, dtype=torch.bool))


def test_mp_nce_domains_follow_the_relation(shards, clip):
    comp = composer(shards, clip, loss="mp_nce", fff_recaptions=5, mp_views=2)
    samples = with_positives(shards, 4)
    n = len(samples)
    b = comp(samples, step_rng(0, 0, 0, 0))
    assert b.pixels.shape[0] == 2 * n and b.n_views == 2
    where = {s.key: i for i, s in enumerate(samples)}
    for i, s in enumerate(samples):
        mine = (b.text_owner == i).nonzero().flatten()
        assert b.text_pos[mine][:, mine].all()          # caption and recaptions: positives
        assert b.image_pos[i, n + i] and b.image_pos[n + i, i]          # two views of one image
        for p, rel in zip(s.meta[A.positive_ids], s.meta[A.positive_relations]):
            if p not in where:
                continue
            j = where[p]
            theirs = (b.text_owner == j).nonzero().flatten()
            assert b.pos_mask[i][theirs].all() and b.pos_mask[n + i][theirs].all()
            assert bool(b.image_pos[i, j]) == (rel in (MI.REL_DUPLICATE, MI.REL_IMAGE))
            assert bool(b.text_pos[mine][:, theirs].all()) == (rel in (MI.REL_DUPLICATE, MI.REL_TEXT))
            assert not b.text_pos[mine][:, theirs].any() or rel != MI.REL_IMAGE


def test_clipc_composites(shards, clip):
    from vlcurate.trainer.data import composite
    from PIL import Image
    a, b = Image.new("RGB", (40, 40), (255, 0, 0)), Image.new("RGB", (40, 40), (0, 0, 255))
    c = composite(a, b, 32)
    assert c.getpixel((4, 16)) == (255, 0, 0) and c.getpixel((28, 16)) == (0, 0, 255)
    c = composite(a, b, 32, "stacked")
    assert c.getpixel((16, 4)) == (255, 0, 0) and c.getpixel((16, 28)) == (0, 0, 255)
    with pytest.raises(ValueError, match="layout"):
        composite(a, b, 32, "diagonal")
    comp = composer(shards, clip, loss="clip", clipc_fraction=1.0)
    samples = list(shards.stream(epoch=0, seed=0, rank=0, world=1))[:8]
    batch = comp(samples, step_rng(0, 0, 0, 0))
    assert batch.n_composites == 8
    texts = comp.tok.batch_decode(batch.input_ids, skip_special_tokens=True)
    # every composite joins two *original* captions: never a composite made earlier
    originals = [comp.tok.decode(comp.tok(s.caption)["input_ids"], skip_special_tokens=True)
                 for s in samples]
    pairs = {f"{x} and {y}" for i, x in enumerate(originals) for j, y in enumerate(originals) if i != j}
    assert all(t in pairs for t in texts), texts
    # HELIP seeds and their hard pairs stay originals; the other rows all become composites
    hc = composer(shards, clip, loss="helip", clipc_fraction=1.0, helip_seed_fraction=0.5)
    hb = hc(samples, step_rng(0, 0, 0, 0))
    helip_rows = {i for i in range(8) if (hb.hard_index[i] >= 0).any()}
    helip_rows |= {int(j) for j in hb.hard_index.flatten() if j >= 0}
    assert len(helip_rows) == 8 and hb.n_composites == hb.pixels.shape[0] - len(helip_rows)


def test_missing_annotation_stops_the_trainer(shards):
    from vlcurate.trainer.fields import MissingAnnotation
    from vlcurate.trainer.train import check_config
    ok = C.from_dict({"finetune": {"loss": "mp_nce"}}).finetune
    check_config(ok, shards)                      # hard pairs, positives, recaptions: all there
    cfg = C.from_dict({"finetune": {"loss": "sigmoid", "concept_weight": 0.5, "n_objects": 3,
                                    "n_attributes": 3}}).finetune
    with pytest.raises(MissingAnnotation, match="concept_object_ids.*stage concepts"):
        check_config(cfg, shards)


def test_launch_stops_with_the_reason(shards, capsys):
    cfg = C.load(None, {"finetune.shards": shards.uri, "finetune.loss": "sigmoid",
                        "finetune.concept_weight": 0.5, "finetune.n_objects": 2,
                        "finetune.n_attributes": 2})
    assert launch(cfg) == 2                        # before torchrun starts
    assert "concept_object_ids (needed by finetune.concept_weight > 0" in capsys.readouterr().err


def test_concept_ids_must_fit_the_heads(shards, clip):
    from vlcurate.trainer.data import Sample
    comp = composer(shards, clip, loss="clip", concept_weight=0.5, n_objects=2, n_attributes=2)
    s = next(iter(shards.stream(epoch=0, seed=0, rank=0, world=1)))
    meta = {**s.meta, A.object_ids: [0, 5], A.object_probs: [0.5, 0.5],
            A.attribute_ids: [1], A.attribute_probs: [1.0]}
    with pytest.raises(ValueError, match="n_objects"):
        comp([Sample(s.key, s.image, s.caption, meta)] * 2, step_rng(0, 0, 0, 0))


def test_checkpoints_load_weights_only(tmp_path):
    from vlcurate.trainer.train import UnsafeCheckpoint, load_checkpoint
    good = tmp_path / "good.pt"
    torch.save({"model": {"w": torch.ones(2)}, "step": 3}, good)
    assert load_checkpoint(good, "cpu")["step"] == 3
    bad = tmp_path / "bad.pt"
    torch.save({"model": {}, "step": 3, "payload": Path("/tmp")}, bad)   # an arbitrary object
    with pytest.raises(UnsafeCheckpoint, match="refused"):
        load_checkpoint(bad, "cpu")


def test_stream_is_deterministic_and_resumable(shards):
    full = [s.key for s in shards.stream(epoch=1, seed=3, rank=0, world=1, buffer=8)]
    assert len(full) == len(shards) and len(set(full)) == len(full)
    assert [s.key for s in shards.stream(epoch=1, seed=3, rank=0, world=1, buffer=8, skip=10)] == full[10:]
    assert full != [s.key for s in shards.stream(epoch=2, seed=3, rank=0, world=1, buffer=8)]
    r0 = [s.key for s in shards.stream(epoch=0, seed=0, rank=0, world=2)]
    r1 = [s.key for s in shards.stream(epoch=0, seed=0, rank=1, world=2)]
    assert len(r0) == len(r1) == len(shards) // 2 and not set(r0) & set(r1)


def test_batches_resume_mid_epoch(shards, clip):
    comp = composer(shards, clip, loss="helip")
    g = batches(shards, comp, batch_size=8, seed=0, rank=0, world=1, buffer=8)
    seq = [next(g) for _ in range(9)]        # crosses an epoch boundary (66 samples / 8)
    g2 = batches(shards, comp, batch_size=8, seed=0, rank=0, world=1, buffer=8,
                 start_epoch=seq[5][0], start_step=seq[5][1])
    for want, got in zip(seq[5:], (next(g2) for _ in range(4))):
        assert want[:2] == got[:2] and torch.equal(want[2].pixels, got[2].pixels)
        assert torch.equal(want[2].hard_index, got[2].hard_index)


def test_retrieval_metrics():
    sim = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.1, 0.8], [0.0, 0.3, 0.7]])
    m = retrieval_metrics(sim, ks=(1, 2, 3))
    # i2t: row 1's true text (0.1) is beaten by 0.2 and 0.8 -> rank 3
    assert [m[f"i2t_R@{k}"] for k in (1, 2, 3)] == pytest.approx([2 / 3, 2 / 3, 1], abs=1e-6)
    # t2i: column 1's true image ties another 0.1 (a tie counts against it) and is beaten by 0.3
    assert [m[f"t2i_R@{k}"] for k in (1, 2, 3)] == pytest.approx([1 / 3, 2 / 3, 1], abs=1e-6)
    # rows 1 and 2 show one image: another caption of it never counts against the true one
    g = retrieval_metrics(sim, ks=(1, 2, 3), groups=torch.tensor([7, 8, 8]))
    assert [g[f"i2t_R@{k}"] for k in (1, 2, 3)] == pytest.approx([2 / 3, 1, 1], abs=1e-6)


@pytest.mark.slow
@pytest.mark.realdata
def test_ddp_gloo_two_processes_on_coco_shards_with_resume(tmp_path):
    data = shared_data("coco_mini")
    cfg = C.load(None, {"source.path": str(data), "source.max_captions_per_image": 1,
                        "source.rows_per_part": 120, "run.run_dir": str(tmp_path / "run"),
                        "run.progress": False, "export.samples_per_shard": 60})
    run(cfg, dag=dag(), executor="local", log=lambda _: None)   # helip reads hard pairs
    ft = {"finetune.model": {"id": "tiny", "random_init": True}, "finetune.batch_size": 8,
          "finetune.steps": 20, "finetune.ckpt_every": 5, "finetune.lr": 5e-4,
          "finetune.weight_decay": 0.0, "finetune.loss": "helip"}

    def go(out: str, **over) -> Path:
        c = cfg.replace(**{**ft, "finetune.out_dir": str(tmp_path / out), **over})
        assert launch(c, nproc=2) == 0
        return tmp_path / out

    full = go("full")
    log = [json.loads(line) for line in (full / "log.jsonl").read_text().splitlines()]
    # 8 per rank + one hard pair for each of the 4 seeds per rank (HELIP p = 1, 50 % seeds)
    assert [r["step"] for r in log] == list(range(1, 21)) and log[0]["images"] == 2 * (8 + 4)
    first, last = sum(r["loss"] for r in log[:5]) / 5, sum(r["loss"] for r in log[-5:]) / 5
    assert last < first, (first, last)
    ranks = [json.loads((full / f"params-rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["param_sum"] == ranks[1]["param_sum"]
    ev = json.loads((full / "eval.json").read_text())
    assert ev["n"] > 0 and 0 <= ev["i2t_R@1"] <= ev["i2t_R@5"] <= ev["i2t_R@10"] <= 1
    # stopped at step 12 (last checkpoint), then resumed to 20: the same model as the full run
    go("resumed", **{"finetune.steps": 12})
    go("resumed")
    a = torch.load(full / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "resumed" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["mp_nce", "sigmoid"])
def test_ddp_multi_positive_losses_two_processes(shards, tmp_path, loss):
    """UniCLIP's views and positive sets (and FFF's M) across 2 gloo ranks: the global masks line
    up with the gathered embeddings, the loss is finite and the ranks stay identical."""
    cfg = C.load(None, {"finetune.shards": shards.uri, "finetune.out_dir": str(tmp_path),
                        "finetune.model": {"id": "tiny", "random_init": True},
                        "finetune.loss": loss, "finetune.mp_views": 2, "finetune.batch_size": 4,
                        "finetune.steps": 3, "finetune.eval_fraction": 0, "finetune.lr": 1e-3,
                        "finetune.bias_init_batches": 1})
    assert launch(cfg, nproc=2) == 0
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3] and all(r[loss] > 0 for r in log)
    assert log[0]["images"] == 2 * 4 * (2 if loss == "mp_nce" else 1)
    ranks = [json.loads((tmp_path / f"params-rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["param_sum"] == ranks[1]["param_sum"]
