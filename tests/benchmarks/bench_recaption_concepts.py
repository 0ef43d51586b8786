"""Concept heads and recaptioning on this machine:

* head training on ``--rows`` teacher feature rows (ViT-H/14 width 1280 by default, long-tailed
  1-3 concepts per row), ``--epochs`` epochs at the config's batch size (time per epoch; the
  default config trains 10), and top-k prediction rows/s;
* bytes per sample of the stored targets (top-10 objects + top-10 attributes, uint16 ids +
  float16 probabilities, Parquet zstd as the run dir writes them) against DiHT's 32.6 GB for
  438M samples (about 74 B/sample), and the same targets as int32 + float32;
* recaption images/s with a tiny random BLIP-2 on CPU (five beams). The real architecture
  (BLIP-2 OPT-2.7B at random init) needs a GPU: with ``--device cuda`` pass ``--real``.

    .venv/bin/python tests/benchmarks/bench_recaption_concepts.py [--rows 100000] [--epochs 1]
"""
from __future__ import annotations

import argparse
import io
import os
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# BLIP-2 OPT-2.7B's configuration (Salesforce/blip2-opt-2.7b config.json), for --real
OPT_2_7B = {"num_query_tokens": 32,
            "vision_config": {"hidden_size": 1408, "intermediate_size": 6144,
                              "num_hidden_layers": 39, "num_attention_heads": 16,
                              "image_size": 224, "patch_size": 14},
            "qformer_config": {"hidden_size": 768, "intermediate_size": 3072,
                               "num_hidden_layers": 12, "num_attention_heads": 12,
                               "encoder_hidden_size": 1408},
            "text_config": {"model_type": "opt", "hidden_size": 2560, "ffn_dim": 10240,
                            "num_hidden_layers": 32, "num_attention_heads": 32,
                            "word_embed_proj_dim": 2560, "max_position_embeddings": 2048}}


def features(n: int, d: int, n_obj: int, n_att: int, seed: int = 0):
    """Rows whose features carry their (Zipf-distributed) concepts, plus noise."""
    rng = np.random.default_rng(seed)
    out = []
    for n_c in (n_obj, n_att):
        p = 1.0 / np.arange(1, n_c + 1)
        p /= p.sum()
        labels = [sorted(set(rng.choice(n_c, size=rng.integers(1, 4), p=p).tolist()))
                  for _ in range(n)]
        out.append(labels)
    means_o = rng.normal(size=(n_obj, d)).astype(np.float32)
    means_a = rng.normal(size=(n_att, d)).astype(np.float32)
    x = rng.normal(size=(n, d)).astype(np.float32)
    for i in range(n):
        x[i] += means_o[out[0][i]].sum(0) + 0.5 * means_a[out[1][i]].sum(0)
    return x.astype(np.float16), out[0], out[1]


def bench_heads(a) -> tuple[list, dict]:
    from vlcurate.pipeline import config as C  # noqa: F401
    from vlcurate.stages.concepts.stage import ConceptsParams
    from vlcurate.stages.concepts import heads as H
    x, obj, att = features(a.rows, a.dim, a.objects, a.attributes)
    cfg = C.from_dict({"concepts": {"epochs": a.epochs}}).concepts
    rows, trained = [], {}
    for name, labels, n_c in (("objects", obj, a.objects), ("attributes", att, a.attributes)):
        t0 = time.perf_counter()
        trained[name] = H.train_head(x, labels, n_c, cfg, a.device)
        dt = (time.perf_counter() - t0) / a.epochs
        rows.append((f"train {name} head ({n_c} classes), s/epoch", f"{dt:.1f}"))
        default = ConceptsParams().epochs
        rows.append((f"  x {default} epochs (the default config), s", f"{dt * default:.0f}"))
    t0 = time.perf_counter()
    preds = {k: H.top_k(h, x, 10) for k, h in trained.items()}
    rows.append(("top-10 prediction, rows/s (both heads)",
                 f"{len(x) / (time.perf_counter() - t0):,.0f}"))
    return rows, preds


def bench_storage(preds: dict) -> list:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlcurate.schemas import F
    from vlcurate.schemas import concepts as S
    from vlcurate.stages.concepts.stage import _lists

    n = len(preds["objects"][0])
    ids = [f"{i:016x}" for i in np.random.default_rng(0).integers(0, 2 ** 63, n)]
    cols32 = {}
    full = {F.SAMPLE_ID.name: pa.array(ids)}
    for kind, (fi, fp) in (("objects", (S.CONCEPT_OBJECT_IDS, S.CONCEPT_OBJECT_PROBS)),
                           ("attributes", (S.CONCEPT_ATTRIBUTE_IDS, S.CONCEPT_ATTRIBUTE_PROBS))):
        i, p = preds[kind]
        full[fi.name], full[fp.name] = _lists(i, fi), _lists(p, fp)
        cols32[fi.name] = _lists(i, pa.field("i", pa.list_(pa.int32())))
        cols32[fp.name] = _lists(p, pa.field("p", pa.list_(pa.float32())))
    targets = pa.table({k: v for k, v in full.items() if k != F.SAMPLE_ID.name})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, t in (("targets only, uint16 + float16", targets),
                         ("targets only, int32 + float32", pa.table(cols32)),
                         ("targets + sample_id", pa.table(full))):
            path = Path(tmp) / "t.parquet"
            pq.write_table(t, path, compression="zstd")
            rows.append((f"stored bytes/sample: {label}", f"{path.stat().st_size / n:.1f}"))
    rows.append(("  in memory (Arrow), uint16 + float16", f"{targets.nbytes / n:.1f}"))
    rows.append(("  DiHT: 32.6 GB / 438M samples", f"{32.6e9 / 438_358_791:.1f}"))
    return rows


def bench_recaption(a) -> list:
    from PIL import Image

    from vlcurate.pipeline import config as C
    from vlcurate.stages.recaption import Captioner

    rng = np.random.default_rng(0)
    blobs = []
    for _ in range(a.images):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (224, 224, 3), np.uint8)).save(buf, "JPEG")
        blobs.append(buf.getvalue())
    specs = {"tiny BLIP-2 (64 wide, 2 layers)": C.ModelSpec(id="tiny", random_init=True,
                                                             device=a.device)}
    if a.real:
        specs["BLIP-2 OPT-2.7B arch, random"] = C.ModelSpec(
            id="Salesforce/blip2-opt-2.7b", random_init=True, device=a.device,
            options=C.FrozenMap(OPT_2_7B))
    rows = []
    for name, spec in specs.items():
        cfg = C.from_dict({"recaption": {"model": C.to_dict(spec), "batch_size": a.batch,
                                         "max_new_tokens": a.new_tokens}}).recaption
        cap = Captioner(cfg)
        cap.caption_bytes(blobs[:a.batch], a.batch)           # warm-up
        t0 = time.perf_counter()
        cap.caption_bytes(blobs, a.batch)
        rows.append((f"recaption {name}, {a.device}, images/s (5 beams, <= {a.new_tokens} tokens)",
                     f"{len(blobs) / (time.perf_counter() - t0):.1f}"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=1280)
    ap.add_argument("--objects", type=int, default=1000)
    ap.add_argument("--attributes", type=int, default=300)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--real", action="store_true", help="also the real BLIP-2 architecture")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = [("device", f"{a.device} ({torch.get_num_threads()} torch threads)"),
            ("feature rows x dim", f"{a.rows:,} x {a.dim}")]
    head_rows, preds = bench_heads(a)
    rows += head_rows + bench_storage(preds) + bench_recaption(a)
    if a.device == "cpu" and not a.real:
        rows.append(("recaption, real architecture at random init",
                     "needs a GPU: --device cuda --real"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
