"""Batch composition: HELIP hard pairs (Alg. 3), FFF batch text augmentation and positives
(sec. 4.1-4.3), UniCLIP's augmented views and positive sets (sec. 2.2), CLIP-C composites.
Produces tensors plus the index/masks the losses take."""
from __future__ import annotations

import queue
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import torch

from vlcurate.schemas import mining as MI

from .data import LAYOUTS, Sample, ShardSet, composite, key_int, load_rgb, to_tensor
from .fields import A


# mined positives (schemas/mining.py relations) -> the UniCLIP domains they join: every relation
# is an image-text positive (FFF Eq. 1's M[i, j]: image i, the texts of j); S_ii-based ones also
# join the two images, S_tt-based ones the two caption groups (FFF sec. 4.3 compares caption
# groups); a HELIP duplicate is both. S_it (``cross``) stays image-text only.
IMAGE_RELATIONS = frozenset({MI.REL_DUPLICATE, MI.REL_IMAGE})
TEXT_RELATIONS = frozenset({MI.REL_DUPLICATE, MI.REL_TEXT})


@dataclass
class Batch:
    pixels: torch.Tensor           # [n_img, 3, S, S], n_img = views * n: view v of row i at v*n+i
    input_ids: torch.Tensor        # [n_txt, L]
    attention_mask: torch.Tensor   # [n_txt, L]
    caption_col: torch.Tensor      # [n] the column of each row's own caption
    text_owner: torch.Tensor       # [n_txt] the sample row each text belongs to
    image_keys: torch.Tensor       # [n_img] int64 sample-id keys (same sample = same key)
    pos_mask: torch.Tensor         # [n_img, n_txt] FFF's M: own texts + mined positives' texts
    image_pos: torch.Tensor        # [n_img, n_img] views of one row + mined image-image positives
    text_pos: torch.Tensor         # [n_txt, n_txt] texts of one row + mined text-text positives
    hard_index: torch.Tensor       # [n, p] image rows of each seed's hard pairs, -1 pad
    obj_index: torch.Tensor        # [n_img, k] concept targets (-1 pad) and their probabilities
    obj_value: torch.Tensor
    attr_index: torch.Tensor
    attr_value: torch.Tensor
    group_keys: torch.Tensor = None  # [n_img] each row's image group (rows of one image share it)
    n_hard_added: int = 0
    n_composites: int = 0
    n_views: int = 1
    # a locked tower's precomputed features (features.py): then ``pixels`` / ``input_ids`` hold
    # only the ``*_live`` rows (composites), which the tower embeds in the step
    image_feats: Optional[torch.Tensor] = None     # [n_img, d_image]
    image_live: Optional[torch.Tensor] = None      # rows of image_feats that ``pixels`` fill
    text_feats: Optional[torch.Tensor] = None      # [n_txt, d_text]
    text_live: Optional[torch.Tensor] = None       # rows of text_feats that ``input_ids`` fill

    @property
    def n_images(self) -> int:
        return int(self.image_keys.shape[0])


def _targets(metas: list[dict], ids: str, probs: str, n_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = max([len(m.get(ids) or []) for m in metas] + [1])
    index = torch.full((len(metas), k), -1, dtype=torch.long)
    value = torch.zeros((len(metas), k))
    for i, m in enumerate(metas):
        got_i, got_v = m.get(ids) or [], m.get(probs) or []
        if got_i and max(got_i) >= n_classes:
            raise ValueError(f"{ids}: concept id {max(got_i)} does not fit a head of {n_classes} "
                             "classes; set finetune.n_objects / n_attributes to the vocabulary "
                             "sizes (<run>/concepts/vocab.parquet)")
        index[i, :len(got_i)] = torch.tensor(got_i, dtype=torch.long)
        value[i, :len(got_v)] = torch.tensor(got_v, dtype=torch.float32)
    return index, value


def hard_negatives(meta: dict, group_of: Any = None, group: int = -1) -> list[str]:
    """A sample's mined hard pairs, less its mined positives (its twin is never its negative)
    and less the rows of its own image group (``group_of(id)``: another caption of its image)."""
    positives = set(meta.get(A.positive_ids) or [])
    return [h for h in meta.get(A.hard_ids) or [] if h not in positives
            and (group_of is None or group_of(h) != group)]


def positive_masks(keys: list[str], metas: list[dict], owner: torch.Tensor, skip: set[int],
                   mined: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(image-text [n, n_txt], image-image [n, n], text-text [n_txt, n_txt]) positives of the
    batch's rows: each row's own texts (caption and recaptions, positives of each other), and,
    with ``mined``, the positives the pipeline listed for it (rows in ``skip``, the composites,
    are not the samples their key names). Image-text stays directional (row i lists M[i, j]);
    image-image and text-text relations are symmetric similarities."""
    n = len(keys)
    own = owner[None, :] == torch.arange(n)[:, None]                  # [n, n_txt]
    it, ii = own.clone(), torch.eye(n, dtype=torch.bool)
    tt = owner[:, None] == owner[None, :]
    if mined:
        where = {k: i for i, k in enumerate(keys) if i not in skip}
        for i, m in enumerate(metas):
            ids = m.get(A.positive_ids) or []
            rels = m.get(A.positive_relations) or [None] * len(ids)
            for pid, rel in zip(ids, rels):
                j = where.get(pid)
                if j is None or j == i:
                    continue
                it[i] |= own[j]
                if rel in IMAGE_RELATIONS:
                    ii[i, j] = ii[j, i] = True
                if rel in TEXT_RELATIONS:
                    tt |= (own[i][:, None] & own[j][None, :]) | (own[j][:, None] & own[i][None, :])
    return it, ii, tt


def tokenize(tok: Any, texts: list[str], padding: str, max_length: int) -> dict:
    """``{input_ids, attention_mask}`` of ``texts`` (an empty list: [0, 1] tensors)."""
    if not texts:
        return {"input_ids": torch.zeros(0, 1, dtype=torch.long),
                "attention_mask": torch.zeros(0, 1, dtype=torch.long)}
    out = tok(texts, padding=padding, truncation=True, max_length=max_length, return_tensors="pt")
    return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"]}


class Composer:
    """Builds a step's ``Batch`` from streamed samples. ``store``: a locked tower's precomputed
    features (``features.FeatureStore``); rows it holds are looked up, never decoded or
    tokenised. ``padding``/``max_length``: the tokeniser's (CLIP: its fixed context)."""

    def __init__(self, cfg: Any, shards: ShardSet, tokenizer: Any, image_size: int,
                 mean: tuple, std: tuple, decode_threads: int = 4, store: Any = None,
                 padding: str = "max_length", max_length: Optional[int] = None) -> None:
        self.cfg, self.shards, self.tok = cfg, shards, tokenizer
        self.size, self.mean, self.std = image_size, mean, std
        self.pool = ThreadPoolExecutor(decode_threads)
        self.store, self.padding = store, padding
        self.max_length = max_length or tokenizer.model_max_length

    def tokenize(self, texts: list[str]) -> dict:
        return tokenize(self.tok, texts, self.padding, self.max_length)

    def helip(self, samples: list[Sample], rng: random.Random) -> tuple[list[Sample], list[list[int]]]:
        """B-bar = B + the p hard pairs of each seed in B' (HELIP Alg. 3; p sampled i.i.d. from
        the seed's mined hard set H*_i, as the algorithm says, so a pair may repeat). A pair the
        pipeline also listed as a positive of the seed (an FFF relation, a near-duplicate twin)
        is never drawn as its hard negative."""
        c = self.cfg
        hard: list[list[int]] = [[] for _ in samples]
        if c.loss != "helip":
            return samples, hard
        n_seeds = round(len(samples) * c.helip_seed_fraction)
        out = list(samples)
        picks: list[tuple[int, str]] = []            # (seed row, hard pair id), drawn in order
        for i in sorted(rng.sample(range(len(samples)), n_seeds)):
            pool = hard_negatives(samples[i].meta, self.shards.group_of, samples[i].group)
            picks += [(i, rng.choice(pool)) for _ in range(c.helip_p)] if pool else []
        for (i, _), got in zip(picks, self.shards.fetch_many([h for _, h in picks])):
            if got is not None:                      # random access, the reads overlapping
                hard[i].append(len(out))
                out.append(got)
        hard += [[] for _ in range(len(out) - len(samples))]
        return out, hard

    def composites(self, captions: list[str], metas: list[dict], keys: list[str],
                   hard: list[list[int]], rng: random.Random) -> dict[int, tuple[int, str]]:
        """CLIP-C: a fraction of the rows become composites of two instances; returns ``{row:
        (partner, layout)}`` (``images`` joins the pixels) and rewrites their captions, metas and
        keys in place. The partner is always an *original* sample: its image and caption as
        loaded, never a composite made earlier in the batch (CLIP-C joins "two distinct instances
        in the dataset"). HELIP seeds and their hard pairs stay originals. The layout, side by
        side or stacked, is drawn per composite (CLIP-C: "(S/2 x S) or (S x S/2)")."""
        c = self.cfg
        n = len(captions)
        if c.clipc_fraction <= 0 or n < 2:
            return {}
        helip_rows = {i for i, h in enumerate(hard) if h} | {j for h in hard for j in h}
        orig_captions, orig_keys = list(captions), list(keys)
        made: dict[int, tuple[int, str]] = {}
        for i in range(n):
            if i in helip_rows or rng.random() >= c.clipc_fraction:
                continue
            j = rng.choice([x for x in range(n) if x != i])
            made[i] = (j, rng.choice(LAYOUTS))
            captions[i] = f"{orig_captions[i]} and {orig_captions[j]}"
            metas[i] = {}
            keys[i] = f"{orig_keys[i]}+{orig_keys[j]}"
        return made

    def images(self, samples: list[Sample], made: dict[int, tuple[int, str]],
               live: list[int]) -> list:
        """The decoded images of the ``live`` rows (composites joined from the originals); the
        other rows are not decoded (their features are precomputed). Decoding runs in threads
        (PIL releases the GIL)."""
        need = sorted(set(live) | {j for i in live if i in made for j in (i, made[i][0])})
        got = dict(zip(need, self.pool.map(lambda i: load_rgb(samples[i].image, self.size), need)))
        return [composite(got[i], got[made[i][0]], self.size, made[i][1]) if i in made else got[i]
                for i in live]

    def texts(self, captions: list[str], metas: list[dict], train: bool) -> tuple[list, list, list]:
        """Every text of the batch: each row's caption, then (FFF batch text augmentation, sec.
        4.2) up to ``fff_recaptions`` of its recaptions; their owner rows and caption columns."""
        c = self.cfg
        texts, owner, caption_col = [], [], []
        extra = c.fff_recaptions if train and c.loss in ("sigmoid", "mp_nce") else 0
        for i, cap in enumerate(captions):
            caption_col.append(len(texts))
            texts.append(cap)
            owner.append(i)
            for r in (metas[i].get(A.recaptions) or [])[:extra]:
                texts.append(r)
                owner.append(i)
        return texts, owner, caption_col

    def __call__(self, samples: list[Sample], rng: random.Random, train: bool = True) -> Batch:
        c = self.cfg
        samples, hard = self.helip(samples, rng) if train else (samples, [[] for _ in samples])
        captions = [s.caption for s in samples]
        metas = [dict(s.meta) for s in samples]
        keys = [s.key for s in samples]
        made = self.composites(captions, metas, keys, hard, rng) if train else {}
        groups = [key_int(keys[i]) if i in made or s.group < 0 else s.group
                  for i, s in enumerate(samples)]        # a composite is a group of its own
        views = c.mp_views if train and c.loss == "mp_nce" else 1      # UniCLIP's augmented views
        image_feats, live = self.cached_images(samples, made)
        aug = rng if train and image_feats is None else None           # cached: eval transform
        ims = self.images(samples, made, live)
        pixels = torch.stack([to_tensor(im, self.size, self.mean, self.std, aug)
                              for _ in range(views) for im in ims]) \
            if live else torch.zeros(0, 3, self.size, self.size)
        texts, owner, caption_col = self.texts(captions, metas, train)
        text_feats, text_live = self.cached_texts(texts)
        tok = self.tokenize([texts[t] for t in text_live])
        owner_t = torch.tensor(owner)
        mined = train and c.fff_mined_positives and c.loss in ("sigmoid", "mp_nce")
        it, ii, tt = positive_masks(keys, metas, owner_t, set(made), mined)
        p = max([len(h) for h in hard] + [1])
        hard_index = torch.full((len(samples), p), -1, dtype=torch.long)
        for i, h in enumerate(hard):
            hard_index[i, :len(h)] = torch.tensor(h, dtype=torch.long)
        concepts = metas if c.concept_weight else [{}] * len(metas)     # read only when trained
        oi, ov = _targets(concepts, A.object_ids, A.object_probs, c.n_objects)
        ai, av = _targets(concepts, A.attribute_ids, A.attribute_probs, c.n_attributes)
        rep = (lambda t: t.repeat(views, 1))                             # views share targets
        return Batch(pixels, tok["input_ids"], tok["attention_mask"], torch.tensor(caption_col),
                     owner_t, torch.tensor([key_int(k) for k in keys] * views, dtype=torch.long),
                     rep(it), ii.repeat(views, views), tt, hard_index, rep(oi), rep(ov), rep(ai),
                     rep(av), torch.tensor(groups * views, dtype=torch.long),
                     sum(len(h) for h in hard), len(made), views, image_feats,
                     None if image_feats is None else torch.tensor(live, dtype=torch.long),
                     text_feats,
                     None if text_feats is None else torch.tensor(text_live, dtype=torch.long))

    def cached_images(self, samples: list[Sample], made: dict) -> tuple[Optional[torch.Tensor], list[int]]:
        """(precomputed features of the rows, zeros for the composites; the rows to decode)."""
        store = self.store
        if store is None or store.image is None:
            return None, list(range(len(samples)))
        rows = [-1 if i in made else store.image_row[s.key] for i, s in enumerate(samples)]
        feats = store.image[torch.tensor(rows).clamp(min=0)]
        live = [i for i, r in enumerate(rows) if r < 0]
        feats[live] = 0.0
        return feats, live

    def cached_texts(self, texts: list[str]) -> tuple[Optional[torch.Tensor], list[int]]:
        """(precomputed features of the texts, zeros for new ones; the texts to tokenise)."""
        store = self.store
        if store is None or store.text is None:
            return None, list(range(len(texts)))
        rows = [store.text_row.get(t, -1) for t in texts]
        feats = store.text[torch.tensor(rows, dtype=torch.long).clamp(min=0)]
        live = [i for i, r in enumerate(rows) if r < 0]
        feats[live] = 0.0
        return feats, live


def step_rng(seed: int, epoch: int, step: int, rank: int) -> random.Random:
    return random.Random(f"{seed}/{epoch}/{step}/{rank}")


def batches(shards: ShardSet, composer: Composer, *, batch_size: int, seed: int, rank: int,
            world: int, start_epoch: int = 0, start_step: int = 0,
            buffer: int = 256) -> Any:
    """Yields (epoch, step_in_epoch, Batch) forever, from (start_epoch, start_step) on; every rank
    yields the same number of batches per epoch."""
    per_epoch = (len(shards) // world) // batch_size
    if per_epoch == 0:
        raise ValueError(f"{len(shards)} samples over {world} ranks cannot fill one batch of "
                         f"{batch_size}")
    epoch, step = start_epoch, start_step
    while True:
        it = shards.stream(epoch=epoch, seed=seed, rank=rank, world=world, buffer=buffer,
                           skip=step * batch_size)
        while step < per_epoch:
            chunk = [next(it) for _ in range(batch_size)]
            yield epoch, step, composer(chunk, step_rng(seed, epoch, step, rank))
            step += 1
        epoch, step = epoch + 1, 0


def prefetch(gen: Any, depth: int = 2) -> Any:
    """Run a batch generator ``depth`` batches ahead in a thread (decode overlaps the step)."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def fill() -> None:
        try:
            for item in gen:
                q.put(item)
        except BaseException as e:  # surface loader errors in the training loop
            q.put(e)
        q.put(done)

    threading.Thread(target=fill, daemon=True).start()
    while True:
        item = q.get()
        if item is done:
            return
        if isinstance(item, BaseException):
            raise item
        yield item


__all__ = ["Batch", "Composer", "tokenize", "batches", "prefetch", "step_rng"]
