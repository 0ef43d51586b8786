"""Seams between the pipeline and the trainer (issue 12), on a real ``vlcurate demo`` export.

The whole default DAG runs on the demo dataset (local executor); then batches are built the way
``vlcurate finetune`` builds them (``pipeline.finetune.resolve`` for the shards, then
``train.prepare`` and ``compose.batches``). Each annotation must arrive non-empty in a batch, and
each configured loss term must be non-zero with a non-zero gradient on its own parameters.
"""
from __future__ import annotations

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


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> C.Config:
    root = tmp_path_factory.mktemp("seams")
    data = make_demo(root / "data", n=40)
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
    _, _, b = next(gen)
    n = b.pixels.shape[0]
    assert b.input_ids.shape[0] > n                                    # recaptions are texts
    own = b.text_owner[None, :] == torch.arange(n)[:, None]
    assert bool((b.pos_mask & ~own).any())                             # mined positives in M
    assert bool((b.obj_index >= 0).any()) and bool((b.attr_index >= 0).any())
    assert float(b.obj_value.sum()) > 0
    s.model.sig_bias.data.fill_(T.init_sigmoid_bias(s.composer.cfg, s.model, gen, "cpu"))
    out = step(s, b)
    assert out["parts"]["sigmoid"] > 0 and out["parts"]["concepts"] > 0
    for p in ("sig_bias", "sig_log_t", "obj_head", "attr_head"):
        assert nonzero(out["grads"], p), p


def test_mp_nce_positive_structure_and_domain_parameters(demo):
    s, gen = setup(demo, loss="mp_nce", mp_views=2)
    _, _, b = next(gen)
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
    own = b.text_owner[None, :] == torch.arange(n)[:, None]
    assert bool((b.pos_mask[:n] & ~own).any())                         # mined image-text
    assert bool((b.image_pos[:n, :n] & ~torch.eye(n, dtype=torch.bool)).any())   # mined i-i
    out = step(s, b)
    assert out["parts"]["mp_nce"] > 0 and out["parts"]["concepts"] > 0
    for p in ("mp_log_scale", "mp_offset"):
        g = out["grads"][p]
        assert bool((g != 0).all()), (p, g)    # every domain combination: ii, it, tt
    assert nonzero(out["grads"], "obj_head") and nonzero(out["grads"], "attr_head")
