"""Step time (forward + backward) of each fine-tuning loss relative to CLIP's InfoNCE.

    .venv/bin/python tests/benchmarks/bench_losses.py [--batch 256] [--dim 512] [--repeats 100]
                                                      [--threads 1]

Two settings per loss: the loss alone (gradients w.r.t. the normalised embeddings and the loss's
own parameters), and the loss behind a small projection head (768 -> dim linear layers on each
side, then normalisation). All cases run interleaved in shuffled order within each repeat, so
load on a shared machine hits them alike; a figure is the median over repeats and the ratios
come from the same run (the minima, printed beside them, are the least disturbed by other load).
Goal: <= 1.05x InfoNCE (the papers claim no added complexity). The last row adds DiHT's concept
cross-entropy over its vocabularies (10k objects, 1.2k attributes, top-10 targets) on given
logits; the linear heads that produce them are model cost, timed on their own in a footnote.

One thread by default: on a shared 2-core machine a 2-thread pool stalls at every parallel
region whenever another process holds a core (a 2 ms step then reads 20-60 ms); --threads 2 on
an idle machine.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from vlcurate.trainer import losses as L

N_OBJ, N_ATTR, TOPK, FEAT = 10_000, 1_200, 10, 768


def build(batch: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = batch
    feats = (torch.randn(n, FEAT, generator=g), torch.randn(n, FEAT, generator=g))
    emb = [F.normalize(torch.randn(n, dim, generator=g), dim=1).requires_grad_() for _ in "it"]
    head = [torch.nn.Linear(FEAT, dim) for _ in "it"]
    concept_heads = [torch.nn.Linear(dim, N_OBJ), torch.nn.Linear(dim, N_ATTR)]
    hard = torch.full((n, 1), -1)                          # HELIP p=1: seed i, hard pair i + n/2
    hard[: n // 2, 0] = torch.arange(n // 2, n)
    pos = torch.eye(n, dtype=torch.bool) | (torch.rand(n, n, generator=g) < 0.01)  # FFF mined
    targets = []
    for c in (N_OBJ, N_ATTR):
        idx = torch.stack([torch.randperm(c, generator=g)[:TOPK] for _ in range(n)])
        targets += [idx, torch.softmax(torch.randn(n, TOPK, generator=g), 1)]
    concept_logits = [torch.randn(n, c, generator=g).requires_grad_() for c in (N_OBJ, N_ATTR)]
    p = dict(scale=torch.tensor(14.3, requires_grad=True),
             b=torch.tensor(-10.0, requires_grad=True),
             u_scale=torch.tensor([14.0, 14.0, 14.0], requires_grad=True),
             u_off=torch.tensor([0.0, 0.0, 0.0], requires_grad=True),
             u_w=torch.tensor([1.0, 0.5, 1.0]))
    return feats, emb, head, concept_heads, hard, pos, targets, concept_logits, p


def cases(batch: int, dim: int):
    feats, emb, head, concept_heads, hard, pos, (oi, ov, ai, av), clog, p = build(batch, dim)
    u = lambda: (L.pair_matrix(p["u_scale"], 2), L.pair_matrix(p["u_off"], 2),  # noqa: E731
                 L.pair_matrix(p["u_w"], 2))
    losses = {
        "InfoNCE (CLIP)": lambda x, t, c: L.info_nce(x, t, p["scale"]),
        "HELIP: CLIP + HNML": lambda x, t, c: L.helip_loss(x, t, p["scale"], hard, gamma=1.0),
        "DiHT: HN-NCE": lambda x, t, c: L.hn_nce(x, t, p["scale"], 1.0, 0.25),
        "FFF: sigmoid": lambda x, t, c: L.sigmoid_loss(x, t, p["scale"], p["b"], pos),
        "UniCLIP: MP-NCE": lambda x, t, c: L.mp_nce_image_text(x, t, pos, *u()),
        "DiHT: HN-NCE + concept CE": lambda x, t, c: L.hn_nce(x, t, p["scale"], 1.0, 0.25)
        + 0.5 * L.concept_distillation_loss(c[0], oi, ov, c[1], ai, av),
    }
    params = [*emb, *clog, p["scale"], p["b"], p["u_scale"], p["u_off"]]
    params += [q for m in (*head, *concept_heads) for q in m.parameters()]

    def alone(fn):
        def step():
            fn(emb[0], emb[1], clog).backward()
        return step

    def with_head(fn):
        def step():
            x = F.normalize(head[0](feats[0]), dim=1)
            t = F.normalize(head[1](feats[1]), dim=1)
            fn(x, t, clog).backward()
        return step

    def concept_heads_step():                  # model cost of DiHT's heads, for the footnote
        x = emb[0].detach()
        sum(h(x).sum() for h in concept_heads).backward()

    out = {}
    for name, fn in losses.items():
        out[(name, "alone")] = alone(fn)
        out[(name, "head")] = with_head(fn)
    out[("heads", "model")] = concept_heads_step
    return list(losses), out, params


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    names, steps, params = cases(a.batch, a.dim)
    keys = list(steps)
    times: dict = {k: [] for k in keys}
    rng = random.Random(0)
    for r in range(a.warmup + a.repeats):
        rng.shuffle(keys)
        for k in keys:
            for q in params:
                q.grad = None
            t0 = time.perf_counter()
            steps[k]()
            dt = time.perf_counter() - t0
            if r >= a.warmup:
                times[k].append(dt)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    low = {k: min(v) * 1e3 for k, v in times.items()}
    print(f"batch {a.batch}, dim {a.dim}, {torch.get_num_threads()} thread(s), float32 CPU, "
          f"{a.repeats} interleaved repeats of forward + backward; ms = median, ratios of "
          f"medians (and of minima)")
    print(f"{'loss':27s} {'alone ms':>9s} {'x InfoNCE':>9s} {'(min)':>7s}   "
          f"{'+head ms':>9s} {'x InfoNCE':>9s} {'(min)':>7s}")
    b = {m: (med[(names[0], m)], low[(names[0], m)]) for m in ("alone", "head")}
    for n in names:
        cells = []
        for m in ("alone", "head"):
            cells.append(f"{med[(n, m)]:9.3f} {med[(n, m)] / b[m][0]:8.2f}x "
                         f"{low[(n, m)] / b[m][1]:6.2f}x")
        print(f"{n:27s} " + "   ".join(cells))
    h = med[("heads", "model")]
    print(f"(DiHT's concept heads themselves, 512 -> {N_OBJ} + {N_ATTR} linear, forward + backward:"
          f" {h:.3f} ms = {h / b['head'][0]:.2f}x the InfoNCE +head step; model cost, not loss)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
