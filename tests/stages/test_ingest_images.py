"""stages/ingest/images.py: decode once behind a pixel guard, normalise to RGB, or reject."""
from __future__ import annotations

import io
import random

import numpy as np
import pytest
from PIL import Image, ImageFile

from . import corpus
from vlcurate.schemas import reasons as R
from vlcurate.stages.ingest import images

MAX = 89_478_485


def decode(data, **kw):
    kw.setdefault("max_pixels", MAX)
    kw.setdefault("min_side", 8)
    return images.decode(data, **kw)


def pixels(data: bytes) -> np.ndarray:
    im = corpus.decode_rgb(data)
    assert im.mode == "RGB"
    return np.asarray(im).astype(int)


def close(actual, expected, tol=6) -> bool:
    return bool(np.all(np.abs(np.asarray(actual, int) - np.asarray(expected, int)) <= tol))


@pytest.fixture
def no_pixel_decode(monkeypatch):
    """Fail the test if anything decodes pixels (ImageFile.load allocates and fills them)."""
    calls = []

    def load(self):
        calls.append(self.size)
        raise AssertionError(f"pixels decoded for a {self.size} image")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return calls


# --- kept images --------------------------------------------------------------------------------
def test_rgb_jpeg_without_rotation_is_passed_through_byte_for_byte():
    data = corpus.jpeg(64, 48)
    d = decode(data)
    assert isinstance(d, images.Decoded)
    assert d.data == data and d.reencoded is False
    assert (d.width, d.height, d.format, d.mode) == (64, 48, "JPEG", "RGB")


def test_exif_orientation_1_is_not_a_rotation():
    data = corpus.jpeg(64, 48, exif_orientation=1)
    d = decode(data)
    assert d.data == data and d.reencoded is False


def test_greyscale_jpeg_is_stored_as_rgb():
    # ingest stores RGB: a greyscale JPEG is re-encoded (its source mode is recorded)
    data = corpus.encode(Image.new("L", (20, 10), 77), "JPEG")
    d = decode(data)
    assert d.reencoded is True and d.mode == "L"
    assert Image.open(io.BytesIO(d.data)).mode == "RGB"
    assert abs(Image.open(io.BytesIO(d.data)).getpixel((5, 5))[0] - 77) <= 2


def test_reencode_always_reencodes_even_a_plain_rgb_jpeg():
    data = corpus.jpeg(64, 48)
    d = decode(data, reencode="always")
    assert d.reencoded is True and d.data != data
    assert (d.width, d.height, d.format, d.mode) == (64, 48, "JPEG", "RGB")
    assert corpus.decode_rgb(d.data).size == (64, 48)


def test_exif_orientation_6_is_rotated_reencoded_and_swaps_width_and_height():
    # stored 64x48, left half red, right half blue; orientation 6 = rotate 90 degrees clockwise
    data = corpus.encode(corpus.halves(64, 48, corpus.RED, corpus.BLUE), "JPEG", quality=95,
                         exif=_exif(6))
    d = decode(data)
    assert d.reencoded is True and d.data != data
    assert (d.width, d.height) == (48, 64)
    assert (d.format, d.mode) == ("JPEG", "RGB")
    px = pixels(d.data)
    assert px.shape == (64, 48, 3)
    assert close(px[10, 24], corpus.RED, 12)    # the left half is now on top
    assert close(px[54, 24], corpus.BLUE, 12)
    assert images._has_rotation(corpus.decode_rgb(d.data)) is False  # no orientation left over


@pytest.mark.parametrize("orientation,size,top", [(3, (64, 48), None), (8, (48, 64), corpus.BLUE)])
def test_other_exif_orientations(orientation, size, top):
    data = corpus.encode(corpus.halves(64, 48, corpus.RED, corpus.BLUE), "JPEG", quality=95,
                         exif=_exif(orientation))
    d = decode(data)
    assert d.reencoded is True and (d.width, d.height) == size
    px = pixels(d.data)
    if orientation == 3:  # 180 degrees: left/right swap
        assert close(px[24, 5], corpus.BLUE, 12) and close(px[24, 58], corpus.RED, 12)
    else:                 # 90 counter-clockwise: the right half goes on top
        assert close(px[10, 24], top, 12)


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def test_png_is_reencoded_to_jpeg():
    im = corpus.halves(32, 16, corpus.RED, corpus.BLUE)
    d = decode(corpus.encode(im, "PNG"))
    assert d.reencoded is True and d.data[:3] == b"\xff\xd8\xff"
    assert (d.width, d.height, d.format, d.mode) == (32, 16, "PNG", "RGB")
    out = corpus.decode_rgb(d.data)
    assert out.format == "JPEG" and out.size == (32, 16)
    px = pixels(d.data)
    assert close(px[8, 4], corpus.RED, 12) and close(px[8, 28], corpus.BLUE, 12)


def test_webp_is_reencoded_to_jpeg():
    d = decode(corpus.webp(40, 30))
    assert d.reencoded is True and (d.width, d.height, d.format, d.mode) == (40, 30, "WEBP", "RGB")
    assert corpus.decode_rgb(d.data).format == "JPEG"


def test_jpeg_quality_is_applied_to_reencodes():
    data = corpus.png(64, 48)
    low, high = decode(data, jpeg_quality=10), decode(data, jpeg_quality=95)
    assert len(low.data) < len(high.data)


def test_16bit_greyscale_is_rescaled_to_8bit_not_clipped():
    d = decode(corpus.grey16_png(48, 16))
    assert d.mode == "I;16" and d.format == "PNG" and d.reencoded is True
    assert (d.width, d.height) == (48, 16)
    px = pixels(d.data)
    assert px.shape == (16, 48, 3)
    row = px[8]
    # the three bands 0, 32768, 65535 -> 0, ~128, 255 (PIL's convert("L") would clip 32768 to 255)
    for x, want in ((8, 0), (24, 128), (40, 255)):
        assert close(row[x], (want,) * 3, 3), (x, row[x])


def test_16bit_conversion_helper_exact_values():
    a = np.array([[0, 257, 32768, 65535]], np.uint16)
    rgb = images._to_rgb(Image.fromarray(a))
    assert rgb.mode == "RGB"
    assert np.asarray(rgb)[0, :, 0].tolist() == [0, 1, 128, 255]


def test_rgba_is_composited_on_white():
    d = decode(corpus.rgba_png(32, 16))
    assert (d.mode, d.format, d.reencoded) == ("RGBA", "PNG", True)
    px = pixels(d.data)
    assert close(px[8, 4], corpus.WHITE, 4)     # transparent (black underneath) -> white
    assert close(px[8, 28], corpus.BLUE, 12)    # opaque blue stays blue


def test_half_transparent_red_blends_with_white():
    rgb = images._to_rgb(Image.new("RGBA", (8, 8), (255, 0, 0, 128)))
    r, g, b = rgb.getpixel((4, 4))
    assert r == 255 and abs(g - 127) <= 1 and abs(b - 127) <= 1


def test_palette_with_transparency_and_la_are_composited_on_white():
    p = Image.new("P", (16, 16), 0)
    p.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    p.paste(1, (8, 0, 16, 16))
    d = decode(corpus.encode(p, "PNG", transparency=0))
    assert d.mode == "P"
    px = pixels(d.data)
    assert close(px[8, 2], corpus.WHITE, 6) and close(px[8, 13], (255, 0, 0), 20)
    la = decode(corpus.encode(Image.new("LA", (16, 16), (0, 0)), "PNG"))
    assert la.mode == "LA" and close(pixels(la.data)[8, 8], corpus.WHITE, 4)


def test_cmyk_jpeg_is_converted_to_rgb():
    d = decode(corpus.cmyk_jpeg(32, 32))
    assert (d.mode, d.format, d.reencoded) == ("CMYK", "JPEG", True)
    assert (d.width, d.height) == (32, 32)
    assert close(pixels(d.data)[16, 16], (255, 0, 0), 8)


def test_min_side_and_max_pixels_boundaries_are_inclusive():
    assert isinstance(decode(corpus.png(8, 8), min_side=8), images.Decoded)
    assert isinstance(decode(corpus.png(10, 10), max_pixels=100), images.Decoded)


# --- rejected images ------------------------------------------------------------------------------
def test_none_and_zero_bytes():
    assert decode(None).reason == R.MISSING_IMAGE
    assert decode(b"").reason == R.ZERO_BYTE


def test_huge_png_header_is_rejected_without_decoding_pixels(no_pixel_decode):
    data = corpus.png_header(30000, 30000)
    assert len(data) < 100
    r = decode(data)
    assert isinstance(r, images.Rejected) and r.reason == R.TOO_LARGE
    assert "900000000" in r.detail
    assert no_pixel_decode == []


def test_max_pixels_from_config_is_checked_before_decoding(no_pixel_decode):
    r = decode(corpus.png_header(10000, 10000), max_pixels=1_000_000)
    assert r.reason == R.TOO_LARGE
    assert r.detail.startswith("100000000 pixels > max_pixels 1000000")
    assert no_pixel_decode == []


def test_side_longer_than_jpeg_allows_is_rejected_not_raised(no_pixel_decode):
    # 70000 x 10 is under max_pixels, but JPEG (what ingest stores) cannot hold a 70000 px side
    r = decode(corpus.png_header(70000, 10))
    assert r.reason == R.TOO_LARGE and "65500" in r.detail
    assert no_pixel_decode == []


def test_too_small(no_pixel_decode):
    r = decode(corpus.png_header(4, 400))
    assert r.reason == R.TOO_SMALL and r.detail == "4x400: a side is below min_side 8"
    assert no_pixel_decode == []


def test_truncated_jpeg_and_png():
    assert decode(corpus.truncated_jpeg()).reason == R.TRUNCATED
    png = corpus.png(64, 48)
    assert decode(png[: len(png) // 2]).reason == R.TRUNCATED


def test_corrupt_scan_data_is_undecodable_not_truncated():
    r = decode(corpus.corrupt_jpeg())
    assert r.reason == R.UNDECODABLE, r.detail
    assert "broken data stream" in r.detail


@pytest.mark.parametrize("data", [corpus.garbage_after_header(), b"<html>404 not found</html>",
                                  b"\xff\xd8", b"\x89PNG\r\n\x1a\n"])
def test_unrecognised_data_is_undecodable(data):
    assert decode(data).reason == R.UNDECODABLE


def test_a_failing_reencode_is_a_reject_not_an_exception(monkeypatch):
    def boom(im):
        raise ValueError("conversion not supported")
    monkeypatch.setattr(images, "_to_rgb", boom)
    r = decode(corpus.png(16, 16))
    assert r.reason == R.UNDECODABLE and "conversion not supported" in r.detail


@pytest.mark.filterwarnings("ignore")
def test_mutated_images_never_raise():
    """Seeded byte mutations of every supported format: always a Decoded or a known reject."""
    rng = random.Random(1234)
    bases = [corpus.jpeg(32, 24), corpus.png(32, 24), corpus.webp(32, 24), corpus.grey16_png(),
             corpus.rgba_png(), corpus.cmyk_jpeg(16, 16), corpus.jpeg(32, 24, exif_orientation=6),
             corpus.encode(corpus.noise_image(32, 24), "GIF")]
    seen = set()
    for _ in range(400):
        b = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 6)):
            at = rng.randrange(min(len(b), 160) if rng.random() < 0.7 else len(b))  # mostly headers
            b[at] = rng.randrange(256)
        out = decode(bytes(b), max_pixels=10_000_000)
        if isinstance(out, images.Rejected):
            assert out.reason in R.INGEST
            assert not images._BYTES.search(out.detail), out.detail   # no file bytes shown
            seen.add(out.reason)
        else:
            assert isinstance(out, images.Decoded) and out.width >= 8 and out.height >= 8
            assert corpus.decode_rgb(out.data).size == (out.width, out.height)
    assert R.UNDECODABLE in seen


# --- the pixel guard, for every format Pillow opens ------------------------------------------
def _saved(fmt: str, size: tuple[int, int]) -> bytes | None:
    for mode in ("RGB", "L", "1"):
        try:
            return corpus.encode(Image.new(mode, size, 128 if mode != "RGB" else (9, 99, 199)), fmt)
        except Exception:
            continue
    return None


def test_every_format_pillow_writes_is_checked_before_any_pixel_is_decoded(no_pixel_decode):
    Image.init()
    checked = []
    for fmt in sorted(set(Image.SAVE) & set(Image.OPEN)):
        data = _saved(fmt, (40, 40))
        if data is None:
            continue
        r = images.decode(data, max_pixels=100, min_side=1)
        assert isinstance(r, images.Rejected), fmt
        if fmt == "EPS":   # never handed to Ghostscript
            assert r.reason == R.UNDECODABLE, (fmt, r)
            continue
        assert r.reason == R.TOO_LARGE, (fmt, r)
        checked.append(fmt)
    assert no_pixel_decode == []
    assert {"BMP", "GIF", "ICO", "JPEG", "PNG", "TIFF", "WEBP", "PPM", "TGA", "DDS"} <= set(checked)


def _ico_lying_about_its_size(real: int, said: int) -> bytes:
    """An ICO whose directory entry says ``said`` x ``said`` but whose embedded PNG is
    ``real`` x ``real`` (Pillow's ICO size comes from the directory)."""
    data = bytearray(corpus.encode(corpus.noise_image(real, real), "ICO", sizes=[(real, real)]))
    data[6], data[7] = said, said          # the first entry's width and height bytes
    return bytes(data)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("real", [40, 64])  # between max_pixels and 2x (a warning), and over 2x
def test_ico_container_whose_embedded_image_is_larger_than_declared(no_pixel_decode, real):
    data = _ico_lying_about_its_size(real, 16)   # (Pillow's ICO decodes its entry in open())
    r = images.decode(data, max_pixels=1000, min_side=1)
    assert isinstance(r, images.Rejected) and r.reason == R.TOO_LARGE, r
    assert r.detail.startswith(f"{real * real} pixels > max_pixels 1000")
    assert no_pixel_decode == []


def test_ico_within_the_limit_still_decodes():
    r = images.decode(_ico_lying_about_its_size(24, 24), max_pixels=1000, min_side=1)
    assert isinstance(r, images.Decoded) and (r.width, r.height) == (24, 24)


def test_decoder_messages_never_quote_file_bytes():
    assert images._message(SyntaxError("not a TIFF file (header b'II*\\x00secret' not valid)")) \
        == "SyntaxError: not a TIFF file (header <bytes> not valid)"
    r = decode(b"II*\x00" + b"SECRET" * 40)
    assert isinstance(r, images.Rejected) and "SECRET" not in r.detail
