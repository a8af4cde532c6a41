"""Media files for `hostile_probe`, built byte by byte so that every header field can lie: WAV (RIFF) files with any
format tag, rate, width, channel count and chunk sizes, WAVE_FORMAT_EXTENSIBLE ones, PNG headers claiming any size,
truncated and corrupted PNG / JPEG files, and base64 data URLs of them. Nothing here talks to a server."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np

PCM, FLOAT, EXTENSIBLE = 0x0001, 0x0003, 0xFFFE
_GUID_TAIL = bytes.fromhex("00001000800000aa00389b71")  # KSDATAFORMAT_SUBTYPE_* after the 2-byte format tag


def tone(seconds: float = 0.5, rate: int = 16000, channels: int = 1) -> bytes:
    """int16 little-endian PCM of a 440 Hz tone, `channels` interleaved."""
    t = np.arange(int(seconds * rate)) / rate
    mono = (0.3 * 32767 * np.sin(2 * np.pi * 440 * t)).astype("<i2")
    return np.repeat(mono[:, None], channels, axis=1).tobytes()


def wav(pcm: bytes | None = None, *, rate: int = 16000, channels: int = 1, bits: int = 16, tag: int = PCM,
        block_align: int | None = None, byte_rate: int | None = None, data_size: int | None = None,
        fmt_extra: bytes = b"", fmt_size: int | None = None, chunks: bytes = b"", riff: bytes = b"RIFF",
        wave: bytes = b"WAVE", with_fmt: bool = True, with_data: bool = True) -> bytes:
    """A RIFF/WAVE file whose every header field can be set, right or wrong.

    Args:
        pcm: the data chunk's payload (default: half a second of mono 16 kHz tone).
        rate, channels, bits, tag: the fmt chunk's sample rate, channel count, bits per sample, format tag.
        block_align, byte_rate: default to the values the other fields imply.
        data_size: the size the data chunk's header claims (default: the payload's).
        fmt_extra: bytes after the 16-byte fmt body (cbSize and WAVE_FORMAT_EXTENSIBLE fields).
        fmt_size: the size the fmt chunk's header claims (default: its real size).
        chunks: raw chunks placed between fmt and data.
        riff, wave: the magic words.
        with_fmt, with_data: leave out the fmt / data chunk.
    """
    pcm = tone() if pcm is None else pcm
    align = channels * bits // 8 if block_align is None else block_align
    rate_b = rate * align if byte_rate is None else byte_rate
    fmt_body = struct.pack("<HHIIHH", tag, channels, rate, rate_b & 0xFFFFFFFF, align & 0xFFFF, bits) + fmt_extra
    body = wave
    if with_fmt:
        body += b"fmt " + struct.pack("<I", len(fmt_body) if fmt_size is None else fmt_size) + fmt_body
    body += chunks
    if with_data:
        body += b"data" + struct.pack("<I", len(pcm) if data_size is None else data_size) + pcm
    return riff + struct.pack("<I", len(body)) + body


def extensible(subformat: int = PCM, *, bits: int = 16, valid_bits: int | None = None, cb_size: int = 22,
               truncate: int | None = None, guid_tail: bytes = _GUID_TAIL) -> bytes:
    """The fmt extension of WAVE_FORMAT_EXTENSIBLE: cbSize, valid bits, channel mask, sub-format GUID (optionally
    cut after `truncate` bytes)."""
    ext = struct.pack("<HHI", cb_size, bits if valid_bits is None else valid_bits, 0x4) + struct.pack("<I", subformat)
    ext += guid_tail  # the GUID: the format tag as its first 4 bytes, then the KSDATAFORMAT tail
    return ext if truncate is None else ext[:truncate]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{b64(data)}"


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def png_header(width: int, height: int, *, color: int = 2, rows: int = 1) -> bytes:
    """A PNG whose IHDR claims `width` x `height` (8-bit, colour type `color`) followed by an IDAT holding only
    `rows` zero rows: a few hundred bytes that ask for any size once decoded."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0)
    bpp = {0: 1, 2: 3, 4: 2, 6: 4}[color]
    raw = (b"\x00" + b"\x00" * (width * bpp)) * max(0, min(rows, height)) if width * bpp < 10 ** 7 else b""
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw, 9)) + \
        _chunk(b"IEND", b"")


def png_zeros(width: int, height: int) -> bytes:
    """A whole, valid black RGB PNG of `width` x `height` (compresses to little: a real decoding cost for its
    bytes)."""
    row = b"\x00" + b"\x00" * (3 * width)
    comp = zlib.compressobj(9)
    data = b"".join(comp.compress(row) for _ in range(height)) + comp.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", data) + _chunk(b"IEND", b"")


def image(width: int = 32, height: int = 32, *, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    """A small gradient image through PIL (`mode` RGB, RGBA with a transparent half, L, P; `fmt` PNG, JPEG, GIF,
    WEBP, BMP)."""
    from PIL import Image

    x = np.linspace(0, 255, width, dtype=np.float32)[None, :] * np.ones((height, 1), np.float32)
    rgb = np.stack([x, x[::-1], np.full_like(x, 128)], axis=-1).astype(np.uint8)
    img = Image.fromarray(rgb)
    if mode == "RGBA":
        alpha = np.full((height, width), 255, np.uint8)
        alpha[:, : width // 2] = 0
        img.putalpha(Image.fromarray(alpha))
    elif mode != "RGB":
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def corrupt(data: bytes, start: int = 40, count: int = 16) -> bytes:
    """`data` with `count` bytes from `start` inverted (a damaged IDAT / scan)."""
    mid = bytes(b ^ 0xFF for b in data[start:start + count])
    return data[:start] + mid + data[start + count:]
