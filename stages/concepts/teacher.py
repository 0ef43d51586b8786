"""The frozen teacher backbone (DiHT: SWAG ViT-H/14) behind a small wrapper: load through the
policy (``models.load_backbone``), decode, apply the model's own eval transform, return pooled
features (torchvision: the classifier's input, e.g. ViT's class token; timm: pre-logits)."""
from __future__ import annotations

import contextlib
import io
from typing import Any, Sequence

import numpy as np

from vlcurate.foundation import models
from vlcurate.stages.base import decoded_batches


class Teacher:
    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.loaded = models.load_backbone(spec)
        self.model, self.transform = self.loaded.model, self.loaded.processor

    def _features(self, x: Any) -> Any:
        m = self.model
        if hasattr(m, "forward_head"):                     # timm
            return m.forward_head(m.forward_features(x), pre_logits=True)
        return m(x)                                        # torchvision, classifier removed

    def tensor(self, data: bytes) -> Any:
        """Image bytes -> the model's input (CHW float), by its own eval transform."""
        from PIL import Image
        return self.transform(Image.open(io.BytesIO(data)).convert("RGB"))

    def encode(self, images: Sequence[bytes], batch_size: int, threads: int = 0) -> np.ndarray:
        """Encoded images -> (n, d) float32 features; decoded in ``threads`` ahead of the model."""
        import torch
        dev, dtype = self.loaded.device, self.loaded.dtype
        amp = contextlib.nullcontext() if dtype == torch.float32 else \
            torch.autocast(device_type="cuda" if dev.startswith("cuda") else "cpu", dtype=dtype)
        out = []
        for _, chunk in decoded_batches(images, self.tensor, batch_size, threads):
            with torch.inference_mode(), amp:
                out.append(self._features(torch.stack(chunk).to(dev)).float().flatten(1).cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, 0), np.float32)
