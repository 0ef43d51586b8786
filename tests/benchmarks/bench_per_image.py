"""Per-image work done once: text spotting over COCO rows (five captions per image), each row
OCRed (the old way) against each distinct image OCRed once (TextSpotStage today). Same output.

    .venv/bin/python tests/benchmarks/bench_per_image.py [--rows 60]
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.paths import SHARED_DATA  # noqa: E402


def rows(n: int) -> tuple[list[str], list[bytes]]:
    root = SHARED_DATA / "coco_mini"
    with open(root / "captions.csv", encoding="utf-8") as fh:
        recs = [r for _, r in zip(range(n), csv.DictReader(fh))]
    return [r["caption"] for r in recs], [(root / "images" / r["image"]).read_bytes() for r in recs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=60)
    a = ap.parse_args()
    import pyarrow as pa
    from vlcurate.pipeline.runner import build_stage
    from vlcurate.pipeline import config as C
    from vlcurate.schemas import F
    from vlcurate.stages.cat import textspot as T
    from vlcurate.stages.cat.textspot_stage import TextSpotStage
    caps, ims = rows(a.rows)
    from vlcurate.stages.ingest.stage import image_hash
    stage = build_stage(TextSpotStage, C.load(None, {"run.image_cache": False}))
    batch = pa.table({F.SAMPLE_ID.name: [str(i) for i in range(len(caps))], F.CAPTION.name: caps,
                      F.IMAGE.name: pa.array(ims, pa.binary()),
                      F.IMAGE_HASH.name: [image_hash(b) for b in ims]})
    t0 = time.perf_counter()
    per_row = T.spot_all(stage.ocr, ims, stage.config.textspot.max_side)
    t_row = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = stage(batch)
    t_once = time.perf_counter() - t0
    same = [None if s is None else [x.text for x in sorted(s, key=lambda x: -x.conf)[:32]]
            for s in per_row[0]] == out.column("ocr_texts").to_pylist()
    print(f"load average {os.getloadavg()[0]:.1f}; {len(caps)} COCO rows, {len(set(ims))} images")
    print(f"OCR every row:            {t_row:6.1f} s  ({len(caps) / t_row:.1f} rows/s)")
    print(f"OCR each image once:      {t_once:6.1f} s  ({len(caps) / t_once:.1f} rows/s)")
    print(f"speed-up {t_row / t_once:.2f}x; same OCR texts per row: {same}")


if __name__ == "__main__":
    main()
