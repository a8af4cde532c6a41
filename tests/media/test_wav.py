"""`read_wav` against files written by PyAV (FFmpeg's WAV muxer) and by hand-built headers: WAVE_FORMAT_EXTENSIBLE
(what FFmpeg writes for more than 16 bits, more than 2 channels or more than 48 kHz) with PCM and IEEE float
sub-formats, plain 24-bit PCM and 32/64-bit float, refused compressed formats and sub-formats named. The old reader
(Python 3.11's `wave`) refused every extensible and float file."""

import io
import struct
import wave

import numpy as np
import pytest

from omnijax.media.audio import read_wav

av = pytest.importorskip("av")  # the test extra installs it

TONE = (0.5 * np.sin(np.arange(1000) / 7.0)).astype(np.float64)


def ffmpeg_wav(codec: str, rate: int = 16_000, layout: str = "mono") -> bytes:
    """TONE on every channel of `layout`, written by FFmpeg's WAV muxer with `codec`."""
    channels = av.AudioLayout(layout).nb_channels
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="wav") as container:
        stream = container.add_stream(codec, rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(np.tile(TONE, (channels, 1)), format="dblp", layout=layout)
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def format_tag(data: bytes) -> int:
    assert data[12:16] == b"fmt "
    return struct.unpack_from("<H", data, 20)[0]


@pytest.mark.parametrize("codec, rate, layout, bits", [
    ("pcm_s24le", 16_000, "mono", 24), ("pcm_s32le", 16_000, "stereo", 32), ("pcm_s16le", 96_000, "mono", 16),
    ("pcm_s16le", 16_000, "5.1", 16), ("pcm_f32le", 16_000, "5.1", 32), ("pcm_f64le", 96_000, "stereo", 64)])
def test_wave_format_extensible_from_ffmpeg(codec, rate, layout, bits):
    data = ffmpeg_wav(codec, rate, layout)
    assert format_tag(data) == 0xFFFE  # FFmpeg chose the extensible layout
    pcm, got_rate = read_wav(io.BytesIO(data))
    assert got_rate == rate and pcm.dtype == np.float32 and pcm.shape == TONE.shape
    np.testing.assert_allclose(pcm, TONE, atol=2.0 ** (1 - bits) * 2 + 1e-7)  # quantisation (one step) only


@pytest.mark.parametrize("codec, bits", [("pcm_s24le", 24), ("pcm_f32le", 32), ("pcm_f64le", 64), ("pcm_s16le", 16),
                                         ("pcm_u8", 8)])
def test_plain_formats_from_ffmpeg_and_files(tmp_path, codec, bits):
    data = ffmpeg_wav(codec)
    path = tmp_path / "tone.wav"
    path.write_bytes(data)
    for source in (io.BytesIO(data), path, str(path)):
        pcm, rate = read_wav(source)
        assert rate == 16_000
        np.testing.assert_allclose(pcm, TONE, atol=2.0 ** (1 - bits) * 2 + 1e-7)


def header(tag: int, channels: int, rate: int, bits: int, *, extra: bytes = b"", block: int | None = None) -> bytes:
    block = channels * bits // 8 if block is None else block
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits) + extra
    return b"fmt " + struct.pack("<I", len(fmt)) + fmt


def riff(*chunks: bytes) -> bytes:
    body = b"WAVE" + b"".join(chunks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def data_chunk(payload: bytes) -> bytes:
    return b"data" + struct.pack("<I", len(payload)) + payload + b"\0" * (len(payload) & 1)


def extensible(sub_tag: int, channels: int, bits: int, valid: int | None = None) -> bytes:
    guid = struct.pack("<I", sub_tag) + bytes.fromhex("00001000800000aa00389b71")
    extra = struct.pack("<HHI", 22, bits if valid is None else valid, 0) + guid
    return header(0xFFFE, channels, 16_000, bits, extra=extra)


def test_hand_built_headers_with_known_samples():
    values = [-8_388_608, -1, 0, 1, 4_194_304, 8_388_607]  # 24-bit: extremes, sign extension, a half
    payload = b"".join(struct.pack("<i", v)[:3] for v in values)
    expected = np.array(values, np.float64) / 2 ** 23
    odd = b"LIST" + struct.pack("<I", 3) + b"abc\0"  # an odd-sized chunk before the data: padded, skipped
    for fmt in (header(1, 1, 16_000, 24), extensible(1, 1, 24), extensible(1, 1, 24, valid=20)):
        pcm, rate = read_wav(io.BytesIO(riff(fmt, odd, data_chunk(payload))))
        np.testing.assert_array_equal(pcm, expected.astype(np.float32))
    stereo = np.array([[0.25, -0.75], [1.5, 0.5]], np.float32)  # float samples are kept as stored, channels averaged
    for fmt in (header(3, 2, 16_000, 32), extensible(3, 2, 32)):
        pcm, _ = read_wav(io.BytesIO(riff(fmt, data_chunk(stereo.astype("<f4").tobytes()))))
        np.testing.assert_array_equal(pcm, [-0.25, 1.0])
    cut = riff(header(1, 2, 16_000, 16), data_chunk(struct.pack("<4h", 100, 300, -200, 0)))[:-2]  # a partial frame
    pcm, _ = read_wav(io.BytesIO(cut))
    np.testing.assert_allclose(pcm, [200 / 32768])
    with io.BytesIO() as buffer:  # Python's own writer still reads as before
        with wave.open(buffer, "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(8_000)
            f.writeframes(struct.pack("<2h", -32768, 16384))
        assert read_wav(io.BytesIO(buffer.getvalue()))[0].tolist() == [-1.0, 0.5]


def test_other_formats_are_refused_by_name():
    samples = data_chunk(b"\0" * 8)
    cases = [(header(7, 1, 8_000, 8), "mu-law WAV audio is not supported"),
             (header(6, 1, 8_000, 8), "A-law WAV audio is not supported"),
             (header(0x55, 1, 8_000, 0, block=1), "MP3 WAV audio is not supported"),
             (header(0x1234, 1, 8_000, 16), "format tag 0x1234 WAV audio is not supported"),
             (extensible(7, 1, 8), "sub-format mu-law is not supported"),
             (header(0xFFFE, 1, 16_000, 16, extra=struct.pack("<HHI", 22, 16, 0) + bytes(range(16))),
              "sub-format 03020100-0504-0706-0809-0a0b0c0d0e0f is not supported"),
             (header(0xFFFE, 1, 16_000, 16), "WAVE_FORMAT_EXTENSIBLE 'fmt ' chunk needs 40 bytes"),
             (header(1, 1, 16_000, 64), "64-bit PCM samples are not supported"),
             (header(3, 1, 16_000, 16), "16-bit float samples are not supported")]
    for fmt, message in cases:
        with pytest.raises(ValueError, match=message):
            read_wav(io.BytesIO(riff(fmt, samples)))
    with pytest.raises(ValueError, match="no 'data' chunk"):
        read_wav(io.BytesIO(riff(header(1, 1, 16_000, 16))))
    with pytest.raises(ValueError, match="RF64"):
        read_wav(io.BytesIO(b"RF64" + riff(header(1, 1, 16_000, 16), samples)[4:]))
    with pytest.raises(ValueError, match="not a RIFF/WAVE file"):
        read_wav(io.BytesIO(b"OggS" + bytes(40)))
    nan = riff(header(3, 1, 16_000, 32), data_chunk(np.array([0.0, np.nan], "<f4").tobytes()))
    with pytest.raises(ValueError, match="NaN or infinite"):
        read_wav(io.BytesIO(nan))
    with pytest.raises(ValueError, match=r"24-bit samples are not supported here \(16-bit only\)"):
        read_wav(io.BytesIO(ffmpeg_wav("pcm_s24le")), widths=(2,))
    with pytest.raises(ValueError, match="nope.wav: not a readable WAV file"):
        read_wav("nope.wav")
