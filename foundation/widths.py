"""Embedding widths from the models' configurations, never their weights: the driver computes
embed's output schema from these (no model loads on the driver). ``models.locate``
still runs, so missing weights fail here, before any actor starts."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Optional

from vlcurate.foundation import models

# sentence-transformers Pooling modes; the pooled width is the token width times the modes on
_POOL_MODES = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
               "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
               "pooling_mode_lasttoken")


def meta_timm(spec: Any) -> Any:
    """The timm architecture on torch's meta device: its config and widths, no memory, no
    weights."""
    import timm
    import torch
    with torch.device("meta"):
        return timm.create_model(spec.id, pretrained=False,
                                 pretrained_cfg_overlay=models.timm_overlay(spec),
                                 **dict(spec.options or {}))


@functools.lru_cache(maxsize=8)
def teacher_width(spec: Any) -> int:
    """The concept teacher's pooled width: a timm backbone's ``num_features``, a torchvision
    model's classifier input (the architecture on the meta device)."""
    if not spec.id.startswith("torchvision/"):
        models.locate(spec, "timm", "teacher")
        m = meta_timm(spec)         # the teacher's features are forward_head(pre_logits=True)
        return int(getattr(m, "head_hidden_size", None) or m.num_features)
    models.locate(spec, "torchvision", "teacher")
    import torch
    import torchvision
    name, opts, _ = models.torchvision_arch(spec)
    with torch.device("meta"):
        return models.drop_classifier(torchvision.models.get_model(name, weights=None, **opts))


@functools.lru_cache(maxsize=8)
def image_width(spec: Any) -> int:
    models.locate(spec, "timm", "image encoder")
    return int(meta_timm(spec).num_features)


def _folder(loc: models.Located, spec: Any) -> Optional[Path]:
    """The local folder holding the model's files (a path, a packaged model, the HF cache)."""
    if loc.source == "cache":
        from huggingface_hub import try_to_load_from_cache
        name = spec.id if "/" in spec.id else f"sentence-transformers/{spec.id}"
        hit = try_to_load_from_cache(name, "modules.json")
        return Path(hit).parent if isinstance(hit, str) else None
    return Path(loc.where) if loc.where else None


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def sentence_width(folder: Path) -> Optional[int]:
    """The output width a sentence-transformers folder declares: its last Dense module's
    ``out_features``, else its Pooling module's token width times the pooling modes on."""
    for module in reversed(_read(folder / "modules.json") or []):
        cfg = _read(folder / module.get("path", "") / "config.json")
        if module.get("type", "").endswith("Dense") and "out_features" in cfg:
            return int(cfg["out_features"])
        if module.get("type", "").endswith("Pooling") and "word_embedding_dimension" in cfg:
            modes = sum(bool(cfg.get(m)) for m in _POOL_MODES) or 1
            return int(cfg["word_embedding_dimension"]) * modes
    return None


@functools.lru_cache(maxsize=8)
def text_width(spec: Any) -> int:
    loc = models.locate(spec, "sentence_transformer", "caption encoder")
    if loc.source == "random":             # models._random_sentence_transformer: mean pooling
        return int(dict(spec.options or {}).get("hidden_size", 64))
    folder = _folder(loc, spec)
    width = sentence_width(folder) if folder is not None else None
    if width is None:   # a layout without the usual module configs (or the hub): ask the model
        width = sentence_dim(models.load_sentence_transformer(spec).model)
    return width


def sentence_dim(model: Any) -> int:
    """A loaded SentenceTransformer's output width (its method's name changed in v5)."""
    dim = getattr(model, "get_embedding_dimension", None) or \
        model.get_sentence_embedding_dimension
    return int(dim())


@functools.lru_cache(maxsize=8)
def cross_width(spec: Any) -> int:
    loc = models.locate(spec, "clip", "cross-modal encoder")
    if loc.source == "finetune":           # a `vlcurate finetune` output: its encoder.json
        from vlcurate.foundation import storage
        from vlcurate.foundation.params import ModelSpec, build
        info = storage.read_json(storage.join(loc.where, models.FINETUNE_JSON)) or {}
        return int(info.get("embed_dim") or cross_width(build(ModelSpec, info["model"], "model")))
    if loc.source == "random":             # models._random_clip: TINY_CLIP under the options
        return int({**models.TINY_CLIP, **dict(spec.options or {})}["projection_dim"])
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(loc.where or spec.id, local_files_only=loc.source != "hub")
    return int(cfg.projection_dim)
