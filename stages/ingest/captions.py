"""Caption decoding and normalisation: strict UTF-8, Unicode NFC, control characters and runs of
whitespace (any Unicode space, tab or newline) collapsed to one ASCII space, ends stripped."""
from __future__ import annotations

import unicodedata
from typing import Optional

from vlcurate.schemas import reasons as R

_BOM = "\ufeff"


def normalise(text: str) -> str:
    text = unicodedata.normalize("NFC", text.replace(_BOM, ""))
    # control characters (Cc) become spaces; str.split() then collapses every Unicode space
    text = "".join(" " if unicodedata.category(c) == "Cc" else c for c in text)
    return " ".join(text.split())


def decode(raw: Optional[bytes], *, max_chars: int) -> tuple[Optional[str], Optional[str], str]:
    """Returns (caption, reason, detail); caption is None when the caption cannot be used."""
    if raw is None:
        return None, R.MISSING_CAPTION, "no caption in the record"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, R.NON_UTF8, f"byte {e.start}: {raw[e.start:e.start + 4]!r} is not UTF-8"
    caption = normalise(text)
    if not caption:
        return None, R.EMPTY_CAPTION, "caption is empty after whitespace normalisation"
    if len(caption) > max_chars:
        return caption, R.CAPTION_TOO_LONG, f"{len(caption)} characters > max_caption_chars {max_chars}"
    return caption, None, ""
