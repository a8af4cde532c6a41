"""Media readers refuse what would make them work without bound, by a named cap and before the work: a WAV header's
sample rate outside [MIN_SAMPLE_RATE, MAX_SAMPLE_RATE] (a 4 GHz rate once built a resampling filter of millions of
taps; a rate of 0 escaped as a server error) and an image whose header claims more than MAX_IMAGE_PIXELS."""

import io
import struct
import time
import wave
import zlib

import numpy as np
import pytest
from PIL import Image

from omnijax.media.audio import MAX_SAMPLE_RATE, check_sample_rate, read_wav, resample
from omnijax.media.image import MAX_IMAGE_PIXELS, ImageTooLarge, read_image


def wav_bytes(rate: int, samples: int = 160) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(16_000)
        f.writeframes(np.zeros(samples, np.int16).tobytes())
    data = bytearray(buffer.getvalue())
    data[24:28] = struct.pack("<I", rate)  # the header's sample rate, as a hostile client writes it
    return bytes(data)


@pytest.mark.parametrize("rate", [0, 999, MAX_SAMPLE_RATE + 1, 4_000_000_000])
def test_a_wav_rate_outside_the_range_is_refused_before_any_work(rate):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"sample rate {rate} Hz is outside the supported range .*MAX_SAMPLE_RATE"):
        read_wav(io.BytesIO(wav_bytes(rate)))
    with pytest.raises(ValueError, match="outside the supported range"):
        resample(np.zeros(10, np.float32), rate)
    assert time.perf_counter() - start < 1.0


def test_rates_inside_the_range_still_read_and_resample():
    pcm, rate = read_wav(io.BytesIO(wav_bytes(48_000, samples=480)))
    assert rate == 48_000 and pcm.shape == (480,)
    assert resample(np.ones(480, np.float32), rate).shape == (160,)
    assert check_sample_rate(np.int64(8_000)) == 8_000
    for bad in (True, 16_000.0, "16000"):
        with pytest.raises(ValueError, match="must be an int in Hz"):
            check_sample_rate(bad)


def png_bytes(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims `width` x `height` (with a valid IHDR checksum)."""
    data = bytearray(png_bytes(8, 8))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def test_an_image_over_the_pixel_cap_is_refused_from_its_header():
    start = time.perf_counter()
    with pytest.raises(ImageTooLarge, match=r"12000x12000 = 144,000,000 pixels, over the 50,000,000 accepted "
                                            r"\(MAX_IMAGE_PIXELS\)"):
        read_image(claiming(12_000, 12_000))
    with pytest.raises(ImageTooLarge, match=r"more than the 50,000,000 pixels accepted \(MAX_IMAGE_PIXELS\)"):
        read_image(claiming(20_000, 20_000))  # so large that PIL refuses to open it
    assert time.perf_counter() - start < 1.0 and MAX_IMAGE_PIXELS == 50_000_000
    assert isinstance(ImageTooLarge("x"), ValueError)  # callers that catch ValueError refuse it as bad input
    rgb = read_image(png_bytes(5, 3))
    assert rgb.shape == (3, 5, 3) and rgb.dtype == np.uint8 and tuple(rgb[0, 0]) == (10, 20, 30)


def _saved(image: Image.Image, format: str = "PNG", **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **kwargs)
    return buffer.getvalue()


def _blend(rgb, alpha):
    """Colour `rgb` at opacity `alpha` (0..255) over white, as the model releases' preprocessing composites it."""
    return np.asarray(rgb, np.float64) * alpha / 255 + 255 * (1 - alpha / 255)


def test_transparency_is_composited_on_white():
    """The old reader dropped alpha: a transparent pixel came out as whatever colour was stored under it."""
    rgba = Image.new("RGBA", (3, 1))
    for x, pixel in enumerate([(200, 0, 0, 255), (0, 0, 0, 0), (10, 100, 250, 128)]):
        rgba.putpixel((x, 0), pixel)
    out = read_image(_saved(rgba)).astype(np.float64)
    np.testing.assert_allclose(out[0, 0], (200, 0, 0))
    np.testing.assert_allclose(out[0, 1], (255, 255, 255))  # fully transparent black -> white
    np.testing.assert_allclose(out[0, 2], _blend((10, 100, 250), 128), atol=1)
    la = Image.new("LA", (2, 1))
    la.putpixel((0, 0), (0, 0))
    la.putpixel((1, 0), (40, 64))
    out = read_image(_saved(la)).astype(np.float64)
    np.testing.assert_allclose(out[0, 0], (255, 255, 255))
    np.testing.assert_allclose(out[0, 1], _blend((40, 40, 40), 64), atol=1)
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 30, 60, 90] + [0] * 762)
    palette.putpixel((0, 0), 0)
    palette.putpixel((1, 0), 1)
    for data in (_saved(palette, transparency=0), _saved(palette, "GIF", transparency=0)):
        out = read_image(data)
        assert tuple(out[0, 0]) == (255, 255, 255) and tuple(out[0, 1]) == (30, 60, 90)
    keyed = Image.new("RGB", (2, 1), (5, 5, 5))
    keyed.putpixel((1, 0), (7, 8, 9))
    out = read_image(_saved(keyed, transparency=(5, 5, 5)))  # PNG tRNS colour key
    assert tuple(out[0, 0]) == (255, 255, 255) and tuple(out[0, 1]) == (7, 8, 9)
    opaque = Image.new("RGBA", (1, 1), (1, 2, 3, 255))  # opaque alpha and plain images are unchanged
    assert tuple(read_image(_saved(opaque))[0, 0]) == (1, 2, 3)
    assert tuple(read_image(_saved(Image.new("L", (1, 1), 77)))[0, 0]) == (77, 77, 77)
