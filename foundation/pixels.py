"""Image bytes to a model's input: the one decode and transform the cross-modal encoder (embed)
and the trainer both use, so that embeddings and fine-tuning see the same pixels."""
from __future__ import annotations

import io
import random
from typing import Any, Optional

import numpy as np
import torch


def load_rgb(data: bytes, size: Optional[int] = None) -> Any:
    """Decode; with ``size``, let the JPEG decoder downscale by DCT (1/2, 1/4, 1/8) to the
    smallest scale still >= ``size`` on the short side: several times faster on large photos."""
    from PIL import Image
    im = Image.open(io.BytesIO(data))
    if size and im.format == "JPEG":
        w, h = im.size
        short = min(w, h)
        im.draft("RGB", (max(1, w * size // short), max(1, h * size // short)))
    return im.convert("RGB")


def to_tensor(im: Any, size: int, mean: tuple, std: tuple, rng: Optional[random.Random]) -> torch.Tensor:
    """Train: a seeded random-resized crop (scale 0.8-1) and flip; eval (rng None): resize the
    short side and centre-crop. Then normalise."""
    from PIL import Image
    w, h = im.size
    if rng is None:
        s = size / min(w, h)
        im = im.resize((max(size, round(w * s)), max(size, round(h * s))), Image.BICUBIC)
        w, h = im.size
        left, top = (w - size) // 2, (h - size) // 2
        im = im.crop((left, top, left + size, top + size))
    else:
        area = rng.uniform(0.8, 1.0) * w * h
        ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        cw = int(min(w, round(np.sqrt(area * ratio))))
        ch = int(min(h, round(np.sqrt(area / ratio))))
        left, top = rng.randint(0, w - cw), rng.randint(0, h - ch)
        im = im.crop((left, top, left + cw, top + ch)).resize((size, size), Image.BICUBIC)
        if rng.random() < 0.5:
            im = im.transpose(Image.FLIP_LEFT_RIGHT)
    # normalise in numpy: tiny torch element-wise ops pay for intra-op thread wake-ups
    x = np.asarray(im, np.float32).transpose(2, 0, 1) / 255.0
    x = (x - np.asarray(mean, np.float32)[:, None, None]) / np.asarray(std, np.float32)[:, None, None]
    return torch.from_numpy(np.ascontiguousarray(x))
