"""The dual encoder being fine-tuned: a transformers CLIPModel (learnable temperature), plus the
parameters the papers' losses add: FFF's sigmoid scale and bias, UniCLIP's per-domain-pair scale
and offset, and DiHT's linear concept heads on the image embedding."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as TF
from torch import nn


def _features(out: Any) -> torch.Tensor:
    """transformers >= 5 returns a model output (projected features in pooler_output)."""
    return out.pooler_output if hasattr(out, "pooler_output") else out


class DualEncoder(nn.Module):
    def __init__(self, clip: Any, n_objects: int = 0, n_attributes: int = 0) -> None:
        super().__init__()
        self.clip = clip
        dim = clip.config.projection_dim
        # FFF sec. 4.4: learnable t (log-parametrised, init 10) and b (init by a search, below)
        self.sig_log_t = nn.Parameter(torch.tensor(math.log(10.0)))
        self.sig_bias = nn.Parameter(torch.tensor(-10.0))
        # UniCLIP Eq. 16: one temperature and offset per domain combination (ii, it, tt)
        self.mp_log_scale = nn.Parameter(torch.full((3,), math.log(1 / 0.07)))
        self.mp_offset = nn.Parameter(torch.zeros(3))
        self.obj_head: Optional[nn.Linear] = nn.Linear(dim, n_objects) if n_objects else None
        self.attr_head: Optional[nn.Linear] = nn.Linear(dim, n_attributes) if n_attributes else None

    def logit_scale(self) -> torch.Tensor:
        return self.clip.logit_scale.exp().clamp(max=100.0)

    def encode_image(self, pixels: torch.Tensor) -> torch.Tensor:
        return TF.normalize(_features(self.clip.get_image_features(pixel_values=pixels)).float(), dim=-1)

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.clip.get_text_features(input_ids=input_ids, attention_mask=attention_mask)
        return TF.normalize(_features(out).float(), dim=-1)

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> tuple:
        img = self.encode_image(pixels)
        txt = self.encode_text(input_ids, attention_mask)
        obj = self.obj_head(img) if self.obj_head is not None else None
        attr = self.attr_head(img) if self.attr_head is not None else None
        return img, txt, obj, attr
