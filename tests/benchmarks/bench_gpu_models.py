"""The pipeline's models at their real architectures, through the project's own loaders and
encoders: images/s, captions/s and recaptioned images/s on one device (a GPU: ``--device cuda``).

    python tests/benchmarks/bench_gpu_models.py --device cuda [--only image text teacher blip2]

Weights are random (``random_init``: no model hub here); speed depends on the architecture, not
the weights. BLIP-2's random OPT never emits its end token, so every beam decodes
``max_new_tokens`` (30): an upper bound on real captions, which stop earlier. "model" rates feed
pre-made tensors (what a GPU can do when decoding keeps up); "with decode" runs the stage's
own path on JPEGs from ``--images`` (default: Flickr8k 224 px in ../shared/data), decoded on the
calling thread. deploy/SIZING.md takes its GPU rates from this benchmark.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.paths import SHARED_DATA  # noqa: E402

OPT_27B = {"num_query_tokens": 32,
           "vision_config": {"hidden_size": 1408, "intermediate_size": 6144, "num_hidden_layers": 39,
                             "num_attention_heads": 16, "image_size": 224, "patch_size": 14},
           "qformer_config": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                              "num_attention_heads": 12, "encoder_hidden_size": 1408},
           "text_config": {"model_type": "opt", "hidden_size": 2560, "ffn_dim": 10240,
                           "num_hidden_layers": 32, "num_attention_heads": 32,
                           "word_embed_proj_dim": 2560, "max_position_embeddings": 2048}}
TEXT = {"all-MiniLM-L6-v2 (384 d, 6 layers)": {"hidden_size": 384, "num_hidden_layers": 6,
                                               "num_attention_heads": 12, "intermediate_size": 1536},
        "all-mpnet-base-v2 size (768 d, 12 layers)": {"hidden_size": 768, "num_hidden_layers": 12,
                                                      "num_attention_heads": 12,
                                                      "intermediate_size": 3072}}


def rate(fn, n: int, device: str, repeat: int = 3) -> float:
    """Items per second, the best of ``repeat`` timed calls after one warm-up call."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return n / best


def spec(model_id: str, device: str, options: dict | None = None):
    from vlcurate.pipeline import config as C
    return C.ModelSpec(id=model_id, random_init=True, device=device,
                       options=C.FrozenMap(options or {}))


def line(name: str, batch: int, value: float, unit: str) -> None:
    print(f"{name:<44}{batch:>7}{value:>12.0f}  {unit}", flush=True)


def image(a, blobs) -> None:
    from vlcurate.stages.embed import ImageEncoder
    enc = ImageEncoder(spec("vit_small_patch8_224.dino", a.device))
    px = np.random.default_rng(0).random((a.n, 3, 224, 224), np.float32)
    for bs in sorted({min(b, a.n) for b in (128, 512)}):
        line("embed: DINO ViT-S/8, model", bs, rate(lambda: enc.encode_preprocessed(px, bs), a.n,
                                                    a.device), "img/s")
    if blobs:
        n = len(blobs)
        for threads in (0, 8):
            line(f"embed: DINO ViT-S/8, with decode ({threads} threads)", 256,
                 rate(lambda: enc.encode(blobs, 256, threads=threads), n, a.device, 2), "img/s")


def text(a) -> None:
    from vlcurate.stages.embed import TextEncoder
    words = "a man woman dog cat red blue street sits on the with two of in near beach car".split()
    rng = np.random.default_rng(0)
    caps = [" ".join(rng.choice(words, 12)) for _ in range(8 * a.n)]
    for name, opts in TEXT.items():
        enc = TextEncoder(spec(f"random-bert {name}", a.device, opts))
        line(f"embed: {name}", 256, rate(lambda: enc.encode(caps, 256), len(caps), a.device),
             "captions/s")


def teacher(a, blobs) -> None:
    from vlcurate.stages.concepts.teacher import Teacher
    t = Teacher(spec("torchvision/vit_h_14", a.device, {"weights": "IMAGENET1K_SWAG_LINEAR_V1"}))
    amp = contextlib.nullcontext() if t.loaded.dtype == torch.float32 else \
        torch.autocast(device_type="cuda" if a.device.startswith("cuda") else "cpu",
                       dtype=t.loaded.dtype)
    for bs in sorted({min(b, a.n) for b in (64, 256)}):
        x = torch.randn(bs, 3, 224, 224, device=a.device)

        def run() -> None:
            with torch.inference_mode(), amp:
                for _ in range(max(1, a.n // bs)):
                    t._features(x).float().cpu()
        line("teacher: SWAG ViT-H/14 224 px, model", bs, rate(run, max(1, a.n // bs) * bs,
                                                                a.device), "img/s")
    for threads in (0, 8) if blobs else ():
        line(f"teacher: with decode ({threads} threads)", 64,
             rate(lambda: t.encode(blobs, 64, threads), len(blobs), a.device, 2), "img/s")


def blip2(a, blobs) -> None:
    from PIL import Image
    from vlcurate.pipeline import config as C
    from vlcurate.stages.recaption.captioner import Captioner
    t = time.time()
    cfg = C.from_dict({"recaption": {"model": C.to_dict(spec("blip2-opt-2.7b", a.device, OPT_27B))}})
    cap = Captioner(cfg.recaption)
    params = sum(p.numel() for p in cap.model.parameters()) / 1e9
    print(f"BLIP-2 OPT-2.7B architecture: {params:.2f} B parameters, {cap.model.dtype}, built in "
          f"{time.time() - t:.0f}s; {cfg.recaption.num_beams} beams, max_new_tokens "
          f"{cfg.recaption.max_new_tokens}", flush=True)
    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((224, 224, 3)) * 255).astype(np.uint8)) for _ in range(64)]
    for bs in sorted({min(b, a.n) for b in (16, 64)}):
        line("recaption: BLIP-2 OPT-2.7B, 5 beams x 30 tokens", bs,
             rate(lambda: cap.generate(images[:bs]), bs, a.device, 1), "img/s")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=1024, help="images (and 8x captions) per timed call")
    ap.add_argument("--images", type=Path, default=SHARED_DATA / "flickr8k_224" / "images")
    ap.add_argument("--only", nargs="+", default=["image", "text", "teacher", "blip2"])
    a = ap.parse_args()
    blobs = [f.read_bytes() for f in sorted(a.images.glob("*.jpg"))[:512]] if a.images.exists() \
        else []
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else "none"
    print(f"device {a.device} (GPU: {gpu}); {os.cpu_count()} CPUs; torch {torch.__version__}; "
          f"{len(blobs)} JPEGs; load average {os.getloadavg()[0]:.1f}\n", flush=True)
    print(f"{'':<44}{'batch':>7}{'rate':>12}", flush=True)
    for name in a.only:
        t = time.time()
        fn = {"image": image, "text": text, "teacher": teacher, "blip2": blip2}[name]
        fn(a) if name == "text" else fn(a, blobs)
        print(f"  ({name}: {time.time() - t:.0f}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
