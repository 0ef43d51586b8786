"""Caption decoding and normalisation: strict UTF-8, Unicode NFC, control characters and runs of
whitespace (any Unicode space, tab or newline) collapsed to one ASCII space, ends stripped."""
from __future__ import annotations

import unicodedata
from typing import Optional

from vlcurate.schemas import reasons as R

_BOM = "\ufeff"


# Characters that render as nothing but are not Unicode format controls (Cf): combining
# grapheme joiner, Hangul fillers, Khmer inherent vowels, Mongolian selectors, braille blank,
# variation selectors. A caption made only of these and of Cf characters (zero-width space /
# joiners, bidi marks, soft hyphen, BOM, tag characters) is empty. In a caption with visible
# text they are kept: a zero-width joiner is part of an emoji, a ZWNJ part of Persian words.
_INVISIBLE = {0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x180B, 0x180C, 0x180D, 0x180E, 0x180F,
              0x2800, 0x3164, 0xFFA0, *range(0xFE00, 0xFE10), *range(0xE0100, 0xE01F0)}


def _invisible(c: str) -> bool:
    return unicodedata.category(c) == "Cf" or ord(c) in _INVISIBLE or c == " "


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
        return None, R.NON_UTF8, f"byte {e.start} (0x{raw[e.start]:02x}) is not UTF-8"
    caption = normalise(text)
    if not caption or all(_invisible(c) for c in caption):
        return None, R.EMPTY_CAPTION, "caption is empty after whitespace normalisation"
    if len(caption) > max_chars:
        return caption, R.CAPTION_TOO_LONG, f"{len(caption)} characters > max_caption_chars {max_chars}"
    return caption, None, ""
