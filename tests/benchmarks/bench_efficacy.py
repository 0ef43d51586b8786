"""Does curation make a better model? The real DAG, then the real trainer, on Flickr8k with
injected mismatched captions.

Data: ../shared/data/flickr8k_224. Training rows: the train + dev captions (five per image), a
share of them (``--rates``, default 0 / 20% / 40%) given the caption of another image
(``efficacy_data.inject_noise``, seed ``--noise-seed``). Evaluation: the 1,000 test images and
their 5,000 captions, as ``finetune.eval_data`` (a folder with captions.csv), retrieval over
distinct images.

Curation: ``vlcurate run`` at the README's config (pipeline/configs/small.yaml) on the stages
whose decisions depend on how well a caption matches its image: ``run.stages: [ingest, ids,
embed, hpm, positives]`` (plus export). CAT's caption filter, language ID and text spotting are
left out: they judge a caption alone, the same with or without swapped captions, and CAT at
the small config drops about half of Flickr8k's captions (no action), which would mix its
effect into the noise comparison. Training sets, each an export of a real run:
- ``all``: every ingested row (``export.drop: [ingest.*]``, a re-export of the same run);
- ``export``: the rows the default policy exports (hpm's noise pairs dropped);
- ``clean``: the clean rows only (the injected rows removed at the source), every ingested row
  of that run exported: the ceiling.

Trainer: ``finetune.arch: towers``, EfficientNet-Lite0 and MiniLM both locked (LiT), 256-d
linear projections; one feature store for every run (``finetune.features_dir``), so each image
and text is embedded once in the whole benchmark. Losses on the ``export`` set: InfoNCE
(``clip``), HELIP's HNML with the mined hard pairs (``helip``), DiHT's HN-NCE (``hn_nce``) and
FFF's sigmoid loss with the mined positives (``sigmoid``; no recaptions: BLIP-2's weights
cannot be had offline, ``fff_recaptions: 0``). Concept distillation (DiHT, ``concept_weight``
0.5 against 0) at ``--concept-rates``: a run with the teacher (EfficientNet-Lite0) and the
concepts stage as well (``concepts_run``), both arms trained on its export. Seeds ``--seeds`` (the trainer's seed:
initial projections and batch order); the table gives mean ± sd.

Round 2 (the DFN loop, ``--round2`` fractions at ``--round2-rates``): the same noisy rows
curated again with round 1's checkpoint (``export`` trained with InfoNCE, seed 0) as
``embed.cross_model``, exported by the score alone (``export.drop: [ingest.*]``,
``export.keep_top_fraction`` 0.7 and 0.8), and trained as round 1 was; beside round 1, all rows
and the clean ceiling, with the share of swapped captions each training set still holds.

    PYTHONPATH=<pkg> python tests/benchmarks/bench_efficacy.py                 # the table
    PYTHONPATH=<pkg> python tests/benchmarks/bench_efficacy.py --write docs/efficacy.md

Work files go to ``--work`` (default ~/.cache/vlcurate/bench/efficacy); the run cache and the
feature store there make a rerun cheap.
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.benchmarks import efficacy_data as D
from vlcurate.pipeline import config as C
from vlcurate.pipeline.runner import run
from vlcurate.schemas import F
from vlcurate.schemas import mining as M

SMALL = Path(__file__).resolve().parents[2] / "pipeline" / "configs" / "small.yaml"
STAGES = ["ingest", "ids", "embed", "hpm", "positives"]
KEY = "row"
METRICS = ("t2i_R@1", "t2i_R@5", "t2i_R@10", "i2t_R@1", "i2t_R@5", "i2t_R@10")


def source_folder(root: Path, rows: list, keys: list) -> Path:
    """A folder source: images/ symlinked into the data set, captions.csv with a key column
    (left as it is when a rerun would write the same: the run resumes)."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow([F.IMAGE.name, F.CAPTION.name, KEY])
    w.writerows([r["image"], r["caption"], k] for r, k in zip(rows, keys))
    data = buf.getvalue().encode()
    if (root / "captions.csv").exists() and (root / "captions.csv").read_bytes() == data:
        return root
    if root.exists():
        shutil.rmtree(root)
    (root / "images").mkdir(parents=True)
    src = D.data_dir() / "images"
    for name in sorted({r["image"] for r in rows}):
        (root / "images" / name).symlink_to(src / name)
    (root / "captions.csv").write_bytes(data)
    return root


def curate(work: Path, name: str, rows: list, keys: list, extra: dict) -> C.Config:
    """``vlcurate run`` at the small config on ``rows``; the config it ran with."""
    folder = source_folder(work / "src" / name, rows, keys)
    cfg = C.load(SMALL, {"source.path": str(folder), "source.key_column": KEY,
                         "source.extra_columns": [], "source.allow_outside_source": True,
                         "run.run_dir": str(work / "runs" / name), "run.stages": STAGES,
                         "run.cache_dir": str(work / "cache"), "run.progress": False,
                         "embed.image_model.path": D.lite0_weights(), **extra})
    run(cfg, executor="local", log=lambda _: None)
    return cfg


def re_export(cfg: C.Config, out: Path, drop: list, **policy) -> C.Config:
    """The same run under another export policy (only export recomputes)."""
    cfg = cfg.replace(**{"export.drop": drop, "export.out_dir": str(out),
                         **{f"export.{k}": v for k, v in policy.items()}})
    run(cfg, executor="local", only={"export"}, log=lambda _: None)
    return cfg


def shards_of(cfg: C.Config) -> str:
    return str(Path(cfg.export.out_dir or Path(cfg.run.run_dir) / "export") / "shards")


def noise_detection(cfg: C.Config, labels: np.ndarray) -> dict:
    """hpm's noise flags and support (own + agreeing siblings) against the injected labels."""
    import pyarrow.dataset as ds
    t = ds.dataset(str(Path(cfg.run.run_dir) / "export" / "data")).to_table(
        columns=[F.KEY.name, M.IS_NOISE.name, M.SUPPORT.name, M.SIBLINGS.name])
    at = np.array([int(k) for k in t.column(F.KEY.name).to_pylist()])
    flags = np.zeros(len(labels), bool)
    score = np.zeros(len(labels))
    flags[at] = np.asarray(t.column(M.IS_NOISE.name).fill_null(False))
    score[at] = (np.nan_to_num(np.asarray(t.column(M.SUPPORT.name).to_pylist(), float))
                 + np.nan_to_num(np.asarray(t.column(M.SIBLINGS.name).to_pylist(),
                                            float)))
    return D.noise_metrics(labels, flags, score)


def finetune(shards: str, out: Path, work: Path, eval_dir: Path, loss: str, seed: int,
             args: argparse.Namespace, **extra) -> dict:
    """One ``vlcurate finetune`` (towers, both locked) and its eval_data retrieval."""
    from vlcurate.trainer import train as T
    ft = {"arch": "towers", "image_tower": {"id": D.IMAGE_ID, "path": D.lite0_weights()},
          "text_tower": {"id": D.TEXT_ID}, "embed_dim": 256, "loss": loss, "seed": seed,
          "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
          "weight_decay": 0.0, "eval_fraction": 0, "ckpt_every": args.steps,
          "eval_data": str(eval_dir), "features_dir": str(work / "features"),
          "progress": False, "shuffle_buffer": 1024, "fff_recaptions": 0, **extra}
    done = out / "bench.json"   # a rerun reuses a fine-tune of the same settings and shards
    manifest = hashlib.sha256((Path(shards) / "manifest.json").read_bytes()).hexdigest()
    if done.exists():
        kept = json.loads(done.read_text())
        if kept["ft"] == ft and kept.get("manifest") == manifest:
            return kept["eval"]
    if out.exists():
        shutil.rmtree(out)
    r = T.train(C.from_dict({"finetune": ft}).finetune, shards, str(out), log=lambda *_: None)
    done.write_text(json.dumps({"ft": ft, "manifest": manifest, "eval": r["eval"]["eval_data"]}))
    return r["eval"]["eval_data"]


def itm_auc(ft_dir: Path, ft: dict) -> dict:
    """AUC of telling Flickr8k's human-labelled no-match pairs (itm_pairs.csv) from matches by a
    low cosine under a fine-tuned checkpoint, per itm split. The locked towers' features come
    from the benchmark's feature store (the same towers for every checkpoint)."""
    import torch
    from vlcurate.trainer.encoder import load_encoder
    from vlcurate.trainer.features import locked_eval
    enc = load_encoder(str(ft_dir))
    with open(D.data_dir() / "itm_pairs.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    images = [(D.data_dir() / "images" / r["image"]).read_bytes() for r in rows]
    fi, ftx = locked_eval(C.from_dict({"finetune": ft}).finetune, enc.model, images,
                          [r["caption"] for r in rows], enc.image_size, enc.mean, enc.std,
                          enc.tokenize, "cpu", None)
    with torch.no_grad():
        score = (enc.model.encode_image(None, fi) * enc.model.encode_text(None, None, ftx))
    score = score.sum(1).numpy()
    no = np.array([r["label"] == "no-match" for r in rows])
    split = np.array([r["itm_split"] for r in rows])
    return {"all": D.auc(no, score), **{k: D.auc(no[split == k], score[split == k])
                                        for k in ("train", "dev", "test")}}


def eval_folder(work: Path) -> Path:
    rows = D.flickr_rows(("test",))
    return source_folder(work / "src" / "test", rows, list(range(len(rows))))


def mean_sd(xs: list) -> str:
    xs = [100 * x for x in xs]
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.1f} ± {sd:.1f}"


def one_rate(rate: float, args, work: Path, eval_dir: Path, log) -> tuple[dict, dict]:
    """(noise detection, {(set, loss): [eval per seed]}) at one noise rate."""
    rows = D.flickr_rows(("train", "dev"))[:args.max_rows]
    noisy, labels = D.inject_noise(rows, rate, args.noise_seed)
    keys = list(range(len(noisy)))
    name = f"noise{int(rate * 100)}"
    t0 = time.time()
    cfg = curate(work, name, noisy, keys, {})
    log(f"{name}: curated {len(noisy)} rows in {time.time() - t0:.0f}s")
    det = noise_detection(cfg, labels)
    sets = {"export": shards_of(cfg),
            "all": shards_of(re_export(cfg, work / "runs" / f"{name}-all", ["ingest.*"]))}
    if rate > 0:
        clean = [i for i in keys if not labels[i]]
        ccfg = curate(work, f"{name}-clean", [noisy[i] for i in clean], clean, {})
        sets["clean"] = shards_of(re_export(ccfg, work / "runs" / f"{name}-clean-all",
                                            ["ingest.*"]))
    plan = [(s, "clip", {}) for s in sets]
    plan += [("export", loss, {}) for loss in args.losses if loss != "clip"]
    if rate in args.concept_rates:
        sets["concepts"], heads = concepts_run(work, name, noisy, keys)
        plan += [("concepts", "clip", {}), ("concepts", "clip+concepts", heads)]
    got: dict = {}
    for s, loss, extra in plan:
        for seed in args.seeds:
            t0 = time.time()
            ev = finetune(sets[s], work / "ft" / f"{name}-{s}-{loss}-{seed}", work, eval_dir,
                          loss.split("+")[0], seed, args, **extra)
            got.setdefault((s, loss), []).append(ev)
            log(f"{name} {s:8s} {loss:13s} seed {seed}: t2i R@1 {100 * ev['t2i_R@1']:.1f} "
                f"({time.time() - t0:.0f}s)")
    return det, got


def round2(rate: float, args, work: Path, eval_dir: Path, log) -> dict:
    """{training set: (rows, swapped share, [eval per seed])}: round 1 (export, all, clean) and
    round 2 (the pool scored by round 1's checkpoint, its top fractions)."""
    rows = D.flickr_rows(("train", "dev"))[:args.max_rows]
    noisy, labels = D.inject_noise(rows, rate, args.noise_seed)
    keys = list(range(len(noisy)))
    name = f"noise{int(rate * 100)}"
    r1 = work / "ft" / f"{name}-export-clip-{args.seeds[0]}"
    t0 = time.time()
    cfg = curate(work, f"{name}-r2", noisy, keys, {"embed.cross_model": {
        "id": "round1", "path": str(r1), "random_init": False}})
    log(f"{name} round 2: curated with round 1's checkpoint in {time.time() - t0:.0f}s")
    # (shards, the fine-tunes' folder name): round 1's sets are one_rate's own fine-tunes
    sets = {"round 1: export": (work / "runs" / name / "export" / "shards", "export"),
            "all rows": (work / "runs" / f"{name}-all" / "shards", "all")}
    for f in args.round2:
        top = re_export(cfg, work / "runs" / f"{name}-r2-top{int(f * 100)}", ["ingest.*"],
                        keep_top_fraction=f)
        sets[f"round 2: top {f:.0%} by score"] = (Path(shards_of(top)), f"r2-top{int(f * 100)}")
    sets["clean (ceiling)"] = (work / "runs" / f"{name}-clean-all" / "shards", "clean")
    out = {}
    for s, (shards, ft) in sets.items():
        evs = [finetune(str(shards), work / "ft" / f"{name}-{ft}-clip-{seed}", work,
                        eval_dir, "clip", seed, args) for seed in args.seeds]
        n, swapped = swapped_share(Path(shards), labels)
        out[s] = (n, swapped, evs)
        log(f"{name} {s}: {n} rows, {swapped:.1%} swapped, t2i R@1 "
            f"{100 * statistics.mean(e['t2i_R@1'] for e in evs):.1f}")
    return out


def swapped_share(shards: Path, labels: np.ndarray) -> tuple[int, float]:
    """(samples, share of them with an injected caption) of a training set, from its shard
    index (sample ids) and the annotated table's keys."""
    import pyarrow.dataset as ds
    ids = set(ds.dataset(str(shards / "index")).to_table().column(F.SAMPLE_ID.name).to_pylist())
    data = shards.parent / "data" if (shards.parent / "data").exists() else \
        shards.parent / "export" / "data"
    t = ds.dataset(str(data)).to_table(columns=[F.SAMPLE_ID.name, F.KEY.name]).to_pylist()
    keys = [int(r[F.KEY.name]) for r in t if r[F.SAMPLE_ID.name] in ids]
    return len(keys), float(np.mean(labels[keys])) if keys else 0.0


def round2_table(results: dict, args) -> list:
    lines = ["## round 2: the pool scored by round 1's checkpoint (the DFN loop; InfoNCE, %, "
             "mean ± sd over seeds)", "",
             "| noise | training rows | rows | swapped | " + " | ".join(METRICS) + " |",
             "|---|---|---|---|" + "---|" * len(METRICS)]
    for rate, got in results.items():
        for s, (n, swapped, evs) in got.items():
            cells = [mean_sd([e[m] for e in evs]) for m in METRICS]
            lines.append(f"| {rate:.0%} | {s} | {n} | {swapped:.1%} | " + " | ".join(cells)
                         + " |")
    return lines


def concepts_run(work: Path, name: str, rows: list, keys: list) -> tuple[str, dict]:
    """The DAG with DiHT's teacher and concept targets too (CAT parses the captions for the
    vocabulary; its flags stay annotations: the same rows as ``export``, hpm's noise pairs
    dropped); (its shards, the trainer's concept settings: heads sized by its vocabulary)."""
    import pyarrow.parquet as pq
    from vlcurate.schemas import concepts as CO
    cfg = curate(work, f"{name}-concepts", rows, keys,
                 {"run.stages": STAGES + ["concepts"], "run.compute_on_flagged": True,
                  "export.drop": ["ingest.*", "lang.*", "hpm.*"]})
    kinds = pq.read_table(Path(cfg.run.run_dir) / "concepts" / "vocab.parquet").column(
        CO.V_KIND.name).to_pylist()
    return shards_of(cfg), {"concept_weight": 0.5, "n_objects": kinds.count("object"),
                            "n_attributes": kinds.count("attribute")}


def itm_table(work: Path, results: dict, args) -> list:
    """The checkpoints of each rate's ``export`` and ``all`` InfoNCE runs as pair scorers."""
    lines = ["## the fine-tuned model as a pair scorer (itm_pairs.csv, AUC of no-match by a low "
             "cosine)", "", "| noise | training rows | AUC test split | AUC dev | AUC train "
             "(images seen in training) | AUC all |", "|---|---|---|---|---|---|"]
    for rate in results:
        for s in ("export", "all"):
            aucs = []
            for seed in args.seeds:
                out = work / "ft" / f"noise{int(rate * 100)}-{s}-clip-{seed}"
                aucs.append(itm_auc(out, json.loads((out / "bench.json").read_text())["ft"]))
            cells = [f"{statistics.mean(a[k] for a in aucs):.3f}"
                     for k in ("test", "dev", "train", "all")]
            lines.append(f"| {rate:.0%} | {s} | " + " | ".join(cells) + " |")
    return lines


def table(results: dict, args, wall: float) -> str:
    lines = ["| noise | training rows | loss | rows | " + " | ".join(METRICS) + " |",
             "|---|---|---|---|" + "---|" * len(METRICS)]
    for rate, (_, got, counts) in results.items():
        for (s, loss), evs in got.items():
            cells = [mean_sd([e[m] for e in evs]) for m in METRICS]
            lines.append(f"| {rate:.0%} | {s} | {loss} | {counts[s]} | " + " | ".join(cells) + " |")
    det = ["| noise | rows | injected | flagged | P | R | F1 | AUC (support) |",
           "|---|---|---|---|---|---|---|---|"]
    for rate, (d, _, _) in results.items():
        det.append(f"| {rate:.0%} | {d['n']} | {d['noise']} | {d['flagged']} | {d['P']:.2f} | "
                   f"{d['R']:.2f} | {d['F1']:.2f} | {d['AUC']:.3f} |")
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    head = (f"seeds {args.seeds}, noise seed {args.noise_seed}, {args.steps} steps of "
            f"{args.batch_size}, lr {args.lr}; this invocation's wall {wall / 60:.1f} min (fine-tunes "
            f"a rerun reuses: 0 s), load average {load}")
    return "\n".join(["### noise detection (hpm, small config)", "", *det, "",
                      "### retrieval on the Flickr8k test split (%, mean ± sd over seeds)", "",
                      *lines, "", head])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.2, 0.4])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--noise-seed", type=int, default=0)
    ap.add_argument("--losses", nargs="+", default=["clip", "helip", "hn_nce", "sigmoid"])
    ap.add_argument("--concept-rates", type=float, nargs="*", default=[0.2],
                    help="noise rates with a concept distillation on/off pair (a run with "
                         "the teacher and concepts stages)")
    ap.add_argument("--round2", type=float, nargs="*", default=[0.7, 0.8],
                    help="round 2's export.keep_top_fraction values (none: no round 2)")
    ap.add_argument("--round2-rates", type=float, nargs="*", default=[0.2, 0.4])
    ap.add_argument("--max-rows", type=int, default=None,
                    help="the first N training rows only (a quick check of the script)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--work", default=str(D.CACHE / "efficacy"))
    ap.add_argument("--write", help="also write the tables to this markdown file")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    work = Path(args.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, flush=True)          # noqa: E731
    t0 = time.time()
    eval_dir = eval_folder(work)
    results = {}
    for rate in args.rates:
        det, got = one_rate(rate, args, work, eval_dir, log)
        counts = {s: rows_of(work, rate, s) for s in {s for s, _ in got}}
        results[rate] = (det, got, counts)
    itm = itm_table(work, results, args)
    r2 = {rate: round2(rate, args, work, eval_dir, log) for rate in args.round2_rates
          if rate in results and args.round2}
    out = table(results, args, time.time() - t0) + "\n\n" + "\n".join(itm)
    if r2:
        out += "\n\n" + "\n".join(round2_table(r2, args))
    print(out)
    if args.write:
        write_tables(Path(args.write), out.replace("### ", "## "))


def write_tables(path: Path, tables: str) -> None:
    """The tables into ``path`` between its markers (the prose around them kept), or the whole
    file when it has none."""
    start, end = "<!-- tables: written by bench_efficacy.py --write -->", "<!-- end of tables -->"
    text = path.read_text() if path.exists() else ""
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = f"{head}{start}\n{tables}\n{end}{rest.split(end, 1)[1]}"
    else:
        text = tables + "\n"
    path.write_text(text)


def rows_of(work: Path, rate: float, s: str) -> int:
    """Samples in a training set's shards (its manifest)."""
    name = f"noise{int(rate * 100)}"
    run_dir = {"export": name, "all": f"{name}-all", "clean": f"{name}-clean-all",
               "concepts": f"{name}-concepts"}[s]
    base = work / "runs" / run_dir
    shards = base / "shards" if s in ("all", "clean") else base / "export" / "shards"
    return int(json.loads((shards / "manifest.json").read_text()).get("samples", 0))


if __name__ == "__main__":
    main()
