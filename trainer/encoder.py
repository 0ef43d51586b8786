"""A fine-tuned dual encoder as a pair of embedding functions, for evaluation and for whoever
scores pairs with it (a cross-modal filter).

``<out_dir>/encoder.json`` describes the model (``arch``; for ``towers`` the two tower specs,
their feature widths, ``embed_dim``, the learned temperature; the image size and normalisation;
the tokeniser's padding and length) and ``<out_dir>/encoder.pt`` holds its weights only (every
parameter, the towers' included; no optimiser state). ``load_encoder(out_dir)`` rebuilds the
architecture from the recorded specs (they must resolve on the loading machine, through the
usual path / cache / packaged / random_init ladder: they give the architecture and tokeniser) and
loads the weights from ``encoder.pt``.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from vlcurate.foundation import storage
from vlcurate.foundation.params import ModelSpec, build as build_params

from .data import load_rgb, to_tensor

ENCODER_JSON = "encoder.json"
ENCODER_WEIGHTS = "encoder.pt"


@torch.no_grad()
def embed_images(model: Any, images: Sequence[Any], size: int, mean: tuple, std: tuple,
                 device: str, batch_size: int = 64) -> torch.Tensor:
    """L2-normalised image embeddings [n, embed_dim] (bytes or PIL images; the eval transform)."""
    out = []
    for s in range(0, len(images), batch_size):
        ims = [load_rgb(x, size) if isinstance(x, (bytes, bytearray)) else x.convert("RGB")
               for x in images[s:s + batch_size]]
        pixels = torch.stack([to_tensor(im, size, mean, std, None) for im in ims]).to(device)
        out.append(model.encode_image(pixels).float().cpu())
    return torch.cat(out) if out else torch.zeros(0, 0)


@torch.no_grad()
def embed_texts(model: Any, tokenize: Callable, texts: Sequence[str], device: str,
                batch_size: int = 256) -> torch.Tensor:
    """L2-normalised text embeddings [n, embed_dim]."""
    out = []
    for s in range(0, len(texts), batch_size):
        tok = {k: v.to(device) for k, v in tokenize(list(texts[s:s + batch_size])).items()}
        out.append(model.encode_text(tok["input_ids"], tok["attention_mask"]).float().cpu())
    return torch.cat(out) if out else torch.zeros(0, 0)


@dataclass
class EncoderPair:
    """A loaded fine-tune output: ``encode_images`` / ``encode_texts`` give L2-normalised float32
    arrays in one space (cosine = dot product); ``score`` is the cosine of aligned pairs."""
    model: Any
    tokenize: Callable
    image_size: int
    mean: tuple
    std: tuple
    device: str
    info: dict
    tokenizer: Any = None       # the raw tokeniser (a fixed-shape caller pads to max_length)
    max_length: int = 0

    @property
    def random(self) -> bool:
        """True when a tower or model it was built from had random weights (tests, demos)."""
        return any(bool((self.info.get(k) or {}).get("random_init"))
                   for k in ("model", "image_tower", "text_tower"))

    def encode_images(self, images: Sequence[Any], batch_size: int = 64) -> np.ndarray:
        return embed_images(self.model, images, self.image_size, self.mean, self.std,
                            self.device, batch_size).numpy()

    def encode_texts(self, texts: Sequence[str], batch_size: int = 256) -> np.ndarray:
        return embed_texts(self.model, self.tokenize, texts, self.device, batch_size).numpy()

    def score(self, images: Sequence[Any], texts: Sequence[str]) -> np.ndarray:
        return (self.encode_images(images) * self.encode_texts(texts)).sum(1)


class _Spec:
    """What ``towers.build`` reads of a finetune config, rebuilt from ``encoder.json``."""

    def __init__(self, info: dict) -> None:
        self.arch = info["arch"]
        for key in ("model", "image_tower", "text_tower"):
            if key in info:
                setattr(self, key, build_params(ModelSpec, info[key], key))
        self.embed_dim = info.get("embed_dim")
        self.init_temperature = info.get("init_temperature", 0.07)
        self.lock_image = self.lock_text = True
        self.n_objects, self.n_attributes = info["n_objects"], info["n_attributes"]


def save_encoder(out: str, info: dict, model: Any, step: int) -> None:
    """``encoder.json`` (with the learned temperature and the step) and ``encoder.pt``."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    storage.write_bytes(storage.join(out, ENCODER_WEIGHTS), buf.getvalue())
    info = {**info, "step": step, "temperature": float(1 / model.logit_scale().detach()),
            "weights": ENCODER_WEIGHTS}
    storage.write_bytes(storage.join(out, ENCODER_JSON), json.dumps(info, indent=1).encode())


def load_encoder(out_dir: str, device: str = "cpu") -> EncoderPair:
    """The encoder pair a ``vlcurate finetune`` run wrote to ``out_dir`` (a path or URI)."""
    from .towers import build
    import functools

    from .compose import tokenize
    meta = storage.read_json(storage.join(str(out_dir), ENCODER_JSON))
    if meta is None:
        raise FileNotFoundError(f"{storage.redact(str(out_dir))}: no {ENCODER_JSON}; point at "
                                "the finetune.out_dir of a finished `vlcurate finetune` run")
    built = build(_Spec(meta))
    state = torch.load(io.BytesIO(storage.read_bytes(storage.join(str(out_dir), meta["weights"]))),
                       map_location="cpu", weights_only=True)
    model = built.model
    model.load_state_dict(state)
    model.to(device).eval()
    tok = functools.partial(tokenize, built.tokenizer, padding=meta["padding"],
                            max_length=meta["max_length"])
    return EncoderPair(model, tok, meta["image_size"], tuple(meta["mean"]),
                       tuple(meta["std"]), device, meta, built.tokenizer, meta["max_length"])
