"""Building the dual encoder a config names (``finetune.arch``), with what the batch composer
needs to feed it: its tokenizer and image normalisation.

``towers``: the image tower is a timm model (``foundation.models.load_timm``: path, cache,
packaged, ``random_init``) with its classifier removed, so it returns pooled features; the text
tower is a sentence-transformers model (``load_sentence_transformer``; a plain Hugging Face
AutoModel folder loads through it too, with mean pooling). Both go through the one model-spec
ladder, like every model of the pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from vlcurate.foundation import models

from .model import DualEncoder, LossHeads, TowerEncoder


@dataclass
class Built:
    model: LossHeads
    tokenizer: Any
    image_size: int
    mean: tuple
    std: tuple
    max_length: int
    padding: str          # "max_length" (CLIP's fixed context) or "longest" (a text tower)


def image_tower(spec: Any) -> tuple[nn.Module, int, int, tuple, tuple]:
    """(timm model returning pooled features, feature width, image size, mean, std)."""
    import timm
    tower = models.load_timm(spec, "finetune image tower").model
    tower.reset_classifier(0)
    data = timm.data.resolve_data_config({}, model=tower)
    size = dict(spec.options or {}).get("img_size") or data["input_size"][-1]
    size = size if isinstance(size, int) else int(size[0])
    return tower, int(tower.num_features), size, tuple(data["mean"]), tuple(data["std"])


def text_tower(spec: Any) -> tuple[nn.Module, int, Any, int]:
    """(sentence-transformers model, embedding width, tokenizer, max tokens)."""
    st = models.load_sentence_transformer(spec, "finetune text tower").model
    dim = st.get_embedding_dimension() if hasattr(st, "get_embedding_dimension") \
        else st.get_sentence_embedding_dimension()
    return st, int(dim), st.tokenizer, int(st.max_seq_length)


def build(cfg: Any) -> Built:
    """The model of ``cfg.arch`` (untrained heads; seeded by the caller's ``torch.manual_seed``)."""
    if cfg.arch == "clip":
        loaded = models.load_clip(cfg.model)
        model = DualEncoder(loaded.model, cfg.n_objects, cfg.n_attributes)
        return Built(model, loaded.tokenizer, loaded.image_size, loaded.mean, loaded.std,
                     loaded.tokenizer.model_max_length, "max_length")
    img, img_dim, size, mean, std = image_tower(cfg.image_tower)
    txt, txt_dim, tok, max_len = text_tower(cfg.text_tower)
    model = TowerEncoder(img, txt, img_dim, txt_dim, cfg.embed_dim, cfg.init_temperature,
                         cfg.lock_image, cfg.lock_text, cfg.n_objects, cfg.n_attributes)
    return Built(model, tok, size, mean, std, max_len, "longest")


def describe(cfg: Any, built: Built) -> dict:
    """What ``encoder.json`` records: enough to rebuild the model and preprocess its inputs."""
    from vlcurate.foundation.params import to_dict
    out = {"arch": cfg.arch, "image_size": built.image_size, "mean": list(built.mean),
           "std": list(built.std), "max_length": built.max_length, "padding": built.padding,
           "n_objects": cfg.n_objects, "n_attributes": cfg.n_attributes}
    if cfg.arch == "clip":
        return {**out, "model": to_dict(cfg.model)}
    m = built.model
    return {**out, "image_tower": to_dict(cfg.image_tower), "text_tower": to_dict(cfg.text_tower),
            "embed_dim": cfg.embed_dim, "image_dim": m.image_proj.in_features,
            "text_dim": m.text_proj.in_features, "lock_image": cfg.lock_image,
            "lock_text": cfg.lock_text, "init_temperature": cfg.init_temperature}
