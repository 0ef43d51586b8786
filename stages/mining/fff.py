"""Positives: FFF's false-negative fix (Eq. 1, sec. 4.3) plus HELIP's near-duplicates. Pure
algorithms (no I/O).

FFF (sec. 4.1, Eq. 1) marks the pair (image i, text t) of different samples as a positive when

    M_it = (S_it > p1) or (S_ii > p2) or [(S_tt > p3) and (S_it > p1')]

with p1 = 0.27, p1' = 0.24, p2 = 0.92, p3 = 0.99 (sec. 5). Choices made here:

* With a cross-modal (CLIP-style) model, *every* similarity comes from it, as in FFF ("we use a
  pre-trained model", sec. 4.1; the thresholds of sec. 5 are for such a model): S_it = <x_i, t_t>,
  S_ii = <x_i, x_j>, S_tt = <t_i, t_j>. S_it is directed: row i lists the texts t that are
  positives of its image; M is never symmetrised.
* Without one there is no S_it, and the rule is the unimodal remainder on HELIP's encoders
  (DINO, SentenceT): M = (S_ii > p2) or (S_tt > p3). The positives stage says so in the summary.
* HELIP's duplicates (S_ii > dup or S_tt > dup on HELIP's unimodal features, the pairs HPM
  refuses as hard pairs) are positives too, with relation ``duplicate``. With a cross-modal model
  a *text* duplicate must also pass S_it > p1', like any text-text positive (FFF: repeated
  captions often go with poor image descriptions); an image duplicate is ungated, as S_ii is.
* Sec. 4.3, k captions per image (the caption plus its recaptions): the texts are every caption of
  every image, M is N_img x N_txt. S_it is per caption; S_ii is per image, replicated over the k
  captions of image j; S_tt is per pair of *caption groups*: our reading of "the average score
  between each caption of image x_i and all k captions of image x_j" is the mean over all k_i x
  k_j caption pairs, i.e. <mean of i's caption vectors, mean of j's>, replicated over j's captions
  like S_ii (so the text clause still needs that caption's own S_it > p1'). Groups may differ in
  size; with k = 1 everything reduces to Eq. 1. An image's own captions are its ground truth, not
  listed. Duplicates are judged per sample pair (HELIP's features) and replicated the same way.
* FFF applies M inside each batch; we apply it over the whole kept dataset, once, offline, so the
  trainer can put a sample's positives in its batch (multi-positive labels).
* One relation per (image, text), the first that fires in the order duplicate, image, cross,
  text; its score is the similarity that fired it (duplicate: max of HELIP's S_ii, S_tt).
* At most ``max_positives`` per row: best relation first, then highest score, then lowest text
  index (a caption repeated ten thousand times would otherwise give ten-thousand-long lists).
  Nothing is cut silently: ``count`` is every positive found before the cut.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from vlcurate.schemas import mining as M

from .hpm import IvfParams, as_tensor, build_ivfpq, gather_dots, stable_topk
from .store import Gathered

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

    @property
    def dups(self) -> bool:
        return self.duplicates and self.dup is not None


def relate(sii: torch.Tensor, stt: torch.Tensor, sit: Optional[torch.Tensor], rule: Rule,
           dii: Optional[torch.Tensor] = None, dtt: Optional[torch.Tensor] = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Relation code (index into CODES, -1 none) and score of every pair of a block. ``dii``,
    ``dtt``: the (HELIP) similarities duplicates are judged on; default ``sii``, ``stt``."""
    code = torch.full(sii.shape, -1, dtype=torch.int8, device=sii.device)
    score = torch.zeros_like(sii)

    def put(mask: torch.Tensor, c: int, s: torch.Tensor) -> None:   # lower codes overwrite
        code.masked_fill_(mask, c)
        score.copy_(torch.where(mask, s, score))

    gate = sit > rule.p1_text if rule.cross else None
    text = stt > rule.p3
    put(text & gate if rule.cross else text, 3, stt)
    if rule.cross:
        put(sit > rule.p1, 2, sit)
    put(sii > rule.p2, 1, sii)
    if rule.dups:
        dii, dtt = (sii if dii is None else dii), (stt if dtt is None else dtt)
        dtext = dtt > rule.dup
        put((dii > rule.dup) | (dtext & gate if rule.cross else dtext), 0,
            torch.maximum(dii, dtt))
    return code, score


def rank_key(code: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Higher is better: relation priority first, then score (scores are in [-1, 1])."""
    return torch.where(code >= 0, (3 - code.float()) * 4 + score + 1, torch.full_like(score, -1.0))


@dataclass
class Features:
    """What the rule reads, L2-normalised float32 (tensors, or arrays for the fast path). Rows of
    ``img``/``txt``/``dimg``/``dtxt``/``ximg`` are images (n); rows of ``xtxt`` are texts (m)."""
    img: Any                     # S_ii
    txt: Any                     # S_tt: one vector per image (sec. 4.3: its caption group's mean)
    dimg: Any = None             # HELIP duplicates (None: judged on img / txt)
    dtxt: Any = None
    ximg: Any = None             # S_it, image side (rule.cross)
    xtxt: Any = None             # S_it, text side: every caption, image by image
    owner: Optional[np.ndarray] = None     # [m] image of each text (None: text t is image t's)
    number: Optional[np.ndarray] = None    # [m] caption number within its image (0: the caption)

    @property
    def m(self) -> int:
        return len(self.img) if self.owner is None else len(self.owner)


def features(img, txt, rule: Rule, ximg=None, xtxt=None, owner=None, number=None,
             device: Optional[str] = "cpu") -> Features:
    """Without ``rule.cross``: S_ii, S_tt and duplicates on (img, txt). With it: every FFF
    similarity on the cross-modal (ximg, xtxt), duplicates on (img, txt); ``owner`` (sorted)
    groups the texts by image (sec. 4.3). ``device`` None keeps numpy arrays (the fast path)."""
    put = (lambda x: x) if device is None else (lambda x: as_tensor(x, device))
    if not rule.cross:
        return Features(put(img), put(txt))
    own = None if owner is None else np.asarray(owner, np.int64)
    if own is None:
        group = xtxt
    else:                                    # sec. 4.3: the mean vector of each caption group
        size = np.bincount(own, minlength=len(ximg))          # every image has its caption
        start = np.concatenate([[0], np.cumsum(size)[:-1]])
        group = (np.add.reduceat(np.asarray(xtxt, np.float32), start, axis=0)
                 / size[:, None]).astype(np.float32)
    dup, xi = rule.dups, put(ximg)
    return Features(xi, put(group), put(img) if dup else None, put(txt) if dup else None,
                    xi, put(xtxt), own,
                    None if number is None else np.asarray(number, np.int8))


@dataclass
class Positives:
    idx: np.ndarray      # [q, P] global image rows, -1 padded, best first
    code: np.ndarray     # [q, P] int8 relation codes
    score: np.ndarray    # [q, P] float32
    caption: np.ndarray  # [q, P] int8 caption number of the positive text (0: its caption)
    count: np.ndarray    # [q] positives found before the max_positives cut

    @staticmethod
    def concat(parts: list["Positives"], p: int) -> "Positives":
        if not parts:
            z = np.zeros((0, p))
            return Positives(z.astype(np.int64), z.astype(np.int8), z.astype(np.float32),
                             z.astype(np.int8), np.zeros(0, np.int64))
        return Positives(*(np.concatenate([getattr(x, f) for x in parts])
                           for f in ("idx", "code", "score", "caption", "count")))


class _Best:
    """Running top-P of (key, text idx, code, score) per query; ties keep the lower index."""

    def __init__(self, nq: int, p: int, device: str) -> None:
        self.p = p
        self.key = torch.full((nq, p), -1.0, device=device)
        self.idx = torch.full((nq, p), -1, dtype=torch.long, device=device)
        self.code = torch.full((nq, p), -1, dtype=torch.int8, device=device)
        self.score = torch.zeros((nq, p), device=device)
        self.count = torch.zeros(nq, dtype=torch.long, device=device)

    def add(self, key, idx, code, score) -> None:
        """A block whose ``idx`` ascend along each row, after blocks of lower ``idx``: equal keys
        keep the lower index (a stable sort: top-k would break ties in any order)."""
        self.count += (code >= 0).sum(1)
        top = stable_topk(key, min(self.p, key.shape[1]))
        cat = [torch.cat([a, b.gather(1, top)], 1) for a, b in
               ((self.key, key), (self.idx, idx), (self.code, code), (self.score, score))]
        order = torch.sort(cat[0], dim=1, descending=True, stable=True).indices[:, :self.p]
        self.key, self.idx, self.code, self.score = (t.gather(1, order) for t in cat)

    def result(self, f: Features) -> Positives:
        ok = (self.key >= 0).cpu().numpy()
        t = np.where(ok, self.idx.cpu().numpy(), 0)
        row = t if f.owner is None else f.owner[t]
        cap = np.zeros_like(t) if f.number is None else f.number[t]
        return Positives(np.where(ok, row, -1), np.where(ok, self.code.cpu().numpy(), -1)
                         .astype(np.int8), np.where(ok, self.score.cpu().numpy(), 0)
                         .astype(np.float32), np.where(ok, cap, 0).astype(np.int8),
                         self.count.cpu().numpy())


def _block(f: Features, rule: Rule, q: torch.Tensor, t0: int, t1: int, owner) -> tuple:
    """Codes and scores of queries ``q`` against texts t0..t1 (their images: ``owner``)."""
    r0, r1 = (t0, t1) if owner is None else (int(owner[0]), int(owner[-1]) + 1)

    def per_image(a):                   # a[q] . a[j] for the block's images, one per text
        if a is None:
            return None
        s = a[q] @ a[r0:r1].T
        return s if owner is None else s.index_select(1, owner - r0)

    sit = f.ximg[q] @ f.xtxt[t0:t1].T if rule.cross else None
    return relate(per_image(f.img), per_image(f.txt), sit, rule, per_image(f.dimg),
                  per_image(f.dtxt))


def search(f: Features, rule: Rule, max_positives: int = 64, queries=None,
           block_size: int = 8192, query_block: int = 1024, device: str = "cpu") -> Positives:
    """Every positive text of each query image against every text, blockwise (bounded memory)."""
    q_all = np.arange(len(f.img)) if queries is None else np.asarray(queries, dtype=np.int64)
    owner = None if f.owner is None else torch.as_tensor(f.owner, device=device)
    parts = []
    with torch.no_grad():
        for q0 in range(0, len(q_all), query_block):
            q = torch.as_tensor(q_all[q0:q0 + query_block], device=device)
            best = _Best(len(q), max_positives, device)
            for t0 in range(0, f.m, block_size):
                t1 = min(f.m, t0 + block_size)
                own = None if owner is None else owner[t0:t1]
                code, score = _block(f, rule, q, t0, t1, own)
                if own is None:                                # not its own positive
                    mine = ((q >= t0) & (q < t1)).nonzero().flatten()
                    code[mine, q[mine] - t0] = -1
                else:                                          # nor are its own captions
                    code.masked_fill_(own[None, :] == q[:, None], -1)
                t = torch.arange(t0, t1, device=device).expand(len(q), -1)
                best.add(rank_key(code, score), t, code, score)
            parts.append(best.result(f))
    return Positives.concat(parts, max_positives)


def exact_positives(img, txt, rule: Rule, max_positives: int = 64,
                    queries: Optional[np.ndarray] = None, ximg=None, xtxt=None,
                    block_size: int = 8192, query_block: int = 1024,
                    device: str = "cpu", owner=None, number=None) -> Positives:
    """``search`` on ``features(...)``: (img, txt) HELIP's unimodal vectors, (ximg, xtxt) the
    cross-modal ones (needed when rule.cross; ``owner``/``number``: sec. 4.3 caption groups)."""
    f = features(img, txt, rule, ximg, xtxt, owner, number, device)
    return search(f, rule, max_positives, queries, block_size, query_block, device)


# --- approximate, at scale -------------------------------------------------------------------------
def index_sources(f: Features) -> dict[str, tuple[Any, Any, bool]]:
    """name -> (indexed vectors, query vectors, hits are texts) of each per-modality index: a
    positive needs one high similarity, so it is a near neighbour in that one space."""
    out = {"image": (f.img, f.img, False), "text": (f.txt, f.txt, False)}
    if f.ximg is not None:
        out["cross"] = (f.xtxt, f.ximg, f.owner is not None)
    if f.dimg is not None:
        out["dup_image"] = (f.dimg, f.dimg, False)
        out["dup_text"] = (f.dtxt, f.dtxt, False)
    return out


class Candidates:
    """Exact Eq. 1 over given candidate images: every text of each (sec. 4.3: its caption and
    recaptions), the rule on exact dots (FAISS by-index inner products on the CPU, gather + bmm
    on a GPU). ``count`` is the positives among the candidates: every positive, when the
    candidates hold them all (the hpm pass's pairs, exhaustive, floors below the thresholds)."""

    def __init__(self, f: Features, device: str = "cpu") -> None:
        self.device = device

        def keep(x):                             # CPU: FAISS reads them in place (memmaps)
            if x is None or (device == "cpu" and isinstance(x, Gathered)):
                return x
            if device == "cpu":
                return np.ascontiguousarray(x, np.float32)
            return as_tensor(np.asarray(x) if isinstance(x, Gathered) else x, device)
        self.f = Features(*(keep(getattr(f, k)) for k in ("img", "txt", "dimg", "dtxt", "ximg",
                                                          "xtxt")), f.owner, f.number)
        n = len(f.img)
        self.first = (np.arange(n + 1) if f.owner is None else
                      np.searchsorted(f.owner, np.arange(n + 1))).astype(np.int64)
        self.k = int(np.diff(self.first).max()) if n else 1

    def _rows(self, base, idx: np.ndarray) -> np.ndarray:
        x = base[idx] if self.device == "cpu" else base[torch.as_tensor(idx, device=self.device)]
        return x if self.device == "cpu" else x.cpu().numpy()

    def texts(self, qidx: np.ndarray, c: np.ndarray) -> np.ndarray:
        """[q, C] candidate images (-1: none; repeats and the query itself dropped) -> [q, C*k]
        their texts, ascending (-1 last)."""
        c = np.sort(c, axis=1)
        repeat = np.zeros(c.shape, bool)
        repeat[:, 1:] = c[:, 1:] == c[:, :-1]
        c = np.where((c >= 0) & ~repeat & (c != qidx[:, None]), c, -1)
        start, size = self.first[np.maximum(c, 0)], np.diff(self.first)[np.maximum(c, 0)]
        j = np.arange(self.k)
        t = np.where((c[:, :, None] >= 0) & (j < size[:, :, None]), start[:, :, None] + j, -1)
        return _ascending(t.reshape(len(c), c.shape[1] * self.k))

    def score(self, qidx: np.ndarray, c: np.ndarray, rule: Rule, max_positives: int
              ) -> Positives:
        """Positives of the query images ``qidx`` among candidate images ``c`` [q, C]."""
        t = self.texts(qidx, c)
        f, dev = self.f, self.device
        img_of = t if f.owner is None else np.where(t >= 0, f.owner[np.maximum(t, 0)], -1)

        def per_image(a):
            return None if a is None else gather_dots(self._rows(a, qidx), *_by_index(a, img_of),
                                                      dev)
        sit = (gather_dots(self._rows(f.ximg, qidx), *_by_index(f.xtxt, t), dev) if rule.cross
               else None)
        code, score = relate(per_image(f.img), per_image(f.txt), sit, rule, per_image(f.dimg),
                             per_image(f.dtxt))
        code.masked_fill_(torch.as_tensor(t < 0, device=code.device), -1)
        best = _Best(len(qidx), max_positives, dev)
        best.add(rank_key(code, score), torch.as_tensor(np.maximum(t, 0), device=dev), code,
                 score)
        return best.result(f)


def _by_index(a, ids: np.ndarray) -> tuple:
    """(array, ids) for gather_dots: a Gathered array's base, with the ids mapped to it."""
    return (a.base, a.ids(ids)) if isinstance(a, Gathered) else (a, ids)


def _ascending(t: np.ndarray) -> np.ndarray:
    """Each row's texts ascending, the -1 padding last."""
    big = np.iinfo(np.int64).max
    s = np.sort(np.where(t >= 0, t, big), axis=1)
    return np.where(s == big, -1, s)


class FastPositives(Candidates):
    """Approximate positives at scale, without the hpm pass's pairs (hpm.method fast): an IVF-PQ
    index per space (``index_sources``), the union of each target's k' candidate images from
    each, then the exact rule on them (``count`` is then a lower bound)."""

    def __init__(self, indexes: dict, f: Features, device: str = "cpu") -> None:
        super().__init__(f, device)
        self.indexes = indexes                   # name -> faiss index

    @staticmethod
    def build(f: Features, params: dict[str, IvfParams], seed: int = 0) -> dict:
        return {name: build_ivfpq(np.asarray(base, np.float32), params[name], seed)
                for name, (base, _, _) in index_sources(f).items()}

    def query(self, qidx: np.ndarray, rule: Rule, max_positives: int = 64, k_prime: int = 64,
              block: int = 2048) -> Positives:
        qidx = np.asarray(qidx, np.int64)
        return Positives.concat([self.score(q, self._candidates(q, k_prime), rule, max_positives)
                                 for q in (qidx[a:a + block] for a in range(0, len(qidx), block))],
                                max_positives)

    def _candidates(self, qidx: np.ndarray, k_prime: int) -> np.ndarray:
        """[q, C] candidate images: each index's k' hits (a text hit: its image)."""
        cands = []
        for name, (_, query, texts) in index_sources(self.f).items():
            index = self.indexes[name]
            hit = index.search(self._rows(query, qidx), min(k_prime, index.ntotal))[1]
            cands.append(np.where(hit >= 0, self.f.owner[np.maximum(hit, 0)], -1) if texts else hit)
        return np.concatenate(cands, 1)
