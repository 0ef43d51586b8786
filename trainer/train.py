"""The thin DDP trainer: run under torchrun (gloo on CPU, nccl on GPU; AMP on GPU).

Each step gathers the embeddings of every rank with gradients and computes the configured loss on
the global batch (the same value on every rank); DDP then averages the gradients, which gives the
gradient of the global loss (see distributed.gather_with_grad). Checkpoints hold the model,
optimiser, step and data position; a resumed run replays exactly the batches it would have seen.

``finetune.out_dir`` may be a URI: every file there (checkpoint, ``log.jsonl``,
``eval.json``, ``params-rank<r>.json``) is written as finished bytes in one atomic write through
``foundation.storage`` (one PUT on an object store, a rename locally), never appended or renamed, so
a reader never sees half a checkpoint. The log is therefore kept in memory and rewritten whole
(``StepLog``) at each checkpoint, at most every ``StepLog.every_s`` seconds, and at the end.
"""
from __future__ import annotations

import functools
import io
import json
import os
import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from vlcurate.foundation import storage
from vlcurate.foundation import models

from . import distributed as D
from . import losses as L
from .compose import Batch, Composer, batches, prefetch, step_rng, tokenize
from .data import ShardSet
from .encoder import embed_images, embed_texts, save_encoder
from .evalset import image_retrieval, load_eval_set
from .features import FeatureStore, build_store, check as check_features, locked_eval
from .fields import require, require_rows
from .model import LossHeads, TowerEncoder
from .outdir import CHECKPOINT, OutDirInUse, check_out_dir
from .towers import Built, build, describe

LOSSES = ("clip", "helip", "hn_nce", "sigmoid", "mp_nce")


def model_inputs(b: Batch) -> tuple:
    """The model's arguments from a batch (precomputed features of locked towers included)."""
    return (b.pixels, b.input_ids, b.attention_mask, b.image_feats, b.image_live, b.text_feats,
            b.text_live)


def device_spec(cfg: Any) -> tuple[str, str]:
    """(the device setting the trainer runs on, its config key): the CLIP's or the image
    tower's."""
    return (cfg.model.device, "finetune.model.device") if cfg.arch == "clip" else \
        (cfg.image_tower.device, "finetune.image_tower.device")


def loss_fn(cfg: Any, model: LossHeads, b: Batch, img: torch.Tensor, txt: torch.Tensor,
            obj: Optional[torch.Tensor], attr: Optional[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """The configured loss on the global batch (+ DiHT's concept distillation on local rows)."""
    gi, gt = D.gather_with_grad(img), D.gather_with_grad(txt)
    parts: dict[str, torch.Tensor] = {}
    if cfg.loss in ("clip", "helip", "hn_nce"):      # one caption per image: a square problem
        cap = D.globalize_index(b.caption_col[:, None], txt.shape[0])[:, 0]
        sq, ex = gt[cap], same_group(b)
        if cfg.loss == "clip":
            parts["clip"] = L.info_nce(gi, sq, model.logit_scale(), exclude=ex)
        elif cfg.loss == "helip":
            hard = D.globalize_index(b.hard_index, img.shape[0])
            parts["helip"] = L.helip_loss(gi, sq, model.logit_scale(), hard, gamma=cfg.helip_gamma,
                                          exclude=ex)
        else:
            parts["hn_nce"] = L.hn_nce(gi, sq, model.logit_scale(), cfg.hn_alpha, cfg.hn_beta,
                                       exclude=ex)
    elif cfg.loss == "sigmoid":                      # every text, FFF's positive matrix M
        parts["sigmoid"] = L.sigmoid_loss(gi, gt, model.sig_log_t.exp(), model.sig_bias,
                                          image_text_positives(b))
    else:                                            # UniCLIP: images and texts, one space
        pos, domains = mp_positives(b)
        parts["mp_nce"] = L.mp_nce(torch.cat([gi, gt]), domains, pos,
                                   L.pair_matrix(model.mp_log_scale.exp(), 2),
                                   L.pair_matrix(model.mp_offset, 2),
                                   mp_weights(cfg, pos, domains, gi.shape[0] // b.n_views))
    if cfg.concept_weight and obj is not None:
        parts["concepts"] = cfg.concept_weight * L.concept_distillation_loss(
            obj, b.obj_index, b.obj_value, attr, b.attr_index, b.attr_value)
    total = sum(parts.values())
    return total, {k: float(v.detach()) for k, v in parts.items()}


def same_group(b: Batch) -> torch.Tensor:
    """[n, n] on the global batch of a one-caption-per-row loss: rows of one image group (two
    captions of one image, wherever they landed), which the loss takes out of each other's
    negatives (the diagonal stays the positive)."""
    return D.global_key_mask(b.group_keys, b.group_keys)


def image_text_positives(b: Batch) -> torch.Tensor:
    """FFF's M on the global batch: an image and every text of its sample (by key, across ranks)
    and of its image group (another caption of the same image is a positive, never a negative),
    plus the mined positives the composer put in the local batch."""
    owner_keys, owner_groups = b.image_keys[b.text_owner], b.group_keys[b.text_owner]
    return D.global_key_mask(b.image_keys, owner_keys) | \
        D.global_key_mask(b.group_keys, owner_groups) | D.global_block_mask(b.pos_mask)


def mp_positives(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """UniCLIP's positive sets on the global unified batch ``[images; texts]`` (Eq. 12): the
    views of one image, its caption and recaptions are positives of each other (by key, across
    ranks), so are the rows of one image group, and so are the mined image-image, image-text and
    text-text positives."""
    owner_groups = b.group_keys[b.text_owner]
    ii = D.global_key_mask(b.group_keys, b.group_keys) | D.global_block_mask(b.image_pos)
    tt = D.global_key_mask(owner_groups, owner_groups) | D.global_block_mask(b.text_pos)
    return L.unified_positives(image_text_positives(b), ii, tt)


def negatives(cfg: Any, b: Batch) -> torch.Tensor:
    """The (image, text) pairs the configured loss treats as negatives, on the global batch
    (the square caption problem for clip/helip/hn_nce, every text for sigmoid and mp_nce)."""
    if cfg.loss in ("clip", "helip", "hn_nce"):
        return ~same_group(b)
    if cfg.loss == "sigmoid":
        return ~image_text_positives(b)
    pos, domains = mp_positives(b)
    n_img = int((domains == 0).sum())
    return ~pos[:n_img, n_img:]


def mp_weights(cfg: Any, pos: torch.Tensor, domains: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """w_D: fixed ``finetune.mp_domain_weights`` [ii, it, tt], or UniCLIP's rule on this batch."""
    if cfg.mp_domain_weights is not None:
        return L.pair_matrix(torch.tensor(cfg.mp_domain_weights, device=pos.device), 2)
    return L.mp_domain_weights(pos, domains, 2, n_pairs)


def _trainable(model: LossHeads, loss: str) -> None:
    """Loss parameters the configured loss does not use are frozen (DDP needs every used one)."""
    model.sig_log_t.requires_grad_(loss == "sigmoid")
    model.sig_bias.requires_grad_(loss == "sigmoid")
    model.mp_log_scale.requires_grad_(loss == "mp_nce")
    model.mp_offset.requires_grad_(loss == "mp_nce")
    model.scale_param().requires_grad_(loss in ("clip", "helip", "hn_nce"))


def _to(b: Batch, device: str) -> Batch:
    for k, v in vars(b).items():
        if isinstance(v, torch.Tensor):
            setattr(b, k, v.to(device, non_blocking=True))
    return b


@torch.no_grad()
def init_sigmoid_bias(cfg: Any, model: LossHeads, gen: Any, device: str) -> float:
    """FFF sec. 4.4: the bias minimising the initial loss on a few batches (same on all ranks)."""
    sims, masks = [], []
    for _ in range(cfg.bias_init_batches):
        _, _, b = next(gen)
        b = _to(b, device)
        img, txt, _, _ = model(*model_inputs(b))
        gi, gt = D.gather_no_grad(img), D.gather_no_grad(txt)
        sims.append(gi @ gt.T)
        masks.append(image_text_positives(b))
    return L.sigmoid_bias_init(sims, masks, float(model.sig_log_t.exp()))


@torch.no_grad()
def evaluate(model: LossHeads, shards: ShardSet, composer: Composer, device: str,
             batch_size: int = 64) -> dict:
    """Zero-shot retrieval on the held-out samples: R@1/5/10, image->text and text->image."""
    was = model.training
    model.eval()
    imgs, txts, groups = [], [], []
    chunk: list = []
    stream = shards.stream(epoch=0, seed=0, rank=0, world=1, buffer=1)
    for s in list(stream) + [None]:
        if s is not None:
            chunk.append(s)
        if chunk and (s is None or len(chunk) == batch_size):
            b = _to(composer(chunk, step_rng(0, 0, len(imgs), 0), train=False), device)
            img, txt, _, _ = model(*model_inputs(b))
            imgs.append(img.float().cpu())
            txts.append(txt.float().cpu())
            groups.append(b.group_keys.cpu())
            chunk = []
    model.train(was)
    return retrieval_metrics(torch.cat(imgs) @ torch.cat(txts).T, groups=torch.cat(groups)) \
        if imgs else {}


def retrieval_metrics(sim: torch.Tensor, ks: tuple[int, ...] = (1, 5, 10),
                      groups: Optional[torch.Tensor] = None) -> dict:
    """R@k both ways for a square similarity matrix whose diagonal holds the true pairs (a tie
    with the true match counts against it). With each row's image ``groups``, another caption
    of the same image never counts against the true one (it is a right answer too)."""
    truth = torch.arange(sim.shape[0])
    out: dict = {"n": int(sim.shape[0])}
    if groups is not None:
        other = (groups[:, None] == groups[None, :]) & ~torch.eye(len(groups), dtype=torch.bool)
        sim = sim.masked_fill(other, float("-inf"))
    for name, s in (("i2t", sim), ("t2i", sim.T)):
        beaten = (s >= s[truth, truth][:, None]).sum(1) - 1   # others at least as similar
        for k in ks:
            out[f"{name}_R@{k}"] = float((beaten < k).float().mean())
    return out


@dataclass
class Setup:
    """What ``train`` builds before its first step (tests build batches from it the same way)."""
    model: LossHeads
    shards: ShardSet
    train_set: ShardSet
    eval_set: ShardSet
    composer: Composer
    built: Optional[Built] = None
    store: Optional[FeatureStore] = None


def check_config(cfg: Any, shards: ShardSet) -> None:
    """Stop with a reason before training on annotations or settings that cannot work."""
    require(cfg, shards.first_meta(), storage.redact(shards.uri))
    require_rows(cfg, shards.missing(), storage.redact(shards.uri))
    if cfg.concept_weight and not (cfg.n_objects > 0 and cfg.n_attributes > 0):
        raise ValueError("finetune.concept_weight > 0 needs concept heads: set finetune.n_objects "
                         "and n_attributes to the vocabulary sizes (<run>/concepts/vocab.parquet)")
    if cfg.mp_views < 1:
        raise ValueError(f"finetune.mp_views must be >= 1, got {cfg.mp_views}")
    check_features(cfg)
    if cfg.mp_domain_weights is not None and len(cfg.mp_domain_weights) != 3:
        raise ValueError("finetune.mp_domain_weights: three values [image-image, image-text, "
                         f"text-text], got {list(cfg.mp_domain_weights)}")


def prepare(cfg: Any, shards_dir: str, device: str = "cpu", out: Optional[str] = None) -> Setup:
    """Model, shards, the locked towers' features (kept under ``out``) and the batch composer,
    after ``check_config``."""
    all_shards = ShardSet(shards_dir)
    check_config(cfg, all_shards)
    built = build(cfg)
    model = built.model.to(device)
    _trainable(model, cfg.loss)
    train_set, eval_set = all_shards.split(cfg.eval_fraction, cfg.eval_seed)
    tok = functools.partial(tokenize, built.tokenizer, padding=built.padding,
                            max_length=built.max_length)
    store = build_store(cfg, model, all_shards, built.image_size, built.mean, built.std, tok,
                        device, out)
    # hard pairs come from the training samples only: a held-out sample never enters a batch
    composer = Composer(cfg, train_set, built.tokenizer, built.image_size, built.mean, built.std,
                        store=store, padding=built.padding, max_length=built.max_length)
    return Setup(model, all_shards, train_set, eval_set, composer, built, store)


HELDOUT = "heldout.parquet"


def write_heldout(out: str, eval_set: ShardSet) -> None:
    """``<out_dir>/heldout.parquet``: the held-out sample ids (column ``sample_id``), so the
    evaluation can be reproduced and audited (one write: a PUT on an object store)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from vlcurate.schemas import F
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({F.SAMPLE_ID.name: pa.array(eval_set.sample_ids(), pa.string())}), buf)
    storage.write_bytes(storage.join(out, HELDOUT), buf.getvalue().to_pybytes())


class UnsafeCheckpoint(ValueError):
    """A checkpoint that holds more than tensors and plain containers."""


def load_checkpoint(uri: str | Path, device: str) -> dict:
    """``torch.load(weights_only=True)`` of the checkpoint's bytes (a path or URI: one read):
    checkpoints may come from elsewhere, and unpickling arbitrary objects runs
    arbitrary code. Anything else is refused with a reason."""
    try:
        return torch.load(io.BytesIO(storage.read_bytes(str(uri))), map_location=device,
                          weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpoint(
            f"{storage.redact(str(uri))}: refused: it holds objects other than tensors and plain containers, which "
            f"only a full unpickle (able to run code) could load. Trainer checkpoints never do; "
            f"delete it or point finetune.out_dir elsewhere. ({str(e).splitlines()[0]})") from e


def train(cfg: Any, shards_dir: str, out_dir: str, log=print) -> dict:
    rank, world = D.rank_world()
    device = models.resolve_device(*device_spec(cfg))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(cfg.seed)
    out = str(out_dir)
    check_out_dir(cfg, shards_dir, out, world, write=rank == 0)
    t_prep = time.time()
    setup = prepare(cfg, shards_dir, device, out)
    model, train_set = setup.model, setup.train_set
    if setup.store.image is not None or setup.store.text is not None:
        log(f"locked towers: {_store_size(setup.store)} in {time.time() - t_prep:.1f}s")
    if isinstance(model, TowerEncoder):
        model.train()           # unlocked towers train with dropout / batch statistics
    ddp = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=cfg.weight_decay)
    step, epoch, in_epoch = resume(storage.join(out, CHECKPOINT), model, opt, device, log)
    gen = prefetch(batches(train_set, setup.composer, batch_size=cfg.batch_size, seed=cfg.seed,
                           rank=rank, world=world, start_epoch=epoch, start_step=in_epoch,
                           buffer=cfg.shuffle_buffer))
    if cfg.loss == "sigmoid" and step == 0:
        init_gen = batches(train_set, setup.composer, batch_size=cfg.batch_size, seed=cfg.seed + 1,
                           rank=rank, world=world, buffer=cfg.shuffle_buffer)
        model.sig_bias.data.fill_(init_sigmoid_bias(cfg, model, init_gen, device))
        log(f"sigmoid bias initialised to {float(model.sig_bias.detach()):.3f}")
    log(f"train {len(train_set)} samples, held out {len(setup.eval_set)} "
        f"(finetune.eval_fraction {cfg.eval_fraction}, by image group)")
    if rank == 0:
        write_heldout(out, setup.eval_set)
        for line in require_rows(cfg, setup.shards.missing(), storage.redact(setup.shards.uri)):
            log(f"training on them anyway (finetune.allow_missing): {line}")
    logf = StepLog(out, step) if rank == 0 else None
    bar = progress_bar(cfg, step, world, enabled=rank == 0 and cfg.progress)
    t0 = time.time()
    while step < cfg.steps:
        epoch, in_epoch, b = next(gen)
        torch.manual_seed(step_rng(cfg.seed, epoch, in_epoch, rank).getrandbits(63))  # dropout
        loss, parts = train_step(cfg, model, ddp, opt, _to(b, device), device)
        step += 1
        if logf is not None:
            logf.add({"step": step, "epoch": epoch, "loss": loss, **parts,
                      "images": b.n_images * world, "hard_added": b.n_hard_added,
                      "composites": b.n_composites, "elapsed_s": round(time.time() - t0, 3)})
            bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
            bar.update(cfg.batch_size * world)
        if rank == 0 and (step % cfg.ckpt_every == 0 or step == cfg.steps):
            save(storage.join(out, CHECKPOINT), model, opt, step, epoch, in_epoch + 1,
                 _per_epoch(train_set, cfg, world))
            logf.flush()
    bar.close()
    return finish(cfg, setup, out, rank, step, device, log, logf)


def train_step(cfg: Any, model: LossHeads, ddp: Any, opt: Any, b: Batch,
               device: str) -> tuple[float, dict]:
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cfg.amp and device == "cuda"):
        img, txt, obj, attr = ddp(*model_inputs(b))
    loss, parts = loss_fn(cfg, model, b, img, txt, obj, attr)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach()), parts


def progress_bar(cfg: Any, step: int, world: int, enabled: bool, file: Any = None) -> Any:
    """Rank 0's bar in samples (global, every rank's seeds), so its rate reads samples/s; the
    postfix carries the last step's loss."""
    from tqdm import tqdm
    per_step = cfg.batch_size * world
    return tqdm(total=cfg.steps * per_step, initial=step * per_step, unit=" samples",
                desc="finetune", disable=not enabled, file=file or sys.stderr, dynamic_ncols=True)


def resume(ckpt: str, model: LossHeads, opt: Any, device: str, log: Any) -> tuple[int, int, int]:
    """(step, epoch, batch in epoch) of the checkpoint in ``out_dir``; (0, 0, 0) without one."""
    if not storage.exists(ckpt):
        return 0, 0, 0
    state = load_checkpoint(ckpt, device)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    step, epoch, in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
    log(f"resumed from step {step} (epoch {epoch}, batch {in_epoch})")
    return step, epoch, in_epoch


def save(ckpt: str, model: LossHeads, opt: Any, step: int, epoch: int, next_in_epoch: int,
         per_epoch: int) -> None:
    """The model, the optimiser and the position of the next batch, serialised in memory and
    written as finished bytes (``storage.write_bytes``: one PUT, or a rename locally)."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                "epoch": epoch if next_in_epoch < per_epoch else epoch + 1,
                "step_in_epoch": next_in_epoch % per_epoch}, buf)
    storage.write_bytes(ckpt, buf.getvalue())


class StepLog:
    """Rank 0's ``<out_dir>/log.jsonl``, one JSON line a step. An object store cannot append, so
    the lines are kept and the whole object is rewritten (``flush``). On resume from step ``s``
    the lines of steps <= s are kept: steps a crash logged past the checkpoint are redone."""
    every_s = 30.0

    def __init__(self, out: str, resumed_step: int) -> None:
        self.uri = storage.join(out, "log.jsonl")
        old = storage.read_bytes(self.uri).decode().splitlines() \
            if resumed_step and storage.exists(self.uri) else []
        self.lines = [x for x in old if x.strip() and json.loads(x)["step"] <= resumed_step]
        self.flushed = time.time()

    def add(self, record: dict) -> None:
        self.lines.append(json.dumps(record))
        if time.time() - self.flushed > self.every_s:
            self.flush()

    def flush(self) -> None:
        storage.write_bytes(self.uri, "".join(x + "\n" for x in self.lines).encode())
        self.flushed = time.time()

    def close(self) -> None:
        self.flush()


def finish(cfg: Any, setup: Setup, out: str, rank: int, step: int, device: str, log: Any,
           logf: Optional[StepLog]) -> dict:
    """A checksum of the parameters on every rank (DDP keeps them identical; this shows it), then
    on rank 0: the encoder (``encoder.json`` + ``encoder.pt``) and the retrieval on the held-out
    samples and on ``finetune.eval_data`` (``eval.json``)."""
    digest = float(sum(p.detach().double().sum() for p in setup.model.parameters()))
    storage.write_bytes(storage.join(out, f"params-rank{rank}.json"),
                        json.dumps({"step": step, "param_sum": digest}).encode())
    result: dict = {"steps": step}
    if rank == 0:
        save_encoder(out, describe(cfg, setup.built), setup.model, step)
        ev: dict = {}
        if len(setup.eval_set):
            ev = evaluate(setup.model, setup.eval_set, setup.composer, device, cfg.eval_batch_size)
        if cfg.eval_data:
            ev["eval_data"] = evaluate_data(cfg, setup, device, out)
        if ev:
            result["eval"] = ev
            storage.write_bytes(storage.join(out, "eval.json"), json.dumps(ev, indent=1).encode())
            log(f"eval: {ev}")
    if logf is not None:
        logf.close()
    return result


def evaluate_data(cfg: Any, setup: Setup, device: str, out_dir: Optional[str] = None) -> dict:
    """Retrieval R@1/5/10 both ways on ``finetune.eval_data``, over its distinct images, with
    the count of rows read and left out (by reason)."""
    es = load_eval_set(str(cfg.eval_data))
    out: dict = {"source": storage.redact(str(cfg.eval_data)), "rows": es.rows,
                 "rejected": dict(es.rejected)}
    if not es.images:
        return out
    model, b = setup.model, setup.built
    was = model.training
    model.eval()
    tok = setup.composer.tokenize
    fi, ft = locked_eval(cfg, model, es.images, es.captions, b.image_size, b.mean, b.std, tok,
                         device, out_dir)
    with torch.no_grad():
        img = embed_images(model, es.images, b.image_size, b.mean, b.std, device,
                           cfg.eval_batch_size) if fi is None else model.encode_image(None, fi)
        txt = embed_texts(model, tok, es.captions, device, cfg.eval_batch_size) if ft is None \
            else model.encode_text(None, None, ft)
    model.train(was)
    return {**out, **image_retrieval(img, txt, torch.tensor(es.owner))}


def _store_size(store: FeatureStore) -> str:
    parts = [f"{len(t)} distinct {name}" for name, t in (("images", store.image),
                                                          ("texts", store.text)) if t is not None]
    return ", ".join(parts) + " embedded once"


def _per_epoch(shards: ShardSet, cfg: Any, world: int) -> int:
    return (len(shards) // world) // cfg.batch_size


__all__ = ["train", "prepare", "check_config", "load_checkpoint", "UnsafeCheckpoint", "evaluate",
           "loss_fn", "mp_positives", "image_text_positives", "negatives", "same_group",
           "write_heldout", "retrieval_metrics", "LOSSES", "model_inputs", "device_spec",
           "evaluate_data",
           "progress_bar", "OutDirInUse"]
