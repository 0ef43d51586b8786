"""The dual encoders being fine-tuned, and the parameters the papers' losses add: FFF's sigmoid
scale and bias, UniCLIP's per-domain-pair scale and offset, and DiHT's linear concept heads on
the image embedding (``LossHeads``).

- ``DualEncoder``: a transformers CLIPModel (``finetune.arch: clip``).
- ``TowerEncoder``: a timm image tower and a sentence-transformers text tower, each with a linear
  projection to ``embed_dim`` and one learnable temperature (``finetune.arch: towers``, as
  open_clip's timm and HF towers). A locked tower (LiT) is frozen and in eval mode; its features
  may come precomputed in the batch (``features.py``), so only rows it has not seen (CLIP-C
  composites) run through it.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as TF
from torch import nn


def _features(out: Any) -> torch.Tensor:
    """transformers >= 5 returns a model output (projected features in pooler_output)."""
    return out.pooler_output if hasattr(out, "pooler_output") else out


class LossHeads(nn.Module):
    """The loss parameters and concept heads shared by both encoders; ``forward`` takes a batch's
    tensors (``train.model_inputs``) and returns (image, text, object, attribute) outputs."""

    def add_loss_params(self, dim: int, n_objects: int, n_attributes: int) -> None:
        # FFF sec. 4.4: learnable t (log-parametrised, init 10) and b (init by a search)
        self.sig_log_t = nn.Parameter(torch.tensor(math.log(10.0)))
        self.sig_bias = nn.Parameter(torch.tensor(-10.0))
        # UniCLIP Eq. 16: one temperature and offset per domain combination (ii, it, tt)
        self.mp_log_scale = nn.Parameter(torch.full((3,), math.log(1 / 0.07)))
        self.mp_offset = nn.Parameter(torch.zeros(3))
        self.obj_head: Optional[nn.Linear] = nn.Linear(dim, n_objects) if n_objects else None
        self.attr_head: Optional[nn.Linear] = nn.Linear(dim, n_attributes) if n_attributes else None

    def scale_param(self) -> nn.Parameter:
        """The log of the InfoNCE logit scale (1 / temperature)."""
        raise NotImplementedError

    def logit_scale(self) -> torch.Tensor:
        return self.scale_param().exp().clamp(max=100.0)

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: torch.Tensor, image_feats: Optional[torch.Tensor] = None,
                image_live: Optional[torch.Tensor] = None,
                text_feats: Optional[torch.Tensor] = None,
                text_live: Optional[torch.Tensor] = None) -> tuple:
        img = self.encode_image(pixels, image_feats, image_live)
        txt = self.encode_text(input_ids, attention_mask, text_feats, text_live)
        obj = self.obj_head(img) if self.obj_head is not None else None
        attr = self.attr_head(img) if self.attr_head is not None else None
        return img, txt, obj, attr


class DualEncoder(LossHeads):
    def __init__(self, clip: Any, n_objects: int = 0, n_attributes: int = 0) -> None:
        super().__init__()
        self.clip = clip
        self.add_loss_params(clip.config.projection_dim, n_objects, n_attributes)

    def scale_param(self) -> nn.Parameter:
        return self.clip.logit_scale

    def encode_image(self, pixels: torch.Tensor, feats: Any = None, live: Any = None) -> torch.Tensor:
        return TF.normalize(_features(self.clip.get_image_features(pixel_values=pixels)).float(), dim=-1)

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, feats: Any = None,
                    live: Any = None) -> torch.Tensor:
        out = self.clip.get_text_features(input_ids=input_ids, attention_mask=attention_mask)
        return TF.normalize(_features(out).float(), dim=-1)


class TowerEncoder(LossHeads):
    """open_clip's tower CLIP: ``normalize(W_i image_tower(x))``, ``normalize(W_t text_tower(t))``
    (linear projections, no bias) and a learnable temperature (init ``temperature``)."""

    def __init__(self, image_tower: nn.Module, text_tower: nn.Module, image_dim: int,
                 text_dim: int, embed_dim: int, temperature: float, lock_image: bool,
                 lock_text: bool, n_objects: int = 0, n_attributes: int = 0) -> None:
        super().__init__()
        self.image_tower, self.text_tower = image_tower, text_tower
        self.lock_image, self.lock_text = lock_image, lock_text
        for tower, locked in ((image_tower, lock_image), (text_tower, lock_text)):
            tower.requires_grad_(not locked)
        self.image_proj = nn.Linear(image_dim, embed_dim, bias=False)
        self.text_proj = nn.Linear(text_dim, embed_dim, bias=False)
        self.log_scale = nn.Parameter(torch.tensor(math.log(1 / temperature)))
        self.add_loss_params(embed_dim, n_objects, n_attributes)
        self.train(False)

    def train(self, mode: bool = True) -> "TowerEncoder":
        """Locked towers stay in eval mode (frozen batch norm and dropout, as LiT)."""
        super().train(mode)
        self.image_tower.train(mode and not self.lock_image)
        self.text_tower.train(mode and not self.lock_text)
        return self

    def scale_param(self) -> nn.Parameter:
        return self.log_scale

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.lock_image):
            return self.image_tower(pixels).float()

    def text_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.lock_text):
            out = self.text_tower({"input_ids": input_ids, "attention_mask": attention_mask})
            return out["sentence_embedding"].float()

    def encode_image(self, pixels: torch.Tensor, feats: Optional[torch.Tensor] = None,
                     live: Optional[torch.Tensor] = None) -> torch.Tensor:
        f = _merge(feats, live, lambda: self.image_features(pixels))
        return TF.normalize(self.image_proj(f.to(self.image_proj.weight.dtype)).float(), dim=-1)

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    feats: Optional[torch.Tensor] = None,
                    live: Optional[torch.Tensor] = None) -> torch.Tensor:
        f = _merge(feats, live, lambda: self.text_features(input_ids, attention_mask))
        return TF.normalize(self.text_proj(f.to(self.text_proj.weight.dtype)).float(), dim=-1)


def _merge(feats: Optional[torch.Tensor], live: Optional[torch.Tensor], compute: Any) -> torch.Tensor:
    """Precomputed tower features with the ``live`` rows (not seen before) computed now; without
    precomputed features, every row is computed."""
    if feats is None:
        return compute()
    if live is None or not live.numel():
        return feats
    out = feats.clone()
    out[live] = compute().to(out.dtype)
    return out
