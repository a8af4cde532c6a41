"""A video file cut short (MP4 with its index at the front, `faststart`, truncated in the middle) still states its
full length. The old reader fed the stated length: past the cut, units held the last frame with silence, with no
warning. Now the units stop at the decoded end and a `TruncatedVideoWarning` names the file, the stated and the
decoded durations."""

import math
import warnings

import numpy as np
import pytest

from omnijax.media.video import TruncatedVideoWarning, VideoError, open_video

av = pytest.importorskip("av", reason="PyAV (`av`, the `video` and `test` extras) encodes and decodes the test video")

FPS, SECONDS, RATE = 10, 20, 16_000


def write_faststart(path, *, audio: bool) -> bytes:
    """20 s at 10 fps (every frame a different grey) with a 440 Hz tone, interleaved, index first."""
    with av.open(str(path), "w", options={"movflags": "faststart"}) as container:
        video = container.add_stream("mpeg4", rate=FPS)
        video.width, video.height, video.pix_fmt = 96, 64, "yuv420p"
        sound = container.add_stream("aac", rate=RATE, layout="mono") if audio else None
        tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(SECONDS * RATE) / RATE)).astype(np.float32)[None]
        written = 0
        for i in range(SECONDS * FPS):
            picture = np.full((64, 96, 3), (4 * i) % 256, np.uint8)
            for packet in video.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                container.mux(packet)
            while sound is not None and written < (i + 1) * RATE // FPS:
                piece = av.AudioFrame.from_ndarray(np.ascontiguousarray(tone[:, written:written + 1024]),
                                                   format="fltp", layout="mono")
                piece.sample_rate = RATE
                for packet in sound.encode(piece):
                    container.mux(packet)
                written += 1024
        for stream in container.streams:
            for packet in stream.encode(None):
                container.mux(packet)
    return path.read_bytes()


def decoded_frames(path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


@pytest.mark.parametrize("audio", [True, False])
def test_a_truncated_file_stops_at_its_decoded_end_with_a_warning(tmp_path, audio):
    whole = tmp_path / "whole.mp4"
    data = write_faststart(whole, audio=audio)
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[:len(data) // 2])
    video = open_video(cut, need_audio=audio)
    assert video.duration_s == SECONDS and video.num_units == 10  # the header still states 20 s
    native = decoded_frames(cut)
    decoded = native.shape[0]
    assert 0 < decoded < SECONDS * FPS - 20  # the stream really ends early (about half way)
    with pytest.warns(TruncatedVideoWarning) as caught:
        units = list(video.units())
    assert len(caught) == 1
    message = str(caught[0].message)
    assert str(cut) in message and f"ends after {decoded / FPS:.2f} s" in message and "states 20.00 s" in message
    expected = math.ceil(decoded / (2 * FPS))  # the unit the stream ended in is the last (completed: tail="pad")
    assert len(units) == expected and f"after {expected} of 10 units" in message
    for k, (frames, pcm) in enumerate(units):
        assert frames.shape == (4, 64, 96, 3) and pcm.shape == (32_000,)
        np.testing.assert_array_equal(frames, native[[min(i, decoded - 1) for i in video.frame_indices(k)]])
        if audio and k < expected - 1:  # whole units carry the tone
            assert 0.2 < np.abs(pcm).max() < 0.4
    with pytest.warns(TruncatedVideoWarning, match=f"after {decoded // (2 * FPS)} of 10 units"):
        dropped = list(open_video(cut, need_audio=audio, tail="drop").units())
    assert len(dropped) == decoded // (2 * FPS)  # tail="drop" leaves out the partial unit
    with warnings.catch_warnings():  # the whole file: every unit, no warning
        warnings.simplefilter("error", TruncatedVideoWarning)
        assert len(list(open_video(whole, need_audio=audio).units())) == 10


def test_damaged_audio_where_the_video_goes_on_is_still_an_error(tmp_path):
    path = tmp_path / "whole.mp4"
    data = bytearray(write_faststart(path, audio=True))
    with av.open(str(path)) as container:  # the first audio packet past 2 s, overwritten with garbage
        packet = next(p for p in container.demux(audio=0) if p.pts is not None and p.pts * p.time_base > 2)
        at, size = packet.pos, packet.size
    data[at:at + size] = bytes([0xFF]) * size
    path.write_bytes(bytes(data))
    with pytest.raises(VideoError, match="decoding unit 1 failed"):  # the packet is in unit 1 (2-4 s)
        list(open_video(path).units())


def test_a_few_frames_short_is_no_truncation(tmp_path):
    """Up to half a second short of the stated length (an audio track a little longer than the video makes that of
    a container's duration) reads as before: every unit, no warning, no error from an audio packet cut at the end."""
    data = write_faststart(tmp_path / "whole.mp4", audio=True)
    cut = tmp_path / "cut.mp4"
    for size in range(len(data) - 200, len(data) // 2, -200):  # the first cut that loses 1-4 frames
        cut.write_bytes(data[:size])
        native = decoded_frames(cut)
        if native.shape[0] < SECONDS * FPS:
            break
    assert SECONDS * FPS - 5 < native.shape[0] < SECONDS * FPS
    video = open_video(cut)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TruncatedVideoWarning)
        units = list(video.units())
    assert len(units) == 10
    frames, pcm = units[-1]
    np.testing.assert_array_equal(frames, native[[min(i, native.shape[0] - 1) for i in video.frame_indices(9)]])
    assert 0.2 < np.abs(pcm[:16_000]).max() < 0.4
