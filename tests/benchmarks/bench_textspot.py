"""Text spotting: rapidocr's fast path (``textspot.mode=fast``) against the full OCR
(``mode=full``), images per CPU-second and the agreement of DiHT's decision (``cat.text_spotted``)
per (image, caption) row, on the real sets in ``../shared/data``.

    .venv/bin/python tests/benchmarks/bench_textspot.py [--limit 200] [--rounds 2]
        [--sets coco_mini,flickr8k_224,grocery_packages,ocr_scene_text] [--det-pixels N]

One process, one onnxruntime thread; the two paths run interleaved, a few images at a time, in
alternating order, so that the load of the shared machine falls on both alike (the load average is
printed beside every figure). Images per CPU-second = images / CPU seconds of this process. The
scene-text photos have no captions: each is paired with its annotated visible text. Every
disagreement is listed (image, caption, the best line each path read).
"""
from __future__ import annotations

import argparse
import csv
import os
import random
import resource
import sys
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.paths import SHARED_DATA as DATA  # noqa: E402
from vlcurate.stages.cat import textspot as T  # noqa: E402
from vlcurate.stages.cat.textspot_stage import TextSpotParams  # noqa: E402

SETS = ("coco_mini", "flickr8k_224", "grocery_packages", "ocr_scene_text")
CHUNK = 8


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def load(name: str, limit: int) -> tuple[dict[str, bytes], list[tuple[str, str]]]:
    """A seeded sample of the set's images and every (image, caption) row that shows one."""
    folder = DATA / name
    if name == "ocr_scene_text":
        with open(folder / "annotations.csv", encoding="utf-8") as fh:
            rows = [(r["image"], r["visible_text"] or "a photo") for r in csv.DictReader(fh)]
    else:
        with open(folder / "captions.csv", encoding="utf-8") as fh:
            rows = [(r["image"], r["caption"]) for r in csv.DictReader(fh)]
    keys = sorted({k for k, _ in rows})
    random.Random(0).shuffle(keys)
    keys = keys[:limit] if limit else keys
    images = {k: (folder / "images" / k).read_bytes() for k in keys}
    return images, [(k, c) for k, c in rows if k in images]


def decision(spots: list, caption: str, p: TextSpotParams) -> T.Match:
    """The stage's rule on one row: the best max_texts lines, the best match, its length."""
    return T.best_match(sorted(spots, key=lambda s: -s.conf)[:p.max_texts], caption, p.min_conf)


def run_set(name: str, paths: dict, p: TextSpotParams, limit: int, rounds: int) -> dict:
    images, rows = load(name, limit)
    keys = list(images)
    cpu_s = {k: 0.0 for k in paths}
    spots: dict[str, dict] = {k: {} for k in paths}
    for r in range(rounds):
        for i in range(0, len(keys), CHUNK):
            chunk = keys[i:i + CHUNK]
            order = list(paths) if (r + i // CHUNK) % 2 == 0 else list(paths)[::-1]
            for path in order:
                c0 = cpu()
                out, _ = T.spot_all(paths[path], [images[k] for k in chunk], p.max_side)
                cpu_s[path] += cpu() - c0
                spots[path].update(zip(chunk, out))
    n = len(keys) * rounds
    full, fast = ({(k, c): decision(spots[path][k] or [], c, p) for k, c in rows}
                  for path in ("full", "fast"))
    flags = {path: sum(T.text_spotted(m, p.min_chars) for m in d.values())
             for path, d in (("full", full), ("fast", fast))}
    hit = {path: {r: T.text_spotted(m, p.min_chars) for r, m in d.items()}
           for path, d in (("full", full), ("fast", fast))}
    dis = [(k, c, full[(k, c)], fast[(k, c)]) for k, c in rows
           if hit["full"][(k, c)] != hit["fast"][(k, c)]]
    return {"set": name, "images": len(keys), "rows": len(rows), "load": os.getloadavg()[0],
            "full": n / cpu_s["full"], "fast": n / cpu_s["fast"], "flags": flags, "dis": dis}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=200, help="images per set (0: all)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--det-pixels", type=int, default=TextSpotParams().det_pixels)
    a = ap.parse_args()
    p = TextSpotParams(det_pixels=a.det_pixels)
    paths = {"full": T.RapidOcrBackend(threads=1),
             "fast": T.RapidOcrBackend(threads=1, fast=T.fast_path(p))}
    print(f"fast path: {T.fast_path(p)}; load average {os.getloadavg()}", flush=True)
    res = []
    for name in a.sets.split(","):
        r = run_set(name, paths, p, a.limit, a.rounds)
        res.append(r)
        print(f"{name}: {r['images']} images, {r['rows']} rows: full {r['full']:.2f}, fast "
              f"{r['fast']:.2f} images/CPU-s ({r['fast'] / r['full']:.1f}x); flagged rows full "
              f"{r['flags']['full']}, fast {r['flags']['fast']}; agreement "
              f"{1 - len(r['dis']) / r['rows']:.2%}; load {os.getloadavg()}", flush=True)
        for k, c, m_full, m_fast in r["dis"]:
            print(f"    {k} {c!r}: full read {m_full.text!r} ({m_full.chars} chars, conf "
                  f"{m_full.conf}), fast read {m_fast.text!r} ({m_fast.chars} chars)")
    print("\n| set | images (rows) | full OCR img/CPU-s | fast img/CPU-s | speed-up | flagged "
          "full / fast | agreement | disagreements | load avg |\n" + "|---" * 9 + "|")
    for r in res:
        print(f"| {r['set']} | {r['images']} ({r['rows']}) | {r['full']:.2f} | {r['fast']:.2f} | "
              f"{r['fast'] / r['full']:.1f}x | {r['flags']['full']} / {r['flags']['fast']} | "
              f"{1 - len(r['dis']) / r['rows']:.2%} | {len(r['dis'])} | {r['load']:.1f} |")


if __name__ == "__main__":
    main()
