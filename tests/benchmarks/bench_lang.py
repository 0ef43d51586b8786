"""Language ID before the CAT parse: keep rates per corpus, CAT's C1+A keep rate on the rows lang
kept against all rows, and speeds (captions per CPU-second of this one process).

    .venv/bin/python tests/benchmarks/bench_lang.py [--n 3000] [--model auto]

DiHT applied CAT to English data and reports C1+A keeping 30.3% of LAION (Table A.3). On the
multilingual web alt text here CAT keeps fewer rows; the figure to compare with DiHT's is CAT's
keep rate on the rows the language filter kept.
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

CORPORA = ("coco_val2017_captions.csv", "flickr8k_captions.csv", "cc3m_validation_captions.csv",
           "img2dataset_test10000_alttext.csv")


def captions(name: str, n: int) -> list[str]:
    with open(SHARED_DATA / "captions_only" / name, encoding="utf-8") as fh:
        return [r["caption"] for _, r in zip(range(n), csv.DictReader(fh))]


def timed(fn, *args):
    t0 = time.process_time()
    out = fn(*args)
    return out, time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--model", default="auto")
    a = ap.parse_args()
    from vlcurate.stages.cat.parser import load_pipeline, parse_texts
    from vlcurate.stages.lang.stage import classify, identifier
    identifier()
    pipe = load_pipeline(a.model)
    print(f"load average {os.getloadavg()[0]:.1f}; CAT parse with {pipe.label}; langid keep=[en]")
    print(f"{'corpus':36s} {'rows':>6s} {'lang kept':>9s} {'C1+A all':>9s} {'C1+A | en':>9s} "
          f"{'lang /cpu-s':>11s} {'parse /cpu-s':>12s}")
    for name in CORPORA:
        if not (SHARED_DATA / "captions_only" / name).exists():
            continue
        caps = captions(name, a.n)
        langs, t_lang = timed(lambda cs: [classify(c, ("en",))[0] == "en" for c in cs], caps)
        graphs, t_parse = timed(parse_texts, pipe, caps)
        cat = [g.complexity >= 1 and g.n_actions > 0 for g in graphs]
        en = sum(langs)
        both = sum(c and e for c, e in zip(cat, langs))
        print(f"{name:36s} {len(caps):6d} {en / len(caps):9.1%} {sum(cat) / len(caps):9.1%} "
              f"{both / max(en, 1):9.1%} {len(caps) / t_lang:11.0f} {len(caps) / t_parse:12.0f}")


if __name__ == "__main__":
    main()
