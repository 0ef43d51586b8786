"""Batch composition: HELIP hard pairs (Alg. 3), FFF batch text augmentation and positives
(sec. 4.1-4.3), CLIP-C composites. Produces tensors plus the index/masks the losses take."""
from __future__ import annotations

import queue
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from .data import A, Sample, ShardSet, composite, key_int, load_rgb, to_tensor


@dataclass
class Batch:
    pixels: torch.Tensor           # [n_img, 3, S, S]
    input_ids: torch.Tensor        # [n_txt, L]
    attention_mask: torch.Tensor   # [n_txt, L]
    caption_col: torch.Tensor      # [n_img] the column of each image's own caption
    text_owner: torch.Tensor       # [n_txt] the image row each text belongs to
    image_keys: torch.Tensor       # [n_img] int64 sample-id keys (same sample = same key)
    pos_mask: torch.Tensor         # [n_img, n_txt] FFF's M: own texts + mined positives' texts
    hard_index: torch.Tensor       # [n_img, p] image rows of each seed's hard pairs, -1 pad
    obj_index: torch.Tensor        # [n_img, k] concept targets (-1 pad) and their probabilities
    obj_value: torch.Tensor
    attr_index: torch.Tensor
    attr_value: torch.Tensor
    n_hard_added: int = 0
    n_composites: int = 0


def _targets(metas: list[dict], ids: str, probs: str) -> tuple[torch.Tensor, torch.Tensor]:
    k = max([len(m.get(ids) or []) for m in metas] + [1])
    index = torch.full((len(metas), k), -1, dtype=torch.long)
    value = torch.zeros((len(metas), k))
    for i, m in enumerate(metas):
        got_i, got_v = m.get(ids) or [], m.get(probs) or []
        index[i, :len(got_i)] = torch.tensor(got_i, dtype=torch.long)
        value[i, :len(got_v)] = torch.tensor(got_v, dtype=torch.float32)
    return index, value


class Composer:
    def __init__(self, cfg: Any, shards: ShardSet, tokenizer: Any, image_size: int,
                 mean: tuple, std: tuple, decode_threads: int = 4) -> None:
        self.cfg, self.shards, self.tok = cfg, shards, tokenizer
        self.size, self.mean, self.std = image_size, mean, std
        self.pool = ThreadPoolExecutor(decode_threads)

    def helip(self, samples: list[Sample], rng: random.Random) -> tuple[list[Sample], list[list[int]]]:
        """B-bar = B + the p hard pairs of each seed in B' (HELIP Alg. 3; p sampled i.i.d. from
        the seed's mined hard set H*_i, as the algorithm says, so a pair may repeat)."""
        c = self.cfg
        hard: list[list[int]] = [[] for _ in samples]
        if c.loss != "helip":
            return samples, hard
        n_seeds = round(len(samples) * c.helip_seed_fraction)
        out = list(samples)
        for i in sorted(rng.sample(range(len(samples)), n_seeds)):
            pool = samples[i].meta.get(A.hard_ids) or []
            for hid in ([rng.choice(pool) for _ in range(c.helip_p)] if pool else []):
                got = self.shards.fetch(hid)
                if got is not None:
                    hard[i].append(len(out))
                    out.append(got)
        hard += [[] for _ in range(len(out) - len(samples))]
        return out, hard

    def __call__(self, samples: list[Sample], rng: random.Random, train: bool = True) -> Batch:
        c = self.cfg
        samples, hard = self.helip(samples, rng) if train else (samples, [[] for _ in samples])
        n_hard = sum(len(h) for h in hard)
        # decode in threads (PIL releases the GIL); everything random stays sequential below
        images = list(self.pool.map(lambda s: load_rgb(s.image, self.size), samples))
        captions = [s.caption for s in samples]
        metas = [dict(s.meta) for s in samples]
        keys = [key_int(s.key) for s in samples]
        n_comp = 0
        if train and c.clipc_fraction > 0 and len(samples) > 1:
            # CLIP-C: a fraction of the (non-HELIP) rows become composites of two instances
            for i in range(len(samples)):
                if hard[i] or rng.random() >= c.clipc_fraction:
                    continue
                j = rng.choice([x for x in range(len(samples)) if x != i])
                images[i] = composite(images[i], images[j], self.size)
                captions[i] = f"{captions[i]} and {captions[j]}"
                metas[i] = {}
                keys[i] = key_int(f"{samples[i].key}+{samples[j].key}")
                n_comp += 1
        pixels = torch.stack([to_tensor(im, self.size, self.mean, self.std, rng if train else None)
                              for im in images])
        texts, owner, caption_col = [], [], []
        for i, cap in enumerate(captions):
            caption_col.append(len(texts))
            texts.append(cap)
            owner.append(i)
            if train and c.fff_recaptions:          # FFF: every recaption is a positive too
                for r in (metas[i].get(A.recaptions) or [])[: c.fff_recaptions]:
                    texts.append(r)
                    owner.append(i)
        tok = self.tok(texts, padding="max_length", truncation=True,
                       max_length=self.tok.model_max_length, return_tensors="pt")
        owner_t = torch.tensor(owner)
        pos = owner_t[None, :] == torch.arange(len(samples))[:, None]
        if train and c.fff_mined_positives:        # FFF Eq. 1 positives mined by the pipeline
            where = {s.key: i for i, s in enumerate(samples)}
            for i, m in enumerate(metas):
                for pid in m.get(A.positive_ids) or []:
                    j = where.get(pid)
                    if j is not None:
                        pos[i] |= owner_t == j
                        pos[j] |= owner_t == i
        p = max([len(h) for h in hard] + [1])
        hard_index = torch.full((len(samples), p), -1, dtype=torch.long)
        for i, h in enumerate(hard):
            hard_index[i, :len(h)] = torch.tensor(h, dtype=torch.long)
        oi, ov = _targets(metas, A.object_ids, A.object_probs)
        ai, av = _targets(metas, A.attribute_ids, A.attribute_probs)
        return Batch(pixels, tok["input_ids"], tok["attention_mask"], torch.tensor(caption_col),
                     owner_t, torch.tensor(keys, dtype=torch.long), pos, hard_index, oi, ov, ai, av,
                     n_hard, n_comp)


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


__all__ = ["Batch", "Composer", "batches", "prefetch", "step_rng"]
