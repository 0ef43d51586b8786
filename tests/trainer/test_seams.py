"""Seams between the pipeline and the trainer, on a real ``vlcurate demo`` export whose first
images have three captions each (image groups).

The whole default DAG runs on the demo dataset (local executor); then batches are built the way
``vlcurate finetune`` builds them (``pipeline.finetune.resolve`` for the shards, then
``train.prepare`` and ``compose.batches``). Each annotation must arrive non-empty in a batch, and
each configured loss term must be non-zero with a non-zero gradient on its own parameters.
"""
from __future__ import annotations

import csv

import pyarrow.parquet as pq
import pytest
import torch

from vlcurate.pipeline import config as C
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.finetune import resolve
from vlcurate.pipeline.runner import run
from vlcurate.schemas import concepts as CO
from vlcurate.trainer import train as T
from vlcurate.trainer.compose import batches
from vlcurate.trainer.fields import A

TINY = {"id": "tiny", "random_init": True}


def more_captions(data, n_images: int = 12) -> None:
    """Give the first demo images two more captions each (COCO-style image groups)."""
    with open(data / "captions.csv", encoding="latin-1") as fh:      # the demo's odd rows too
        recs = [r for r in csv.DictReader(fh) if r["id"].startswith("demo-")][:n_images]
    with open(data / "captions.csv", "a", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        for r in recs:
            w.writerow([f"{r['id']}-b", r["image"], f"a photo of {r['caption']}"])
            w.writerow([f"{r['id']}-c", r["image"], f"{r['caption']}, seen from above"])


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> C.Config:
    root = tmp_path_factory.mktemp("seams")
    data = make_demo(root / "data", n=40)
    more_captions(data)
    cfg = C.load(None, {**demo_overrides(data, root / "run"), "run.progress": False})
    run(cfg, executor="local", log=lambda _: None)
    return cfg


def vocab_sizes(cfg: C.Config) -> tuple[int, int]:
    t = pq.read_table(f"{cfg.run.run_dir}/concepts/vocab.parquet")
    kinds = t.column(CO.V_KIND.name).to_pylist()
    return kinds.count("object"), kinds.count("attribute")


def setup(demo: C.Config, **ft) -> tuple[T.Setup, object]:
    """``vlcurate finetune``'s path: resolve the config, prepare, stream batches."""
    over = {"model": TINY, "eval_fraction": 0, "concept_weight": 0.5, "shuffle_buffer": 8, **ft}
    cfg = demo.replace(**{f"finetune.{k}": v for k, v in over.items()})
    fcfg, shards, _ = resolve(cfg)              # head sizes from <run>/concepts/vocab.parquet
    assert (fcfg.n_objects, fcfg.n_attributes) == vocab_sizes(demo) and fcfg.n_objects > 0
    torch.manual_seed(0)
    s = T.prepare(fcfg, shards)
    bs = min(8, len(s.train_set))
    gen = batches(s.train_set, s.composer, batch_size=bs, seed=0, rank=0, world=1, buffer=8)
    return s, gen


def step(s: T.Setup, b) -> dict:
    """One forward/backward of ``train``'s loss; returns the parts and the gradients."""
    cfg = s.composer.cfg
    img, txt, obj, attr = s.model(b.pixels, b.input_ids, b.attention_mask)
    s.model.zero_grad(set_to_none=True)
    loss, parts = T.loss_fn(cfg, s.model, b, img, txt, obj, attr)
    loss.backward()
    grads = {n: p.grad for n, p in s.model.named_parameters() if p.grad is not None}
    return {"parts": parts, "grads": grads}


def mined_positive(b, n: int) -> bool:
    """Whether the batch's M holds an image-text positive that is not the row's own caption."""
    own = b.text_owner[None, :] == torch.arange(n)[:, None]
    return bool((b.pos_mask[:n] & ~own).any())


def first_batch(gen, holds, tries: int = 12):
    """The first batch of the stream that ``holds``: mined positives meet in a batch only when
    both rows are drawn into it, which the first batch of a shuffled stream need not do."""
    for _ in range(tries):
        _, _, b = next(gen)
        if holds(b):
            return b
    raise AssertionError(f"no batch of the first {tries} held what the test needs")


def nonzero(grads: dict, prefix: str) -> bool:
    return any(n.startswith(prefix) and bool(g.abs().sum() > 0) for n, g in grads.items())


def test_demo_export_has_every_annotation(demo):
    s, _ = setup(demo, loss="mp_nce")
    assert len(s.train_set) >= 4, "the demo exports too few samples to build a batch"
    meta = s.shards.first_meta()
    for col in (A.hard_ids, A.positive_ids, A.positive_relations, A.recaptions, A.object_ids,
                A.attribute_ids):
        assert col in meta, col


def test_helip_hard_pairs_arrive_and_train(demo):
    s, gen = setup(demo, loss="helip", helip_seed_fraction=1.0)
    _, _, b = next(gen)
    assert b.n_hard_added > 0 and bool((b.hard_index >= 0).any())      # hard pairs in the batch
    out = step(s, b)
    assert out["parts"]["helip"] > 0 and out["parts"]["concepts"] > 0
    assert nonzero(out["grads"], "obj_head") and nonzero(out["grads"], "attr_head")
    assert nonzero(out["grads"], "clip.logit_scale")


def test_sigmoid_positives_recaptions_concepts_arrive_and_train(demo):
    s, gen = setup(demo, loss="sigmoid")
    b = first_batch(gen, lambda b: mined_positive(b, b.pixels.shape[0]))  # mined positives in M
    n = b.pixels.shape[0]
    assert b.input_ids.shape[0] > n                                    # recaptions are texts
    assert bool((b.obj_index >= 0).any()) and bool((b.attr_index >= 0).any())
    assert float(b.obj_value.sum()) > 0
    s.model.sig_bias.data.fill_(T.init_sigmoid_bias(s.composer.cfg, s.model, gen, "cpu"))
    out = step(s, b)
    assert out["parts"]["sigmoid"] > 0 and out["parts"]["concepts"] > 0
    for p in ("sig_bias", "sig_log_t", "obj_head", "attr_head"):
        assert nonzero(out["grads"], p), p


def test_mp_nce_positive_structure_and_domain_parameters(demo):
    s, gen = setup(demo, loss="mp_nce", mp_views=2)

    def mined(b) -> bool:                                              # image-text and i-i
        n = b.pixels.shape[0] // 2
        return mined_positive(b, n) and bool(
            (b.image_pos[:n, :n] & ~torch.eye(n, dtype=torch.bool)).any())
    b = first_batch(gen, mined)
    n = b.pixels.shape[0] // 2
    pos, domains = T.mp_positives(b)
    n_img = b.pixels.shape[0]
    tt = pos[n_img:, n_img:]
    # an image's caption and recaptions: one positive set (a near-duplicate twin the demo exports
    # anyway was flagged before recaption ran: it has its caption alone)
    recaptioned = [i for i in range(n) if int((b.text_owner == i).sum()) > 1]
    assert len(recaptioned) >= n // 2, "no recaption reached the batch"
    for i in range(n):
        mine = (b.text_owner == i).nonzero().flatten()
        assert bool(tt[mine][:, mine].all())
        assert bool(pos[i, n + i]) and bool(pos[n + i, i])             # its two views
        assert bool(pos[i, n_img + mine].all())                        # image - its texts
    out = step(s, b)
    assert out["parts"]["mp_nce"] > 0 and out["parts"]["concepts"] > 0
    for p in ("mp_log_scale", "mp_offset"):
        g = out["grads"][p]
        assert bool((g != 0).all()), (p, g)    # every domain combination: ii, it, tt
    assert nonzero(out["grads"], "obj_head") and nonzero(out["grads"], "attr_head")


def _groups_meet(b) -> bool:
    g = b.group_keys[: len(b.caption_col)]
    return len(set(g.tolist())) < len(g)


@pytest.mark.parametrize("loss", ["clip", "helip", "hn_nce", "sigmoid", "mp_nce"])
def test_no_two_rows_of_one_group_are_negatives(demo, loss):
    """On batches composed as ``vlcurate finetune`` composes them: two captions of one image
    are never each other's negatives (taken out of the sums, or positives), and a hard pair is
    never a row of the seed's own image."""
    s, gen = setup(demo, loss=loss, helip_seed_fraction=1.0)
    cfg, met = s.composer.cfg, 0
    for _ in range(6):
        _, _, b = next(gen)
        n = len(b.caption_col)
        neg = T.negatives(cfg, b)
        groups = b.group_keys
        if cfg.loss in ("clip", "helip", "hn_nce"):
            same = groups[:, None] == groups[None, :]
        else:
            same = groups[:, None] == groups[b.text_owner][None, :]
        assert not (neg & same).any()
        for i, h in enumerate(b.hard_index[:n].tolist()):
            assert all(groups[j] != groups[i] for j in h if j >= 0)
        met += _groups_meet(b)
        step(s, b)                      # the loss runs with the groups' masks
    assert met, "no batch held two rows of one image: the test would prove nothing"


def test_held_out_images_never_train(demo, tmp_path):
    """The held-out split is by image group; heldout.parquet lists exactly the held-out ids."""
    s, _ = setup(demo, eval_fraction=0.3)
    train_g = set(s.train_set.index.group_hash[s.train_set.rows].tolist())
    held_g = set(s.eval_set.index.group_hash[s.eval_set.rows].tolist())
    assert held_g and train_g and not held_g & train_g
    multi = [g for g in held_g | train_g
             if (s.shards.index.group_hash == g).sum() > 1]
    assert multi                         # the demo has images with several captions
    T.write_heldout(str(tmp_path), s.eval_set)
    ids = pq.read_table(tmp_path / T.HELDOUT).column("sample_id").to_pylist()
    assert sorted(ids) == sorted(s.eval_set.sample_ids()) and len(ids) == len(s.eval_set)


def test_the_default_policy_exports_no_row_without_its_concept_targets(demo):
    """The demo's policy keeps near-duplicate twins; the teacher runs beside dedup, so they
    carry concept targets like every other exported row."""
    from vlcurate.trainer.data import ShardSet
    _, shards, _ = resolve(demo)
    assert ShardSet(shards).missing() == {}


def test_kept_rows_without_concept_targets_stop_the_trainer(demo, tmp_path, capsys):
    """A policy that keeps rows CAT flagged (the teacher skipped them) exports them: the export
    counts them and ``vlcurate finetune`` refuses them (exit 2, the count and the setting)
    unless allowed. Only export recomputes: the policy is a re-export."""
    from vlcurate.pipeline.finetune import launch
    from vlcurate.trainer.data import ShardSet
    cfg = demo.replace(**{"export.drop": ["ingest.*", "lang.*", "hpm.*"],
                          "export.out_dir": str(tmp_path / "export"), "finetune.model": TINY,
                          "finetune.concept_weight": 0.5})
    run(cfg, executor="local", log=lambda _: None)
    _, shards, _ = resolve(cfg)
    missing = ShardSet(shards).missing()[A.object_ids]
    assert missing["rows"] > 0 and {w.split(".")[0] for w in missing["why"]} == {"cat"}
    assert launch(cfg) == 2
    err = capsys.readouterr().err
    assert f"{missing['rows']} kept rows lack {A.object_ids}" in err
    assert "finetune.allow_missing" in err
