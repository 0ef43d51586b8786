"""The recaption stage on a tiny random BLIP-2 (OPT text model) whose tokenizer and image
processor are built here, offline, and saved as a model folder: the real loading path."""
from __future__ import annotations

import io

import pyarrow as pa
import pytest
from PIL import Image

from vlcurate.pipeline.runner import build_stage
from vlcurate.pipeline import config as C
from vlcurate.schemas import F
from vlcurate.schemas import recaption as R
from vlcurate.foundation import models
from vlcurate.stages.recaption import Captioner, RecaptionStage, degenerate

WORDS = ["a", "the", "dog", "cat", "on", "in", "red", "blue", "grass", "beach", "man", "woman",
         "with", "of", "photo", "picture", "sitting", "standing", "table", "street"]


def build_tiny_blip2(folder) -> None:
    """A tiny BLIP-2 + a word-level tokenizer (tokenizers library) + BlipImageProcessor."""
    import torch
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers import models as tm
    from transformers import (Blip2Config, Blip2ForConditionalGeneration, Blip2Processor,
                              BlipImageProcessor, PreTrainedTokenizerFast)

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + WORDS
                                        + [f"w{i}" for i in range(1000 - 4 - len(WORDS))])}
    tok = Tokenizer(tm.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.decoder = decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>")
    processor = Blip2Processor(BlipImageProcessor(size={"height": 32, "width": 32}), tokenizer,
                               num_query_tokens=8)
    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 2}
    cfg = Blip2Config(
        vision_config={**small, "image_size": 32, "patch_size": 8},
        qformer_config={**small, "encoder_hidden_size": 64},
        text_config={"model_type": "opt", "vocab_size": len(tokenizer), "hidden_size": 64,
                     "ffn_dim": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "word_embed_proj_dim": 64, "max_position_embeddings": 64,
                     "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        num_query_tokens=8, image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    Blip2ForConditionalGeneration(cfg).save_pretrained(folder)
    processor.save_pretrained(folder)


def jpeg(colour, size=(48, 40)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def blip2_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-blip2")
    build_tiny_blip2(folder)
    return folder


def cfg(folder, **rc) -> C.Config:
    return C.from_dict({"recaption": {"model": {"id": "tiny-blip2", "path": str(folder)},
                                      "max_new_tokens": 8, **rc}})


def batch(n=3) -> pa.Table:
    return pa.table({F.SAMPLE_ID.name: [f"id{i}" for i in range(n)],
                     F.IMAGE.name: [jpeg((60 * i, 120, 200 - 50 * i)) for i in range(n)]})


def test_five_score_ordered_beams_per_image_deterministically(blip2_dir):
    stage = build_stage(RecaptionStage, cfg(blip2_dir, batch_size=2))
    assert stage.captioner.loaded.source == str(blip2_dir) and not stage.captioner.loaded.random
    out = stage(batch())
    assert out.schema == R.RECAPTION
    caps = out.column(R.RECAPTIONS.name).to_pylist()
    scores = out.column(R.RECAPTION_SCORES.name).to_pylist()
    flags = out.column(R.RECAPTION_FLAGS.name).to_pylist()
    assert [len(c) for c in caps] == [5, 5, 5] and [len(s) for s in scores] == [5, 5, 5]
    assert all(s == sorted(s, reverse=True) for s in scores)
    assert all(isinstance(t, str) for c in caps for t in c)
    assert all(f is None or f in R.FLAGS for fl in flags for f in fl)
    assert out.column(R.RECAPTION_N_CLEAN.name).to_pylist() == \
        [sum(f is None for f in fl) for fl in flags]
    assert out.column(R.RECAPTION_RANDOM.name).to_pylist() == [False] * 3
    # deterministic, and independent of how images are batched
    again = build_stage(RecaptionStage, cfg(blip2_dir, batch_size=3))(batch())
    assert again.column(R.RECAPTIONS.name).equals(out.column(R.RECAPTIONS.name))
    flat = [x for s in again.column(R.RECAPTION_SCORES.name).to_pylist() for x in s]
    assert flat == pytest.approx([x for s in scores for x in s], abs=1e-4)


def test_beams_and_scores_are_transformers_beam_search(blip2_dir):
    """Same captions and scores as a direct ``generate`` call, prompt stripped, best first."""
    import torch
    cap = Captioner(cfg(blip2_dir, prompt="a photo of").recaption)
    img = Image.open(io.BytesIO(jpeg((200, 30, 30)))).convert("RGB")
    beams = cap.generate([img])[0]
    enc = cap.processor(images=[img], text=["a photo of"], return_tensors="pt")
    with torch.no_grad():
        ref = cap.model.generate(**enc, num_beams=5, num_return_sequences=5, max_new_tokens=8,
                                 do_sample=False, early_stopping=True, output_scores=True,
                                 return_dict_in_generate=True)
    texts = cap.tokenizer.batch_decode(ref.sequences[:, enc["input_ids"].shape[1]:],
                                       skip_special_tokens=True)
    order = sorted(range(5), key=lambda i: -float(ref.sequences_scores[i]))
    assert [b.text for b in beams] == [texts[i].strip() for i in order]
    want = [float(ref.sequences_scores[i]) for i in order]
    assert [b.score for b in beams] == pytest.approx(want)
    with_prompt = Captioner(cfg(blip2_dir, prompt="a photo of", prompt_in_caption=True).recaption)
    assert all(b.text.startswith("a photo of") for b in with_prompt.generate([img])[0])


def test_degenerate_captions_are_flagged_not_dropped(blip2_dir):
    assert degenerate("a dog on the beach", 3) is None
    assert degenerate("", 3) == R.FLAG_EMPTY and degenerate(" ... !", 3) == R.FLAG_EMPTY
    assert degenerate("a dog dog dog", 3) == R.FLAG_REPETITIVE
    assert degenerate("on the on the on the grass", 3) == R.FLAG_REPETITIVE
    assert degenerate("a a dog", 3) is None and degenerate("a a dog", 2) == R.FLAG_REPETITIVE
    cap = Captioner(cfg(blip2_dir).recaption)
    beams = cap._flag([("A dog", -1.0, True), ("a  dog", -1.5, True), ("", -2.0, True),
                       ("a cat on", -2.5, False), ("a cat", -3.0, True)])
    assert [b.flag for b in beams] == [None, R.FLAG_DUPLICATE, R.FLAG_EMPTY, R.FLAG_TRUNCATED, None]
    assert [b.text for b in beams] == ["A dog", "a  dog", "", "a cat on", "a cat"]   # all kept


def test_random_init_builds_offline_and_says_so():
    spec = C.ModelSpec(id="Salesforce/blip2-opt-2.7b", random_init=True)
    c = C.from_dict({"recaption": {"model": C.to_dict(spec), "max_new_tokens": 5}})
    out = build_stage(RecaptionStage, c)(batch(2))
    assert out.column(R.RECAPTION_RANDOM.name).to_pylist() == [True, True]
    assert [len(x) for x in out.column(R.RECAPTIONS.name).to_pylist()] == [5, 5]
    assert RecaptionStage.notes(c) and "RANDOM" in RecaptionStage.notes(c)[0]
    a, b = models.load_blip2(spec), models.load_blip2(spec)     # every actor: the same weights
    assert all((x == y).all() for x, y in zip(a.model.state_dict().values(),
                                              b.model.state_dict().values(), strict=True))


def test_missing_weights_error_names_what_to_provide(tmp_path):
    with pytest.raises(models.ModelNotFound) as e:
        models.load_blip2(C.ModelSpec(id="Salesforce/blip2-opt-2.7b"))
    msg = str(e.value)
    for needle in ("Salesforce/blip2-opt-2.7b", "`path`", "huggingface-cli download",
                   "allow_download", "random_init"):
        assert needle in msg
    with pytest.raises(models.ModelNotFound, match="does not exist"):
        models.load_blip2(C.ModelSpec(id="x", path=str(tmp_path / "nope")))
    with pytest.raises(models.ModelNotFound, match="not a BLIP-2 folder"):
        models.load_blip2(C.ModelSpec(id="x", path=str(tmp_path)))


def test_each_distinct_image_is_captioned_once(blip2_dir):
    """Rows that show the same image (five captions per COCO image) share one BLIP-2 pass."""
    stage = build_stage(RecaptionStage, cfg(blip2_dir, batch_size=8))
    seen: list[int] = []
    generate = stage.captioner.generate
    stage.captioner.generate = lambda ims: (seen.append(len(ims)), generate(ims))[1]
    a, b = jpeg((10, 120, 200)), jpeg((200, 30, 40))
    t = pa.table({F.SAMPLE_ID.name: [f"id{i}" for i in range(5)], F.IMAGE.name: [a, b, a, a, b]})
    out = stage(t).column(R.RECAPTIONS.name).to_pylist()
    assert seen == [2]
    assert out[0] == out[2] == out[3] and out[1] == out[4]
    alone = build_stage(RecaptionStage, cfg(blip2_dir, batch_size=8))(t.slice(0, 2))
    assert alone.column(R.RECAPTIONS.name).to_pylist() == out[:2]
