"""Text spotting: rapidocr's cascade (``textspot.mode=cascade``) and fast path (``mode=fast``)
against the full OCR (``mode=full``), images per CPU-second and the agreement of DiHT's
decision (``cat.text_spotted``) per (image, caption) row, on the real sets in
``../shared/data``.

    .venv/bin/python tests/benchmarks/bench_textspot.py [--limit 200] [--rounds 2]
        [--sets coco_mini,flickr8k_224,grocery_packages,ocr_scene_text]
        [--det-pixels N[:GATE][,...]] [--cascade SCALE[:tight][,...]]

Each ``--det-pixels`` value is one fast path (``textspot.mode=fast``; the default: the stage's
``textspot.det_pixels``; ``N:GATE`` adds ``textspot.gate_pixels``; ``''``: none), each
``--cascade`` value one cascade (``mode=cascade``) with its gate at that scale (the default: the
stage's), so that several settings are measured against the full OCR in one run. Printed: where
each cascade's CPU time goes (gate, det, cls, rec) and the share of images its gate passes, and
per path the images whose usable lines (confidence >= min_conf, >= min_chars characters) differ
from the full OCR's, whatever the caption. One process, one onnxruntime thread; the paths run
interleaved, a few images at a time, in rotating order, so that the load of the shared machine
falls on all alike (the load average is printed beside every figure). Images per CPU-second =
images / CPU seconds of this process. The scene-text photos have no captions: each is paired
with its annotated visible text. Every disagreement is listed (image, caption, the best line
each path read).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
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


def usable(spots: list, p: TextSpotParams) -> list:
    """The texts of the lines the rule can use: confident, at least min_chars characters."""
    return [s.text for s in spots or [] if s.conf >= p.min_conf
            and len(T.normalize(s.text)) >= p.min_chars]


def run_set(name: str, paths: dict, p: TextSpotParams, limit: int, rounds: int) -> dict:
    images, rows = load(name, limit)
    keys = list(images)
    cpu_s = {k: 0.0 for k in paths}
    spots: dict[str, dict] = {k: {} for k in paths}
    for r in range(rounds):
        for i in range(0, len(keys), CHUNK):
            chunk = keys[i:i + CHUNK]
            turn = (r + i // CHUNK) % len(paths)
            order = list(paths)[turn:] + list(paths)[:turn]
            for path in order:
                c0 = cpu()
                out, _ = T.spot_all(paths[path], [images[k] for k in chunk], p.max_side)
                cpu_s[path] += cpu() - c0
                spots[path].update(zip(chunk, out))
    n = len(keys) * rounds
    hit = {path: {(k, c): decision(spots[path][k] or [], c, p) for k, c in rows} for path in paths}
    out = {}
    for path in paths:
        dis = [(k, c, hit["full"][(k, c)], hit[path][(k, c)]) for k, c in rows
               if T.text_spotted(hit["full"][(k, c)], p.min_chars)
               != T.text_spotted(hit[path][(k, c)], p.min_chars)]
        out[path] = {"rate": n / cpu_s[path], "dis": dis, "spent": dict(paths[path].spent or {}),
                     "lines": sum(usable(spots[path][k], p) != usable(spots["full"][k], p)
                                  for k in keys),
                     "flags": sum(T.text_spotted(m, p.min_chars) for m in hit[path].values())}
        if paths[path].spent is not None:
            paths[path].spent.clear()
    return {"set": name, "images": len(keys), "rows": len(rows), "load": os.getloadavg()[0],
            "paths": out}


def report(r: dict) -> None:
    full = r["paths"]["full"]
    for path, x in r["paths"].items():
        if path == "full":
            continue
        print(f"{r['set']} {path}: {r['images']} images, {r['rows']} rows: full "
              f"{full['rate']:.2f}, this path {x['rate']:.2f} images/CPU-s "
              f"({x['rate'] / full['rate']:.1f}x); flagged rows full {full['flags']}, this path "
              f"{x['flags']}; agreement {1 - len(x['dis']) / r['rows']:.2%}; images whose "
              f"usable lines differ {x['lines']}; load "
              f"{os.getloadavg()}", flush=True)
        if x["spent"]:
            print(f"    {split(x['spent'])}")
        for k, c, m_full, m_fast in x["dis"]:
            print(f"    {k} {c!r}: full read {m_full.text!r} ({m_full.chars} chars, conf "
                  f"{m_full.conf}), this path read {m_fast.text!r} ({m_fast.chars} chars)")


def split(spent: dict) -> str:
    """Where a cascade's CPU time went, per image, and its gate's pass rate."""
    n = spent.get("images", 0) or 1
    steps = ", ".join(f"{k} {1000 * spent.get(k, 0.0) / n:.1f}" for k in ("gate", "det", "cls",
                                                                            "rec"))
    return f"ms per image: {steps}; gate passed {spent.get('passed', 0) / n:.1%} of images"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=200, help="images per set (0: all)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--det-pixels", default=str(TextSpotParams().det_pixels),
                    help="comma-separated detector sizes (N or N:GATE), one fast path each")
    ap.add_argument("--cascade", default=str(T.Cascade().gate_scale),
                    help="comma-separated gate scales (SCALE or SCALE:tight, each crop "
                    "recognised at its own width), one cascade each ('': none)")
    a = ap.parse_args()
    p = TextSpotParams()
    paths = {"full": T.RapidOcrBackend(threads=1)}
    for spec in filter(None, a.det_pixels.split(",")):
        px, _, gate = spec.partition(":")
        fast = T.fast_path(TextSpotParams(mode="fast", det_pixels=int(px),
                                          gate_pixels=int(gate or 0)))
        paths[f"fast@{spec}"] = T.RapidOcrBackend(threads=1, fast=fast)
    for spec in filter(None, a.cascade.split(",")):
        scale, _, tight = spec.partition(":")
        cascade = dataclasses.replace(T.fast_path(TextSpotParams(mode="cascade")),
                                      gate_scale=float(scale), tight=tight == "tight")
        paths[f"cascade@{spec}"] = T.RapidOcrBackend(threads=1, fast=cascade)
        paths[f"cascade@{spec}"].spent = {}
    print(f"fast paths: {list(paths)[1:]}; load average {os.getloadavg()}", flush=True)
    res = []
    for name in a.sets.split(","):
        res.append(run_set(name, paths, p, a.limit, a.rounds))
        report(res[-1])
    print("\n| set | images (rows) | path | full OCR img/CPU-s | path img/CPU-s | speed-up | "
          "flagged full / path | agreement | disagreements | load avg |\n" + "|---" * 10 + "|")
    for r in res:
        full = r["paths"]["full"]
        for path, x in r["paths"].items():
            if path != "full":
                print(f"| {r['set']} | {r['images']} ({r['rows']}) | {path} | {full['rate']:.2f} "
                      f"| {x['rate']:.2f} | {x['rate'] / full['rate']:.1f}x | {full['flags']} / "
                      f"{x['flags']} | {1 - len(x['dis']) / r['rows']:.2%} | {len(x['dis'])} | "
                      f"{r['load']:.1f} |")


if __name__ == "__main__":
    main()
