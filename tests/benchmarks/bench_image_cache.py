"""The per-image cache (run.cache_dir) on COCO, five captions per image: a first run of
ingest -> ids -> lang -> cat -> textspot -> export, then a rerun after a CAT change
(cat.require_action: false keeps more captions, so textspot reruns), with the cache and
without, stage times side by side. Real OCR (rapidocr), real spaCy parse. One process, local
executor; the two arms are interleaved.

    .venv/bin/python tests/benchmarks/bench_image_cache.py [--images 40]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.paths import REPO, SHARED_DATA  # noqa: E402

STAGES = ["ingest", "ids", "lang", "cat", "textspot", "export"]


def runs(tmp: Path, images: int, cache: bool) -> list[dict]:
    from vlcurate.pipeline import config as C
    from vlcurate.pipeline.runner import run
    from vlcurate.schemas import F
    over = {"source.path": str(SHARED_DATA / "coco_mini"), "source.limit": 5 * images,
            "run.run_dir": str(tmp / f"run-{cache}"), "run.image_cache": cache,
            "run.stages": STAGES[1:-1], "run.progress": False, "export.drop": []}
    cfg = C.load(REPO / "pipeline" / "configs" / "coco.yaml", over)
    out = []
    for label, c in (("first run", cfg), ("after a CAT change", cfg.replace(
            **{"cat.require_action": False}))):
        res = {r.manifest["stage"]: r for r in run(c, executor="local", log=lambda _: None)}
        out.append({"label": label, **{s: (res[s].manifest[F.MK.WALL_S], res[s].status)
                                       for s in STAGES if s in res},
                    "textspot rows": res["textspot"].manifest[F.MK.ROWS_IN]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=40)
    a = ap.parse_args()
    if not (SHARED_DATA / "coco_mini").exists():
        sys.exit(f"no real data at {SHARED_DATA / 'coco_mini'}")
    with tempfile.TemporaryDirectory() as tmp:
        with_cache = runs(Path(tmp), a.images, True)
        without = runs(Path(tmp), a.images, False)
    print(f"load average {os.getloadavg()[0]:.1f} (1 min); COCO, {a.images} images x 5 captions")
    print(f"{'':34s}" + "".join(f"{s:>10s}" for s in STAGES) + f"{'OCR rows':>10s}")
    for name, arm in (("cache", with_cache), ("no cache", without)):
        for r in arm:
            cells = "".join(f"{r[s][0]:9.1f}s" if r.get(s) and r[s][1] != "skipped" else
                            f"{'skip':>10s}" for s in STAGES)
            print(f"{name + ', ' + r['label']:34s}{cells}{r['textspot rows']:10d}")
    t_cache, t_none = with_cache[1]["textspot"][0], without[1]["textspot"][0]
    print(f"textspot rerun: {t_none:.1f} s without the cache, {t_cache:.1f} s with it "
          f"({t_none / max(t_cache, 1e-9):.1f}x)")


if __name__ == "__main__":
    main()
