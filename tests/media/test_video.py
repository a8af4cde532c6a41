"""Video files -> units (`omnijax.media.video`): the frames are the ones the documented rule picks from the decoded
stream, the audio is the track at 16 kHz mono, every unit is accepted by the Qwen2.5-Omni frontend and gives the chunk
the same frames and PCM give, and bad files are refused with a message naming the problem."""

import math
import sys
from fractions import Fraction

import numpy as np
import pytest

from omnijax.media import video as video_lib
from omnijax.media.video import VideoError, open_video

av = pytest.importorskip("av", reason="PyAV (`av`, the `video` and `test` extras) encodes and decodes the test video")

FPS, HEIGHT, WIDTH, SECONDS, AUDIO_RATE = 10, 64, 96, 5.0, 44_100
FRAMES = int(SECONDS * FPS)


def _picture(i: int) -> np.ndarray:
    """Frame `i`: brightness rising with `i` and a bar moving across, so every frame differs."""
    image = np.full((HEIGHT, WIDTH, 3), (4 * i) % 256, np.uint8)
    image[:, (7 * i) % (WIDTH - 8):(7 * i) % (WIDTH - 8) + 8] = (255, 40, 40)
    return image


def _stereo(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * AUDIO_RATE)) / AUDIO_RATE
    return np.stack([0.4 * np.sin(2 * np.pi * 440 * t), 0.3 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)


def _write(path, *, audio: bool = True):
    frames = np.stack([_picture(i) for i in range(FRAMES)])
    return video_lib.write_clip(path, frames, FPS, _stereo(SECONDS) if audio else None, AUDIO_RATE)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("video")
    return _write(root / "clip.mp4"), _write(root / "silent.mp4", audio=False)


def _decoded_frames(path, **size) -> np.ndarray:
    """Every frame of the file, decoded in one pass."""
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24", **size) for f in container.decode(video=0)])


def _rule(k: int, unit_seconds: float, native_fps: int, count: int, last: int) -> list[int]:
    """The documented rule, written out: unit k's clip holds native frames [ceil(k U r), ceil((k+1) U r)); take
    `first + floor(j * total / count)`, clamped to the last frame."""
    first = math.ceil(k * unit_seconds * native_fps - 1e-9)
    total = math.ceil((k + 1) * unit_seconds * native_fps - 1e-9) - first
    return [min(first + j * total // count, last) for j in range(count)]


def _track(path) -> np.ndarray:
    """The whole audio track through one PyAV resampler (16 kHz, the track's channels), averaged to mono."""
    resampler = av.AudioResampler(format="fltp", rate=16_000)
    with av.open(str(path)) as container:
        pieces = [out.to_ndarray() for frame in container.decode(audio=0) for out in resampler.resample(frame)]
    pieces += [out.to_ndarray() for out in resampler.resample(None)]
    return np.concatenate(pieces, axis=1).mean(axis=0, dtype=np.float32)


def _independent_units(path, frame_size=None):
    """(frames, pcm) per 2 s unit, picked from the whole decoded file by the documented rule."""
    size = {} if frame_size is None else {"height": frame_size[0], "width": frame_size[1]}
    frames, track = _decoded_frames(path, **size), _track(path)
    units = []
    for k in range(math.ceil(len(frames) / (2.0 * FPS))):
        pcm = np.zeros(32_000, np.float32)
        piece = track[k * 32_000:(k + 1) * 32_000]
        pcm[:piece.shape[0]] = piece
        units.append((frames[_rule(k, 2.0, FPS, 4, len(frames) - 1)], pcm))
    return units


def test_units_are_the_documented_frames_and_the_track_at_16_khz(clips):
    clip, _ = clips
    video = open_video(clip)
    assert (video.duration_s, video.num_units, video.frames_per_unit, video.samples_per_unit) == (5.0, 3, 4, 32_000)
    assert (video.width, video.height, video.native_fps, video.num_frames, video.has_audio) == (96, 64, 10, 50, True)
    # The processor's selection for the whole 5 s file at fps 2: arange(0, 50, 50 / 10) = 0, 5, ..., 45; the padded
    # last unit repeats frame 49, the last one.
    assert [video.frame_indices(k) for k in range(3)] == [[0, 5, 10, 15], [20, 25, 30, 35], [40, 45, 50, 55]]
    assert np.arange(0, 50, 50 / 10).astype(int).tolist() == [i for k in range(3) for i in video.frame_indices(k)
                                                              if i < 50]
    units = list(video.units())
    expected = _independent_units(clip)
    assert len(units) == len(expected) == 3
    for k, ((frames, pcm), (want_frames, want_pcm)) in enumerate(zip(units, expected)):
        assert frames.shape == (4, 64, 96, 3) and frames.dtype == np.uint8, k
        assert pcm.shape == (32_000,) and pcm.dtype == np.float32, k
        np.testing.assert_array_equal(frames, want_frames, err_msg=f"unit {k} frames")
        np.testing.assert_array_equal(pcm, want_pcm, err_msg=f"unit {k} audio")
    np.testing.assert_array_equal(units[2][0][2], units[2][0][3])  # the padded tail repeats the last frame
    # Resampled independently (mean of the channels at the native rate, then an FFT resampler): equal up to the
    # resamplers' filters, away from the ends.
    with av.open(str(clip)) as container:
        native = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=1).mean(axis=0)
    count = int(round(native.shape[0] * 16_000 / AUDIO_RATE))
    resampled = np.fft.irfft(np.fft.rfft(native)[:count // 2 + 1], count) * count / native.shape[0]
    pcm = np.concatenate([p for _, p in units])
    interior = slice(1_600, 78_400)
    assert np.abs(pcm[interior] - resampled[interior]).max() < 0.03
    rms = float(np.sqrt(np.mean(pcm[interior] ** 2)))  # the mean of 0.4 and 0.3 sines: sqrt(0.2^2 + 0.15^2) / sqrt(2)
    assert abs(rms - 0.1768) < 0.01  # (swresample's own downmix would give 1.41x that)
    assert not pcm[82_000:].any()  # silence past the track's end (5.02 s)


def test_frame_size_no_audio_tail_drop_and_single_frame_units(clips):
    clip, silent = clips
    resized = list(open_video(clip, frame_size=(32, 48)).units())
    for (frames, pcm), (want_frames, want_pcm) in zip(resized, _independent_units(clip, frame_size=(32, 48))):
        np.testing.assert_array_equal(frames, want_frames)
        np.testing.assert_array_equal(pcm, want_pcm)
    quiet = open_video(silent, need_audio=False)
    assert not quiet.has_audio and quiet.num_units == 3
    for (frames, pcm), (want, _) in zip(quiet.units(), _independent_units(clip)):
        assert frames.shape == want.shape and pcm.shape == (32_000,) and not pcm.any()
    dropped = open_video(clip, tail="drop")
    assert dropped.num_units == 2
    for (frames, pcm), (want_frames, want_pcm) in zip(dropped.units(), _independent_units(clip)):
        np.testing.assert_array_equal(frames, want_frames)
        np.testing.assert_array_equal(pcm, want_pcm)
    # MiniCPM-o's units: one frame and 1 s of audio per second.
    single = open_video(clip, unit_seconds=1.0, fps=1.0, temporal_patch_size=1)
    units = list(single.units())
    all_frames, track = _decoded_frames(clip), _track(clip)
    assert single.num_units == len(units) == 5
    for k, (frames, pcm) in enumerate(units):
        np.testing.assert_array_equal(frames, all_frames[[10 * k]])
        np.testing.assert_array_equal(pcm, track[k * 16_000:(k + 1) * 16_000])
    # Closing the generator early closes the file; a second pass decodes again from the start.
    video = open_video(clip)
    first = video.units()
    np.testing.assert_array_equal(next(first)[0], next(video.units())[0])
    first.close()


def test_a_late_audio_track_is_preceded_by_silence(tmp_path):
    """Audio whose stream starts 0.5 s after the video (its packets' timestamps say so) lands 0.5 s into the units."""
    path = tmp_path / "late.mp4"
    with av.open(str(path), "w") as container:
        video = container.add_stream("mpeg4", rate=FPS)
        video.width, video.height, video.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        sound = container.add_stream("aac", rate=16_000)
        sound.layout = "mono"
        for i in range(30):
            for packet in video.encode(av.VideoFrame.from_ndarray(_picture(i), format="rgb24")):
                container.mux(packet)
        wave = (0.5 * np.sin(2 * np.pi * 440 * np.arange(32_000) / 16_000)).astype(np.float32)[None]
        for start in range(0, wave.shape[1], 1024):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave[:, start:start + 1024]), format="fltp",
                                               layout="mono")
            frame.sample_rate, frame.time_base, frame.pts = 16_000, Fraction(1, 16_000), 8_000 + start
            for packet in sound.encode(frame):
                container.mux(packet)
        for stream in container.streams:
            for packet in stream.encode(None):
                container.mux(packet)
    with av.open(str(path)) as container:
        lead = int(container.streams.audio[0].start_time)  # 16 kHz ticks (the encoder's priming comes first)
        assert container.streams.video[0].start_time == 0 and 6_000 < lead <= 8_000
    pcm = np.concatenate([p for _, p in open_video(path).units()])
    track = _track(path)
    assert pcm.shape == (64_000,) and not pcm[:lead].any()
    np.testing.assert_array_equal(pcm[lead:lead + track.shape[0]], track)
    assert not pcm[lead + track.shape[0]:].any()


def test_the_harness_reads_files_through_this_module(clips):
    from omnijax.eval.media import DecodedVideo

    clip, _ = clips
    source = DecodedVideo(clip, frame_size=(32, 48))
    assert source.duration_s == 5.0 and source.kind == "video file"
    units = list(source.units(5))  # two units past the end of the file
    own = list(open_video(clip, frame_size=(32, 48)).units())
    for (frames, pcm), (want_frames, want_pcm) in zip(units, own):
        np.testing.assert_array_equal(frames, want_frames)
        np.testing.assert_array_equal(pcm, want_pcm)
    for frames, pcm in units[3:]:
        assert (frames == own[-1][0][-1]).all() and frames.shape == (4, 32, 48, 3) and not pcm.any()


def test_frames_per_unit_is_the_frontends_count():
    from omnijax.models.qwen2_5_omni import frontend

    for seconds, fps, patch in ((2.0, 2.0, 2), (1.0, 2.0, 2), (2.4, 2.0, 2), (3.0, 1.5, 2), (1.0, 1.0, 1),
                                (0.5, 2.0, 2), (4.0, 0.5, 2)):
        assert video_lib.frames_per_unit(seconds, fps, patch) == frontend.expected_frames(
            int(round(seconds * 16_000)), fps, temporal_patch_size=patch), (seconds, fps, patch)
    # 29.97 fps: 2 s clips of 59 or 60 frames, four frames each, spread over the clip.
    rate = Fraction(30_000, 1_001)
    assert video_lib.unit_frame_indices(0, 2.0, rate, 4) == [0, 15, 30, 45]  # frames 0..59
    assert video_lib.unit_frame_indices(16, 2.0, rate, 4) == [960, 974, 989, 1004]  # frames 960..1018


def test_bad_files_and_arguments_are_refused_with_the_reason(clips, tmp_path, monkeypatch):
    clip, silent = clips
    missing = tmp_path / "nowhere.mp4"
    with pytest.raises(VideoError, match=r"nowhere\.mp4: no such file"):
        open_video(missing)
    text = tmp_path / "notes.mp4"
    text.write_text("these are not frames\n")
    with pytest.raises(VideoError, match=r"cannot read .*notes\.mp4 as a video: Invalid data"):
        open_video(text)
    with pytest.raises(VideoError, match="not a file"):
        open_video(tmp_path)
    with pytest.raises(VideoError, match=r"silent\.mp4 has no audio track.*need_audio=False.*--silent-video"):
        open_video(silent)
    audio_only = tmp_path / "tone.m4a"
    with av.open(str(audio_only), "w") as container:
        stream = container.add_stream("aac", rate=16_000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16_000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    with pytest.raises(VideoError, match="has no video stream"):
        open_video(audio_only)
    with pytest.raises(VideoError, match="less than one 8 s unit"):
        open_video(clip, unit_seconds=8.0, tail="drop")
    with pytest.raises(ValueError, match="no whole temporal patch of 2 frames"):
        open_video(clip, unit_seconds=1.0, fps=1.0)
    with pytest.raises(ValueError, match="tail must be one of"):
        open_video(clip, tail="trim")
    with pytest.raises(ValueError, match="frame_size"):
        open_video(clip, frame_size=(0, 48))
    monkeypatch.setitem(sys.modules, "av", None)  # as if PyAV were not installed
    with pytest.raises(ImportError, match=r"pip install av"):
        open_video(clip)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny converted Qwen2.5-Omni checkpoint with both encoders (`tests/_support/tiny_omni.py`)."""
    import omnijax
    from tests._support import tiny_omni

    return omnijax.load(tiny_omni.checkpoint(tmp_path_factory.mktemp("video_model")))


@pytest.mark.filterwarnings("ignore:.*has no tokenizer files")
def test_every_unit_makes_the_frontends_chunk(clips, model):
    """The frontend takes every unit as it comes (no FrameCountError, the padded tail included) and gives the chunk
    it gives for the frames and PCM picked independently from the decoded file."""
    from omnijax.models.qwen2_5_omni import frontend

    clip, _ = clips
    small = {"min_pixels": 56 * 56}  # keep 64x96 frames near their size (56x84: 2x3 tokens per temporal patch)
    for k, ((frames, pcm), (want_frames, want_pcm)) in enumerate(zip(open_video(clip).units(),
                                                                     _independent_units(clip))):
        chunk = frontend.audiovisual_chunk(model, frames, pcm, unit=1 + k, **small)
        want = frontend.audiovisual_chunk(model, want_frames, want_pcm, unit=1 + k, **small)
        # 4 markers, 2 temporal patches of 2x3 video tokens, 2 s of audio (25 tokens a second)
        assert chunk.length == want.length == 4 + 2 * 6 + 50, k
        for name in ("token_ids", "valid", "positions", "unit", "span", "offset", "advance", "embed_mask", "embeds"):
            np.testing.assert_array_equal(np.asarray(getattr(chunk, name)), np.asarray(getattr(want, name)),
                                          err_msg=f"unit {k}: {name}")
