"""Image groups on real COCO (five captions per image): the README's small offline config over
``../shared/data/coco_mini``, in-process. Prints wall time, model calls per distinct image
(OCR, teacher, recaptioner: counted where each stage computes, ``stages.base.once_per_image``),
the kept rows of multi-caption images that lack concept targets or recaptions, the shard bytes
(images, JSON, total), the trainer's read rate and what open_clip sees per ``export.layout``,
and (``--finetune``) whether the tiny fine-tune's heldout.parquet shares an image with training.

    .venv/bin/python tests/benchmarks/bench_groups.py [--out /tmp/vlc-groups] [--finetune]
                                                      [--report-only]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.paths import SHARED_DATA  # noqa: E402

DATA = SHARED_DATA / "coco_mini"
COCO = {"source.path": str(DATA), "source.key_column": "caption_id",
        "source.extra_columns": ["coco_split"], "run.progress": False}


def counting() -> Counter:
    """Wrap once_per_image where the stages imported it: images computed per stage class (on
    the baseline, which has no counter of its own)."""
    from vlcurate.stages import base
    if hasattr(base, "COMPUTED"):
        return base.COMPUTED
    calls: Counter = Counter()
    inner = base.once_per_image

    def wrapped(images, compute, *a, **k):
        name = compute.__qualname__.split(".")[0]

        def counted(todo):
            calls[name] += len(todo)
            return compute(todo)
        return inner(images, counted, *a, **k)
    import importlib
    for mod in ("vlcurate.stages.cat.textspot_stage", "vlcurate.stages.concepts.teacher_stage",
                "vlcurate.stages.recaption.stage"):
        importlib.import_module(mod).once_per_image = wrapped
    return calls


def shard_bytes(shards: Path) -> dict:
    out: Counter = Counter()
    for tar in sorted(shards.rglob("*.tar")):
        out["total"] += tar.stat().st_size
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                ext = m.name.rsplit(".", 1)[-1]
                out["image" if ext in ("jpg", "jpeg", "png", "webp") else ext] += m.size
    return dict(out)


def layouts(cfg, run_dir: Path, names: list[str]) -> None:
    """Re-export in each layout; bytes, the trainer's read rate, what open_clip sees."""
    from vlcurate.pipeline.runner import run
    from vlcurate.trainer.data import ShardSet
    for layout in names:
        out = run_dir.parent / f"export-{layout}"
        run(cfg.replace(**{"export.layout": layout, "export.out_dir": str(out)}),
            executor="local", log=lambda _: None, only={"export"})
        shards = ShardSet(out / "shards")
        b = shard_bytes(out / "shards")
        ix = shards.index
        distinct = {}
        for g, size in zip(ix.group_hash.tolist(), ix.num["jpg_size"].tolist()):
            distinct[g] = size
        kept_images = sum(distinct.values())
        t0 = time.perf_counter()
        for row in range(len(shards)):
            shards.sample(row)
        rate = len(shards) / (time.perf_counter() - t0)
        samples = json.loads((out / "shards" / "manifest.json").read_text())["samples"]
        print(f"  layout {layout}: {samples} tar samples for {len(shards)} rows; total "
              f"{b['total'] / 1e6:.1f} MB = {b['total'] / kept_images:.2f}x the distinct kept "
              f"images ({kept_images / 1e6:.1f} MB); jpg {b['image'] / 1e6:.1f} MB, json "
              f"{b['json'] / 1e6:.2f} MB ({100 * b['json'] / kept_images:.1f}% of the distinct "
              f"images, {100 * b['json'] / b['image']:.1f}% of the jpg members), txt "
              f"{b['txt'] / 1e3:.0f} kB; trainer reads {rate:.0f} rows/s (load "
              f"{os.getloadavg()[0]:.2f}); open_clip sees {samples} (jpg, txt) pairs")


def heldout(cfg, run_dir: Path, out: Path) -> None:
    """The tiny fine-tune: its heldout.parquet shares no image with the training rows."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq
    from vlcurate.pipeline.finetune import launch
    from vlcurate.schemas import F
    c = cfg.replace(**{"finetune.model": {"id": "tiny", "random_init": True},
                       "finetune.steps": 4, "finetune.batch_size": 16, "finetune.progress": False,
                       "finetune.eval_fraction": 0.1, "finetune.out_dir": str(out)})
    assert launch(c, nproc=1) == 0
    held = set(pq.read_table(out / "heldout.parquet").column(F.SAMPLE_ID.name).to_pylist())
    t = ds.dataset(run_dir / "export" / "data", format="parquet").to_table(
        columns=[F.SAMPLE_ID.name, F.IMAGE_GROUP.name, F.KEEP.name]).to_pylist()
    kept = [r for r in t if r[F.KEEP.name]]
    h = {r[F.IMAGE_GROUP.name] for r in kept if r[F.SAMPLE_ID.name] in held}
    tr = {r[F.IMAGE_GROUP.name] for r in kept if r[F.SAMPLE_ID.name] not in held}
    print(f"  finetune: {len(held)} held-out rows of {len(h)} images; {len(tr)} training "
          f"images; shared: {len(h & tr)}")


def coverage(export_dir: Path) -> dict:
    import pyarrow.dataset as ds
    from vlcurate.schemas import F
    t = ds.dataset(export_dir / "data", format="parquet").to_table().to_pandas()
    if F.IMAGE_HASH.name not in t:      # export reads ingest's hash only where it is annotated
        ing = ds.dataset(export_dir.parent / "ingest" / "data", format="parquet").to_table(
            columns=[F.SAMPLE_ID.name, F.IMAGE_HASH.name]).to_pandas()
        t = t.merge(ing, on=F.SAMPLE_ID.name)
    kept = t[t[F.KEEP.name]]
    multi = kept[kept.groupby(F.IMAGE_HASH.name)[F.SAMPLE_ID.name].transform("count") > 1] \
        if F.IMAGE_HASH.name in kept else kept
    out = {"rows": len(t), "kept": len(kept), "kept_multi": len(multi),
           "distinct_kept_images": int(kept[F.IMAGE_HASH.name].nunique())}
    for col in ("concept_object_ids", "recaptions"):
        if col in multi:
            out[f"kept_multi_without_{col}"] = int(multi[col].isna().sum())
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/vlc-groups")
    ap.add_argument("--layouts", default="image,pair")
    ap.add_argument("--tag", default="")
    ap.add_argument("--report-only", action="store_true", help="figures of a finished run")
    ap.add_argument("--finetune", action="store_true", help="a tiny fine-tune: heldout check")
    ap.add_argument("--skip-ocr", action="store_true",
                    help="run every stage but textspot (OCR: the same code before and after)")
    a = ap.parse_args()
    if not DATA.exists():
        print(f"skipped: {DATA} not found")
        return 0
    from vlcurate.pipeline import config as C
    from vlcurate.pipeline.runner import run
    run_dir = Path(a.out) / "run"
    sets = {**COCO, "run.run_dir": str(run_dir), "run.image_cache": False}
    if a.skip_ocr:
        sets["run.stages"] = ["ids", "lang", "cat", "embed", "hpm", "recaption",
                              "recaption_embed", "positives", "dedup", "teacher", "concepts"]
    cfg = C.load(str(ROOT / "pipeline/configs/small.yaml"), sets)
    images = len(list((DATA / "images").glob("*.jpg")))
    if a.report_only:
        print("  coverage", json.dumps(coverage(run_dir / "export")))
        layouts(cfg, run_dir, a.layouts.split(",") if a.layouts else [])
        if a.finetune:
            heldout(cfg, run_dir, Path(a.out) / "finetune")
        return 0
    calls = counting()
    t0 = time.perf_counter()
    run(cfg, executor="local", log=lambda _: None)
    wall = time.perf_counter() - t0
    print(f"{a.tag} wall {wall:.1f} s (load {os.getloadavg()[0]:.2f}); {images} images")
    for name, n in sorted(calls.items()):
        print(f"  {name}: {n} images computed, {n / images:.2f} per distinct image")
    exp = run_dir / "export"
    print("  coverage", json.dumps(coverage(exp)))
    print("  shards (default layout)", json.dumps(shard_bytes(exp / "shards")))
    layouts(cfg, run_dir, a.layouts.split(",") if a.layouts else [])
    if a.finetune:
        heldout(cfg, run_dir, Path(a.out) / "finetune")
    return 0


if __name__ == "__main__":
    sys.exit(main())
