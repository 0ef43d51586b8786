"""A fingerprinted ``finetune.out_dir``: a checkpoint resumes only under the config that wrote it.

``<out_dir>/config.json`` records the training config and its fingerprint. Another training config
is refused with one sentence naming what changed (never a crash loading the optimiser state of
another loss); the same config resumes exactly.

In the fingerprint: every ``finetune.*`` setting that changes what is trained, the world size (the
batch size is per rank, so the number of processes sets the global batch and each rank's data) and
the digest of the shards' ``manifest.json`` (the data, wherever it lives). Out: ``steps`` (a run
is extended by raising it), ``ckpt_every`` (resume is exact from any checkpoint),
``eval_batch_size`` and ``progress`` (speed and display), and the ``shards``/``out_dir`` paths.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from vlcurate.foundation import storage
from vlcurate.foundation.params import to_dict

from .index import MANIFEST

NOT_FINGERPRINTED = ("steps", "ckpt_every", "eval_batch_size", "progress", "shards", "out_dir",
                     "nproc")
CONFIG_FILE = "config.json"
CHECKPOINT = "checkpoint.pt"


class OutDirInUse(ValueError):
    """``finetune.out_dir`` holds a run of another training config."""


def training_config(cfg: Any, shard_uri: str, world: int) -> dict:
    """What the fingerprint covers (see the module docstring)."""
    keep = {k: v for k, v in to_dict(cfg).items() if k not in NOT_FINGERPRINTED}
    manifest = hashlib.sha256(storage.read_bytes(storage.join(str(shard_uri), MANIFEST)))
    return {**keep, "world_size": world, "shards_manifest": manifest.hexdigest()[:16]}


def fingerprint(training: dict) -> str:
    return hashlib.sha256(json.dumps(training, sort_keys=True).encode()).hexdigest()[:16]


def _changes(old: dict, new: dict) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {json.dumps(old.get(k))} -> {json.dumps(new.get(k))}" for k in keys)


def check_out_dir(cfg: Any, shard_uri: str, out_uri: str, world: int, write: bool) -> str:
    """Refuse an ``out_uri`` (a path or URI) that holds another training config's run
    (``OutDirInUse``); with ``write``, record this config there (one atomic write). Returns the
    fingerprint. Messages name the out_dir redacted (``storage.redact``)."""
    training = training_config(cfg, shard_uri, world)
    fp = fingerprint(training)
    out, shown = str(out_uri), storage.redact(str(out_uri))
    old = storage.read_json(storage.join(out, CONFIG_FILE))
    if old is not None:
        if old["fingerprint"] != fp:
            raise OutDirInUse(
                f"finetune.out_dir {shown} holds a run of another training config "
                f"({_changes(old['training'], training)}); resuming needs the same one: set a new "
                f"finetune.out_dir, or delete {shown} to start over")
    elif storage.exists(storage.join(out, CHECKPOINT)):
        raise OutDirInUse(f"finetune.out_dir {shown} holds a checkpoint with no {CONFIG_FILE} "
                          "(an older trainer's): set a new finetune.out_dir, or delete it")
    if write and old is None:
        storage.write_bytes(storage.join(out, CONFIG_FILE), json.dumps(
            {"fingerprint": fp, "training": training}, indent=1, sort_keys=True).encode())
    return fp
