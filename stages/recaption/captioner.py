"""The BLIP-2 captioner behind a small wrapper: loading (the policy in ``foundation/models.py``),
preprocessing, beam search, decoding and the degenerate-caption checks.

Generation is deterministic beam search (FFF sec. 4.2: five pseudo-captions per image "selected
via beam search"): ``num_beams`` beams, ``num_return_sequences`` of them returned with their
``sequences_scores``. The input always carries the image tokens as ``input_ids`` (the processor
puts ``num_query_tokens`` image tokens before the prompt), which both decoder-only (OPT) and
encoder-decoder (T5) language models accept; an empty prompt gives just the tokenizer's own
special tokens (OPT: ``<s>``, T5: ``</s>``), as BLIP-2 captions without a prompt.
"""
from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from vlcurate.schemas import recaption as R
from vlcurate.foundation import models

_WORD = re.compile(r"\w+", re.UNICODE)


@dataclass(frozen=True)
class Beam:
    text: str
    score: float
    flag: Optional[str]


def degenerate(text: str, max_repeats: int) -> Optional[str]:
    """``empty`` or ``repetitive`` (a 1-3 word n-gram repeated ``max_repeats`` times back to
    back, e.g. "a a a" or "on the on the on the" with 3), else None."""
    words = _WORD.findall(text.lower())
    if not words:
        return R.FLAG_EMPTY
    for n in (1, 2, 3):
        for i in range(len(words) - n * max_repeats + 1):
            gram = words[i:i + n]
            if all(words[i + j * n:i + (j + 1) * n] == gram for j in range(1, max_repeats)):
                return R.FLAG_REPETITIVE
    return None


class Captioner:
    def __init__(self, cfg: Any) -> None:
        """``cfg``: the ``recaption`` config section (model spec, prompt, generation knobs)."""
        if cfg.num_return_sequences > cfg.num_beams:
            raise ValueError("recaption.num_return_sequences must be <= recaption.num_beams")
        self.cfg = cfg
        self.loaded = models.load_blip2(cfg.model)
        self.model, self.processor = self.loaded.model, self.loaded.processor
        self.tokenizer = self.processor.tokenizer
        text_cfg = self.model.config.text_config
        self.decoder_only = not getattr(text_cfg, "is_encoder_decoder", False)
        eos = text_cfg.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])

    def _inputs(self, images: Sequence[Any]) -> dict:
        enc = self.processor(images=list(images), text=[self.cfg.prompt] * len(images),
                             return_tensors="pt")
        out = {k: v.to(self.loaded.device) for k, v in enc.items()}
        out["pixel_values"] = out["pixel_values"].to(self.model.dtype)
        return out

    def generate(self, images: Sequence[Any]) -> list[list[Beam]]:
        """PIL images -> per image ``num_return_sequences`` beams, best score first."""
        import torch
        c = self.cfg
        if not images:
            return []
        inputs = self._inputs(images)
        with torch.inference_mode():
            out = self.model.generate(
                **inputs, num_beams=c.num_beams, num_return_sequences=c.num_return_sequences,
                max_new_tokens=c.max_new_tokens, length_penalty=c.length_penalty,
                repetition_penalty=c.repetition_penalty, do_sample=False, early_stopping=True,
                output_scores=True, return_dict_in_generate=True)
        seqs = out.sequences
        if self.decoder_only:   # the prompt (image tokens included) comes back first
            seqs = seqs[:, inputs["input_ids"].shape[1]:]
        texts = [t.strip() for t in self.tokenizer.batch_decode(seqs, skip_special_tokens=True)]
        ended = [bool(self.eos & set(s.tolist())) for s in seqs]
        scores = out.sequences_scores.float().cpu().tolist()
        k = c.num_return_sequences
        result = []
        for i in range(len(images)):
            beams = sorted(zip(texts[i * k:(i + 1) * k], scores[i * k:(i + 1) * k],
                               ended[i * k:(i + 1) * k], strict=True), key=lambda b: -b[1])
            result.append(self._flag(beams))
        return result

    def _flag(self, beams: list[tuple[str, float, bool]]) -> list[Beam]:
        c, seen, out = self.cfg, set(), []
        for text, score, ended in beams:
            if c.prompt_in_caption and c.prompt:
                text = f"{c.prompt.strip()} {text}".strip()
            key = " ".join(text.lower().split())
            flag = degenerate(text, c.max_repeats)
            if flag is None and key in seen:
                flag = R.FLAG_DUPLICATE
            if flag is None and not ended:
                flag = R.FLAG_TRUNCATED
            seen.add(key)
            out.append(Beam(text, float(score), flag))
        return out

    def caption_bytes(self, images: Sequence[bytes], batch_size: int) -> list[list[Beam]]:
        """Encoded images -> beams, ``batch_size`` images per ``generate`` call."""
        from PIL import Image
        out: list[list[Beam]] = []
        for lo in range(0, len(images), batch_size):
            ims = [Image.open(io.BytesIO(b)).convert("RGB") for b in images[lo:lo + batch_size]]
            out.extend(self.generate(ims))
        return out
