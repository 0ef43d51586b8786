"""Decode one image once, fully, behind a pixel-count guard; normalise it to RGB."""
from __future__ import annotations

import io
import re
import struct
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from vlcurate.schemas import reasons as R

ImageFile.LOAD_TRUNCATED_IMAGES = False

# libjpeg cannot write a side longer than this; an image that needs a re-encode and is wider or
# taller (a long panorama under max_pixels) would otherwise raise from the JPEG encoder.
JPEG_MAX_SIDE = 65_500


@dataclass(frozen=True)
class Decoded:
    data: bytes            # what ingest stores: the source bytes or an RGB JPEG re-encode
    width: int
    height: int
    format: str            # the source format as PIL identified it
    mode: str              # the source mode before conversion
    reencoded: bool


@dataclass(frozen=True)
class Rejected:
    reason: str
    detail: str


def _to_rgb(im: Image.Image) -> Image.Image:
    mode = im.mode
    if mode == "RGB":
        return im
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        # 16-bit (and 32-bit) greyscale: PIL's convert("L") clips at 255; rescale instead.
        a = np.asarray(im, dtype=np.float64)
        hi = 65535.0 if mode.startswith("I;16") or a.max(initial=0) > 255 else 255.0
        a = np.clip(a / hi * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return Image.fromarray(a, "L").convert("RGB")
    if mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
        mode = im.mode
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return im.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV


def _open_guarded(data: bytes, max_pixels: int,
                  min_side: int) -> tuple[Image.Image, str, str] | Rejected:
    """(decoded image, source format, source mode), every size checked before any pixel."""
    # The pixel guard for every format: our check of the declared size below, and Pillow's own
    # check at max_pixels for what a container holds (an ICO / ICNS entry's embedded PNG or BMP
    # may be larger than the directory says), with its warning turned into a reject.
    # (Pillow's limit is a module global: set for this decode only, then put back.)
    prev, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=_formats())
            w, h = im.size
            if w * h > max_pixels:
                return Rejected(R.TOO_LARGE, f"{w}x{h} = {w * h} pixels > max_pixels {max_pixels}")
            if min(w, h) < min_side:
                return Rejected(R.TOO_SMALL, f"{w}x{h}: a side is below min_side {min_side}")
            if max(w, h) > JPEG_MAX_SIDE:  # what ingest stores is JPEG: reject before decoding
                return Rejected(R.TOO_LARGE,
                                f"{w}x{h}: a side is over JPEG's limit of {JPEG_MAX_SIDE} pixels")
            fmt, mode = im.format or "UNKNOWN", im.mode
            im.load()  # the one full decode; raises on truncated or corrupt data
            return im, fmt, mode
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        m = re.search(r"\((\d+) pixels\)", str(e))
        return Rejected(R.TOO_LARGE, f"{m.group(1) if m else 'more'} pixels > max_pixels "
                                     f"{max_pixels} (declared, checked before decoding)")
    except UnidentifiedImageError:  # (never the file's bytes in a detail)
        return Rejected(R.UNDECODABLE, f"not a recognised image format ({len(data)} bytes)")
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as e:
        msg = str(e)
        # Pillow says "image file is truncated" when the data runs out; "broken data stream"
        # is its generic decoder error for corrupt data (garbage in a JPEG's scan), not a cut.
        reason = R.TRUNCATED if ("truncated" in msg or isinstance(e, EOFError)) else R.UNDECODABLE
        return Rejected(reason, _message(e))
    except Exception as e:  # a plugin's own bug on hostile bytes must not stop the run
        return Rejected(R.UNDECODABLE, _message(e))
    finally:
        Image.MAX_IMAGE_PIXELS = prev


def decode(data: Optional[bytes], *, max_pixels: int, min_side: int = 1,
           reencode: str = "auto", jpeg_quality: int = 95) -> Decoded | Rejected:
    """Decode ``data`` fully once. Returns :class:`Decoded` or :class:`Rejected` with a reason."""
    if data is None:
        return Rejected(R.MISSING_IMAGE, "no image bytes in the record")
    if len(data) == 0:
        return Rejected(R.ZERO_BYTE, "image is 0 bytes")
    opened = _open_guarded(data, max_pixels, min_side)
    if isinstance(opened, Rejected):
        return opened
    im, fmt, mode = opened
    w, h = im.size
    rotate = _has_rotation(im)
    if (reencode == "auto" and fmt == "JPEG" and mode == "RGB" and not rotate
            and getattr(im, "n_frames", 1) == 1):
        return Decoded(data, w, h, fmt, mode, False)
    if rotate:
        try:
            im = ImageOps.exif_transpose(im)
        except Exception:  # malformed EXIF must not lose an otherwise good image
            pass
    try:  # a header that lies about the data can still make conversion or encoding fail
        rgb = _to_rgb(im)
        buf = io.BytesIO()
        rgb.save(buf, format="JPEG", quality=jpeg_quality)
    except Exception as e:
        return Rejected(R.UNDECODABLE, f"cannot re-encode as JPEG: {_message(e)}")
    return Decoded(buf.getvalue(), rgb.width, rgb.height, fmt, mode, True)


_BYTES = re.compile(r"b'(?:[^'\\]|\\.)*'" + r'|b"(?:[^"\\]|\\.)*"')


def _message(e: BaseException) -> str:
    """A decoder's error, short, without the bytes some plugins quote ("not a TIFF file
    (header b'II*...' not valid)"): a reason detail never shows what a file holds."""
    return f"{type(e).__name__}: {_BYTES.sub('<bytes>', str(e))[:200]}"


# Formats Pillow decodes by running an external program (Ghostscript for EPS): never on
# untrusted bytes; such data is "not a recognised image format".
_EXTERNAL = {"EPS"}


def _formats() -> list[str]:
    Image.init()
    return [f for f in Image.OPEN if f not in _EXTERNAL]


def _has_rotation(im: Image.Image) -> bool:
    try:
        return im.getexif().get(0x0112, 1) not in (1, None)
    except Exception:
        return False

