"""Text spotting: rapidocr's cascade (``textspot.mode=cascade``), fast path (``mode=fast``) and
full OCR (``mode=full``), each on each runtime (``textspot.runtime``, ``textspot.precision``:
onnxruntime, OpenVINO f32, OpenVINO bf16, OpenVINO with the detector alone in bf16, OpenVINO f32 with the
detector's head as the model file has it: ``ov-f32-plain``), against
the full OCR on onnxruntime (rapidocr, all defaults): images per CPU-second and the agreement of
DiHT's decision (``cat.text_spotted``) per (image, caption) row, on the real sets in
``../shared/data``.

    .venv/bin/python tests/benchmarks/bench_textspot.py [--limit 200] [--rounds 2]
        [--sets coco_mini,flickr8k_224,grocery_packages,ocr_scene_text,mix]
        [--runtimes ort,ov-f32,ov-bf16,ov-det-bf16,ov-f32-plain] [--no-full]
        [--det-pixels N[:GATE][,...]] [--cascade SCALE[:tight][:PIXELS][:all][:bN][:nogate][,...]]

Each ``--det-pixels`` value is one fast path (``textspot.mode=fast``; the default: the stage's
``textspot.det_pixels``; ``N:GATE`` adds ``textspot.gate_pixels``; ``''``: none), each
``--cascade`` value one cascade (``mode=cascade``) with its gate at that scale (the default: the
stage's; ``all``: every crop read, ``textspot.stop_early`` off; ``bN``: N crops per recogniser
call), so that several settings are measured against the full OCR in one run. Printed: each path's
CPU ms per image in each model (det, cls, rec) and outside them; where each cascade's CPU time goes
(gate, det, cls, rec) and the share of images its gate passes, and per path the images whose usable
lines (confidence >= min_conf, >= min_chars characters) differ from the full OCR's, whatever the
caption. ``mix``: 216 photos of three sets, each with one caption (``--limit 0``). One process, one onnxruntime thread; the paths run interleaved, a few images at a time, in
rotating order, so that the load of the shared machine falls on all alike (the load average is
printed beside every figure). Images per CPU-second = images / CPU seconds of this process. The
scene-text photos have no captions: each is paired with its annotated visible text. Every
disagreement is listed (image, caption, the best line each path read).
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
from vlcurate.stages.cat import textspot_runtime as RT  # noqa: E402
from vlcurate.stages.cat.textspot_stage import TextSpotParams  # noqa: E402

SETS = ("coco_mini", "flickr8k_224", "grocery_packages", "ocr_scene_text")
REF = "full/ort"      # the reference: the full OCR (rapidocr, all defaults) on onnxruntime
CHUNK = 8


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def load(name: str, limit: int) -> tuple[dict[str, bytes], list[tuple[str, str]]]:
    """A seeded sample of the set's images and every (image, caption) row that shows one."""
    if name == "mix":
        return mix()
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


def mix() -> tuple[dict[str, bytes], list[tuple[str, str]]]:
    """The 216-photo mix: the first 120 COCO photos with their first caption, the first 80
    grocery packs with their product name, the 16 scene-text photos with their visible text."""
    images, rows = {}, []
    for name, n, col, table in (("coco_mini", 120, "caption", "captions.csv"),
                                ("grocery_packages", 80, "caption", "captions.csv"),
                                ("ocr_scene_text", 16, "visible_text", "annotations.csv")):
        with open(DATA / name / table, encoding="utf-8") as fh:
            first = {}
            for r in csv.DictReader(fh):
                first.setdefault(r["image"], r[col] or "a photo")
        for k, c in list(first.items())[:n]:
            images[f"{name}/{k}"] = (DATA / name / "images" / k).read_bytes()
            rows.append((f"{name}/{k}", c))
    return images, rows


def decision(spots: list, caption: str, p: TextSpotParams) -> T.Match:
    """The stage's rule on one row: the lines it sees (``T.seen_by``), the best max_texts of
    them, the best match, its length."""
    seen = T.seen_by(spots, caption, p.min_conf, p.min_chars, p.max_texts)
    return T.best_match(sorted(seen, key=lambda s: -s.conf)[:p.max_texts], caption, p.min_conf)


def usable(spots: list, p: TextSpotParams) -> list:
    """The texts of the lines the rule can use: confident, at least min_chars characters (sorted:
    the cascade reads the widest crops first)."""
    return sorted(s.text for s in spots or [] if s.conf >= p.min_conf
                  and len(T.normalize(s.text)) >= p.min_chars)


def run_set(name: str, paths: dict, p: TextSpotParams, limit: int, rounds: int) -> dict:
    images, rows = load(name, limit)
    keys = list(images)
    caps: dict[str, list] = {}
    for k, c in rows:
        caps.setdefault(k, []).append(c)
    cpu_s = {k: 0.0 for k in paths}
    spots: dict[str, dict] = {k: {} for k in paths}
    for r in range(rounds):
        for i in range(0, len(keys), CHUNK):
            chunk = keys[i:i + CHUNK]
            turn = (r + i // CHUNK) % len(paths)
            order = list(paths)[turn:] + list(paths)[:turn]
            for path in order:
                c0 = cpu()
                out, _ = T.spot_all(paths[path], [images[k] for k in chunk], p.max_side,
                                    [caps[k] for k in chunk])
                cpu_s[path] += cpu() - c0
                spots[path].update(zip(chunk, out))
    n = len(keys) * rounds
    hit = {path: {(k, c): decision(spots[path][k] or [], c, p) for k, c in rows} for path in paths}
    out = {}
    for path in paths:
        dis = [(k, c, hit[REF][(k, c)], hit[path][(k, c)]) for k, c in rows
               if T.text_spotted(hit[REF][(k, c)], p.min_chars)
               != T.text_spotted(hit[path][(k, c)], p.min_chars)]
        out[path] = {"rate": n / cpu_s[path], "dis": dis, "spent": dict(paths[path].spent or {}),
                     "models": dict(paths[path].models), "rounds": rounds,
                     "lines": sum(usable(spots[path][k], p) != usable(spots[REF][k], p)
                                  for k in keys if getattr(spots[path][k], "complete", True)),
                     "flags": sum(T.text_spotted(m, p.min_chars) for m in hit[path].values())}
        paths[path].models.clear()
        if paths[path].spent is not None:
            paths[path].spent.clear()
    return {"set": name, "images": len(keys), "rows": len(rows), "load": os.getloadavg()[0],
            "paths": out}


def report(r: dict) -> None:
    full = r["paths"][REF]
    for path, x in r["paths"].items():
        if path == REF:
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


RUNTIMES = {"ort": ("onnxruntime", "f32"), "ov-f32": ("openvino", "f32"),
            "ov-bf16": ("openvino", "bf16"), "ov-det-bf16": ("openvino", "det-bf16"),
            "ov-f32-plain": ("openvino", "f32")}
# compiled from the model files as they are (the detector's head not rewritten: the "before")
PLAIN = {"ov-f32-plain"}


class Timed:
    """A model's session that adds the CPU seconds of each call to ``spent[step]``."""

    def __init__(self, session, spent: dict, step: str) -> None:
        self.session, self.spent, self.step = session, spent, step

    def __call__(self, x):
        c0 = cpu()
        out = self.session(x)
        self.spent[self.step] = self.spent.get(self.step, 0.0) + cpu() - c0
        return out


def backend(runtime: str, fast=None) -> T.RapidOcrBackend:
    """rapidocr on ``runtime`` (a RUNTIMES key), its three models timed into ``models``."""
    rt, precision = RUNTIMES[runtime]
    b = T.RapidOcrBackend(threads=1, fast=fast, runtime=rt, precision=precision)
    if runtime in PLAIN:
        import openvino
        det = b.ocr.text_det
        det.infer = RT.OvSession(openvino.Core(), det.infer.path, 1, precision)
    b.models = {}
    for model, attr, step in ((b.ocr.text_det, "infer", "det"), (b.ocr.text_cls, "infer", "cls"),
                              (b.ocr.text_rec, "session", "rec")):
        setattr(model, attr, Timed(getattr(model, attr), b.models, step))
    return b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=200, help="images per set (0: all)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sets", default=",".join(SETS))
    ap.add_argument("--runtimes", default=",".join(RUNTIMES),
                    help=f"comma-separated, of {list(RUNTIMES)}: each path on each")
    ap.add_argument("--full", action=argparse.BooleanOptionalAction, default=True,
                    help="the full OCR on each runtime but onnxruntime's (the reference)")
    ap.add_argument("--det-pixels", default=str(TextSpotParams().det_pixels),
                    help="comma-separated detector sizes (N or N:GATE), one fast path each")
    ap.add_argument("--cascade", default=str(T.Cascade().gate_scale),
                    help="comma-separated gate scales (SCALE[:tight][:PIXELS][:all][:bN]; tight: "
                    "each crop recognised at its own width; PIXELS: the gate's least size; all: "
                    "every crop read, stop_early off; bN: N crops per recogniser call), one "
                    "cascade each ('': none)")
    a = ap.parse_args()
    p = TextSpotParams()
    paths = {REF: backend("ort")}
    for rt in a.runtimes.split(","):
        if a.full and rt != "ort":
            paths[f"full/{rt}"] = backend(rt)
        for spec in filter(None, a.det_pixels.split(",")):
            px, _, gate = spec.partition(":")
            fast = T.fast_path(TextSpotParams(mode="fast", det_pixels=int(px),
                                              gate_pixels=int(gate or 0)))
            paths[f"fast@{spec}/{rt}"] = backend(rt, fast)
        for spec in filter(None, a.cascade.split(",")):
            scale, *opts = spec.split(":")
            least = [int(x) for x in opts if x.isdigit()] or [T.Cascade().gate_min_pixels]
            cascade = dataclasses.replace(T.fast_path(TextSpotParams(mode="cascade")),
                                          gate_scale=float(scale), tight="tight" in opts,
                                          gate_min_pixels=least[0])
            if "all" in opts:
                cascade = dataclasses.replace(cascade, stop_chars=0)
            if "nogate" in opts:
                cascade = dataclasses.replace(cascade, gate=False)
            for x in opts:
                if x[:1] == "b":
                    cascade = dataclasses.replace(cascade, read_batch=int(x[1:]))
            paths[f"cascade@{spec}/{rt}"] = backend(rt, cascade)
            paths[f"cascade@{spec}/{rt}"].spent = {}
    print(f"paths: {list(paths)[1:]}; load average {os.getloadavg()}", flush=True)
    res = []
    for name in a.sets.split(","):
        res.append(run_set(name, paths, p, a.limit, a.rounds))
        report(res[-1])
    table(res)


def table(res: list) -> None:
    print("\n| set | images (rows) | path | img/CPU-s | vs full OCR (onnxruntime) | model ms per "
          "image det / cls / rec | other ms | flagged ref / path | agreement | disagreements | "
          "load avg |\n" + "|---" * 11 + "|")
    for r in res:
        full = r["paths"][REF]
        for path, x in r["paths"].items():
            m, n = x["models"], r["images"] * x["rounds"]
            ms = [1000 * m.get(k, 0.0) / n for k in ("det", "cls", "rec")]
            other = 1000 / x["rate"] - sum(ms)
            print(f"| {r['set']} | {r['images']} ({r['rows']}) | {path} | {x['rate']:.2f} | "
                  f"{x['rate'] / full['rate']:.2f}x | {' / '.join(f'{v:.1f}' for v in ms)} | "
                  f"{other:.1f} | {full['flags']} / {x['flags']} | "
                  f"{1 - len(x['dis']) / r['rows']:.2%} | {len(x['dis'])} | {r['load']:.1f} |")


if __name__ == "__main__":
    main()
