"""Positives: FFF's false-negative fix (Eq. 1) plus HELIP's near-duplicates. Pure algorithms.

FFF (sec. 4.1, Eq. 1) marks the pair (image i, text j), j != i, as a positive when

    M_ij = (S_it > p1) or (S_ii > p2) or [(S_tt > p3) and (S_it > p1')]

with p1 = 0.27, p1' = 0.24, p2 = 0.92, p3 = 0.99 (sec. 5). Choices made here:

* S_ii and S_tt come from the unimodal embeddings (the embed stage). Without a cross-modal
  (CLIP-like) embedding there is no S_it, and the rule is the issue's unimodal one:
  M = (S_ii > p2) or (S_tt > p3). With one, S_it = <cross image i, cross text j> (directed: row i
  lists the texts j that are positives for its image) and Eq. 1 applies in full.
* FFF applies M inside each batch; we apply it over the whole kept dataset, once, offline, so the
  trainer can put a sample's positives in its batch (multi-positive labels).
* HELIP's duplicates (S_ii > dup or S_tt > dup, the pairs HPM refuses as hard pairs) are
  positives too, with relation ``duplicate``, whether or not Eq. 1 fires.
* One relation per pair, the first that fires in the order duplicate, image, cross, text; its
  score is the similarity that fired it (duplicate: max(S_ii, S_tt)).
* At most ``max_positives`` per row: best relation first, then highest score (a caption repeated
  ten thousand times would otherwise give ten-thousand-long lists).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from vlcurate.schemas import mining as M

from .hpm import IvfParams, as_tensor, build_ivfpq, gather_dots

CODES = M.RELATIONS          # code c <-> CODES[c]; -1 = not a positive


@dataclass(frozen=True)
class Rule:
    p1: float = 0.27
    p1_text: float = 0.24        # p1'
    p2: float = 0.92
    p3: float = 0.99
    dup: Optional[float] = 0.98
    cross: bool = False          # S_it available: the full Eq. 1
    duplicates: bool = True      # list HELIP duplicates as positives


def relate(sii: torch.Tensor, stt: torch.Tensor, sit: Optional[torch.Tensor],
           rule: Rule) -> tuple[torch.Tensor, torch.Tensor]:
    """Relation code (index into CODES, -1 none) and score of every pair of a block."""
    code = torch.full(sii.shape, -1, dtype=torch.int8, device=sii.device)
    score = torch.zeros_like(sii)

    def put(mask: torch.Tensor, c: int, s: torch.Tensor) -> None:   # lower codes overwrite
        code.masked_fill_(mask, c)
        score.copy_(torch.where(mask, s, score))

    text = stt > rule.p3
    if rule.cross:
        text &= sit > rule.p1_text
    put(text, 3, stt)
    if rule.cross:
        put(sit > rule.p1, 2, sit)
    put(sii > rule.p2, 1, sii)
    if rule.duplicates and rule.dup is not None:
        put((sii > rule.dup) | (stt > rule.dup), 0, torch.maximum(sii, stt))
    return code, score


def rank_key(code: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Higher is better: relation priority first, then score (scores are in [-1, 1])."""
    return torch.where(code >= 0, (3 - code.float()) * 4 + score + 1, torch.full_like(score, -1.0))


@dataclass
class Positives:
    idx: np.ndarray      # [q, P] global rows, -1 padded, best first
    code: np.ndarray     # [q, P] int8 relation codes
    score: np.ndarray    # [q, P] float32


class _Best:
    """Running top-P of (key, idx, code, score) per query; ties keep the lower index."""

    def __init__(self, nq: int, p: int, device: str) -> None:
        self.p = p
        self.key = torch.full((nq, p), -1.0, device=device)
        self.idx = torch.full((nq, p), -1, dtype=torch.long, device=device)
        self.code = torch.full((nq, p), -1, dtype=torch.int8, device=device)
        self.score = torch.zeros((nq, p), device=device)

    def add(self, key, idx, code, score) -> None:
        kk = min(self.p, key.shape[1])
        top = key.topk(kk, dim=1).indices
        cat = [torch.cat([a, b.gather(1, top)], 1) for a, b in
               ((self.key, key), (self.idx, idx), (self.code, code), (self.score, score))]
        order = torch.sort(cat[0], dim=1, descending=True, stable=True).indices[:, :self.p]
        self.key, self.idx, self.code, self.score = (t.gather(1, order) for t in cat)

    def result(self) -> Positives:
        ok = (self.key >= 0).cpu().numpy()
        idx = np.where(ok, self.idx.cpu().numpy(), -1)
        return Positives(idx, np.where(ok, self.code.cpu().numpy(), -1).astype(np.int8),
                         np.where(ok, self.score.cpu().numpy(), 0).astype(np.float32))


def exact_positives(img, txt, rule: Rule, max_positives: int = 64,
                    queries: Optional[np.ndarray] = None, ximg=None, xtxt=None,
                    block_size: int = 8192, query_block: int = 1024,
                    device: str = "cpu") -> Positives:
    """Every positive of each target against every row, blockwise (bounded memory).
    ``ximg``/``xtxt``: the cross-modal embeddings, needed when rule.cross."""
    n = len(img)
    I, T = as_tensor(img, device), as_tensor(txt, device)
    XI = as_tensor(ximg, device) if rule.cross else None
    XT = as_tensor(xtxt, device) if rule.cross else None
    q_all = np.arange(n) if queries is None else np.asarray(queries, dtype=np.int64)
    parts = []
    with torch.no_grad():
        for q0 in range(0, len(q_all), query_block):
            qidx = torch.as_tensor(q_all[q0:q0 + query_block], device=device)
            best = _Best(len(qidx), max_positives, device)
            for b0 in range(0, n, block_size):
                b1 = min(n, b0 + block_size)
                sit = XI[qidx] @ XT[b0:b1].T if rule.cross else None
                code, score = relate(I[qidx] @ I[b0:b1].T, T[qidx] @ T[b0:b1].T, sit, rule)
                own = ((qidx >= b0) & (qidx < b1)).nonzero().flatten()
                code[own, qidx[own] - b0] = -1                      # not its own positive
                j = torch.arange(b0, b1, device=device).expand(len(qidx), -1)
                best.add(rank_key(code, score), j, code, score)
            parts.append(best.result())
    if not parts:
        z = np.zeros((0, max_positives))
        return Positives(z.astype(np.int64), z.astype(np.int8), z.astype(np.float32))
    return Positives(*(np.concatenate([getattr(p, f) for p in parts])
                       for f in ("idx", "code", "score")))


class FastPositives:
    """Approximate positives at scale: an IVF-PQ index per modality (and over the cross-modal
    texts), the union of each target's k' candidates from each, then the exact rule on them.
    Positives need high similarity in one modality, so they are near neighbours in that one."""

    def __init__(self, indexes: dict, img, txt, ximg=None, xtxt=None, device: str = "cpu") -> None:
        self.indexes = indexes                   # "image" | "text" | "cross" -> faiss index
        self.device = device

        def keep(x):                             # CPU: FAISS reads them in place (memmaps)
            if x is None:
                return None
            return np.ascontiguousarray(x, np.float32) if device == "cpu" else as_tensor(x, device)
        self.I, self.T, self.XI, self.XT = keep(img), keep(txt), keep(ximg), keep(xtxt)

    @staticmethod
    def build(img, txt, params: dict[str, IvfParams], xtxt=None, seed: int = 0) -> dict:
        out = {"image": build_ivfpq(img, params["image"], seed),
               "text": build_ivfpq(txt, params["text"], seed)}
        if xtxt is not None:
            out["cross"] = build_ivfpq(xtxt, params["cross"], seed)
        return out

    def query(self, qidx: np.ndarray, rule: Rule, max_positives: int = 64, k_prime: int = 64,
              block: int = 2048) -> Positives:
        qidx = np.asarray(qidx, np.int64)
        parts = [self._block(qidx[q0:q0 + block], rule, max_positives, k_prime)
                 for q0 in range(0, len(qidx), block)]
        if not parts:
            z = np.zeros((0, max_positives))
            return Positives(z.astype(np.int64), z.astype(np.int8), z.astype(np.float32))
        return Positives(*(np.concatenate([getattr(p, f) for p in parts])
                           for f in ("idx", "code", "score")))

    def _rows(self, base, idx: np.ndarray) -> np.ndarray:
        x = base[idx] if self.device == "cpu" else base[torch.as_tensor(idx, device=self.device)]
        return x if self.device == "cpu" else x.cpu().numpy()

    def _block(self, qidx, rule, max_positives, k_prime) -> Positives:
        q = {"image": self._rows(self.I, qidx), "text": self._rows(self.T, qidx)}
        if rule.cross:
            q["cross"] = self._rows(self.XI, qidx)
        cands = [self.indexes[name].search(vec, min(k_prime, self.indexes[name].ntotal))[1]
                 for name, vec in q.items()]
        c = np.sort(np.concatenate(cands, 1), axis=1)
        repeat = np.zeros(c.shape, bool)
        repeat[:, 1:] = c[:, 1:] == c[:, :-1]
        c = np.where((c >= 0) & ~repeat & (c != qidx[:, None]), c, -1)   # -1: scores -inf
        dev = self.device
        sii = gather_dots(q["image"], self.I, c, dev)
        stt = gather_dots(q["text"], self.T, c, dev)
        sit = gather_dots(q["cross"], self.XT, c, dev) if rule.cross else None
        code, score = relate(sii, stt, sit, rule)
        best = _Best(len(qidx), max_positives, dev)
        best.add(rank_key(code, score), torch.as_tensor(c, device=dev), code, score)
        return best.result()
