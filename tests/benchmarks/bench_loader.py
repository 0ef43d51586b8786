"""Trainer loader throughput: a rank's reads per epoch, full stream vs. now (ranks read
disjoint slices through the memory-mapped index), then samples/s of the composed batches (decode, augment, tokenise,
HELIP random-access fetches, CLIP-C composites) over shards exported from real COCO photos.

    .venv/bin/python tests/benchmarks/bench_loader.py [--batches 20]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.paths import SHARED_DATA  # noqa: E402
DATA = SHARED_DATA / "coco_mini"


def old_stream(shards, rank: int, world: int):
    """The former stream (baseline), verbatim in what it reads: every rank reads and JSON-decodes
    every sample of every shard (WebDataset) and keeps every ``world``-th."""
    import json
    import webdataset as wds
    urls = [str(Path(shards.uri) / n) for n in shards.index.shards]
    per_rank = len(shards) // world
    for i, (key, jpg, txt, meta) in enumerate(
            wds.WebDataset(urls, shardshuffle=False, nodesplitter=lambda s: s)
            .to_tuple("__key__", "jpg", "txt", "json")):
        rec = (key, jpg, txt.decode("utf-8"), json.loads(meta))
        if i % world == rank and i // world < per_rank:
            yield rec


def stream_table(shards) -> None:
    """Read cost of one rank's epoch (no decode of images): samples read per rank and seconds."""
    print(f"\nstream only, one rank's epoch of {len(shards)} samples (reads, no image decode)\n")
    print(f"{'world':>6}{'before: read':>14}{'s':>8}{'after: read':>14}{'s':>8}")
    for world in (1, 2, 4):
        t0 = time.perf_counter()
        n_old = sum(1 for _ in old_stream(shards, 0, world))
        t_old = time.perf_counter() - t0
        t0 = time.perf_counter()
        n_new = sum(1 for _ in shards.stream(epoch=0, seed=0, rank=0, world=world))
        t_new = time.perf_counter() - t0
        print(f"{world:>6}{len(shards):>14}{t_old:>8.2f}{n_new:>14}{t_new:>8.2f}")
        assert n_old == n_new


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32)
    a = ap.parse_args()
    if not DATA.exists():
        print(f"skipped: {DATA} not found")
        return 0
    import pyarrow as pa

    from vlcurate.pipeline import config as C
    from vlcurate.pipeline.dag import Node
    from vlcurate.pipeline.runner import run
    from vlcurate.schemas import F, tables
    from vlcurate.stages.base import Stage
    from vlcurate.stages.export import ExportStage
    from vlcurate.trainer.compose import Composer, batches
    from vlcurate.trainer.data import A, ShardSet
    from vlcurate.stages.ids import IdsStage
    from vlcurate.stages.ingest import IngestStage
    from vlcurate.foundation.models import load_clip

    class Hard(Stage):  # every row gets 5 hard pairs (its neighbours), as the mining stage would
        name = "hard"
        inputs = {"ingest": (F.CAPTION,)}
        output = tables.stage_table(pa.field(A.hard_ids, pa.list_(pa.string())))

        def __call__(self, b):
            ids = b.column(F.SAMPLE_ID.name).to_pylist()
            return pa.table({F.SAMPLE_ID.name: ids,
                             A.hard_ids: [[ids[(i + d) % len(ids)] for d in range(1, 6)]
                                          for i in range(len(ids))],
                             F.REASONS.name: [[]] * len(ids),
                             F.REASON_DETAIL.name: [None] * len(ids)}, schema=self.output)

    tmp = Path(tempfile.mkdtemp(prefix="vlc-bench-loader-"))
    cfg = C.load(None, {"source.path": str(DATA), "source.key_column": "caption_id",
                        "run.run_dir": str(tmp), "run.progress": False,
                        "export.samples_per_shard": 200})
    run(cfg, dag=[Node(IngestStage), Node(IdsStage, after=("ingest",)), Node(Hard, after=("ids",)),
                  Node(ExportStage, after=("ingest", "ids", "hard"))], executor="local",
        log=lambda _: None)
    shards = ShardSet(tmp / "export" / "shards")
    clip = load_clip(C.ModelSpec(id="tiny", random_init=True, options=C.FrozenMap({"image_size": 224, "patch_size": 32})))
    stream_table(shards)
    print(f"\n{len(shards)} COCO pairs (640 px JPEGs), batch {a.batch_size}, 224 px crops, 1 process\n")
    print(f"{'composition':<34}{'samples/s':>10}{'images/batch':>14}")
    for name, ft in (("plain (clip)", {"loss": "clip"}),
                     ("HELIP seeds 50%, p=1 (helip)", {"loss": "helip"}),
                     ("CLIP-C 25% composites", {"loss": "clip", "clipc_fraction": 0.25}),
                     ("FFF texts + positives (sigmoid)", {"loss": "sigmoid"}),
                     ("UniCLIP 2 views (mp_nce)", {"loss": "mp_nce", "mp_views": 2}),
                     ("CLIP-C 100% composites", {"loss": "clip", "clipc_fraction": 1.0})):
        fc = C.from_dict({"finetune": ft}).finetune
        comp = Composer(fc, shards, clip.tokenizer, clip.image_size, clip.mean, clip.std)
        g = batches(shards, comp, batch_size=a.batch_size, seed=0, rank=0, world=1)
        next(g)
        t0 = time.perf_counter()
        n = imgs = 0
        for _ in range(a.batches):
            _, _, b = next(g)
            n += a.batch_size
            imgs += b.pixels.shape[0]
        dt = time.perf_counter() - t0
        print(f"{name:<34}{n / dt:>10.0f}{imgs / a.batches:>14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
