"""Qwen2.5-Omni speaks about a video with its audio: `speech.speak(..., media=[an audiovisual unit's rows with its
layout])` reruns the thinker over a prompt holding the unit (the vision and audio encoders' rows at its
placeholders, at the positions it was fed with: transformers' `use_audio_in_video` layout) and lays the talker's own
positions out the same way, and equals transformers' `generate(pixel_values_videos=..., video_grid_thw=...,
input_features=..., use_audio_in_video=True, return_audio=True, talker_do_sample=False)`: the same talker tokens,
the waveform within 1e-4 of its peak (the DiT's noise drawn from the same torch seed). The unit is what `omnijax.Chat`
and `omnijax watch` feed (`frontend.audiovisual_chunk`), its rows and layout what they keep (`media_rows`).

The reference is `test_speech_media_image`'s: the tiny full model whose talker config's media ids are the thinker's
(as the release's are), so that the talker's `get_rope_index` lays the video out too.
"""

import numpy as np
import pytest

from omnijax.models.encoders import qwen_vl_preprocess as vision_preprocess
from omnijax.models.encoders.log_mel import log_mel
from omnijax.models.qwen2_5_omni import frontend as F
from omnijax.models.qwen2_5_omni import speech as S
from omnijax.models.speech import MediaRows, media_rows
from tests._support.speech_refs import assert_speaks_as_transformers, captured_talker

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

from tests.models.qwen2_5_omni import test_speech as TS  # noqa: E402
from tests.models.qwen2_5_omni import test_speech_media_image as TI  # noqa: E402
from tests.models.qwen2_5_omni import test_talker as T  # noqa: E402

pair = TI.pair
IM_START, IM_END, NL = TS.IM_START, TS.IM_END, TS.NL
FPS, SECONDS = 2.0, 2.0
FRAMES = F.synthetic_frames(SECONDS, FPS, 56, 84, seed=4)
PCM = F.tone(SECONDS, 330.0, seed=6)


def test_speak_about_a_video_with_its_audio_equals_transformers_generate_return_audio(pair):
    full, model = pair
    omni, vision = model.omni, model.vision.config
    pixel_values, grid = vision_preprocess.preprocess_video(
        FRAMES, patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size)
    grid = tuple(int(g) for g in grid[0])
    chunk = F.audiovisual_chunk(model, FRAMES, PCM, unit=1, fps=FPS)
    valid = np.asarray(chunk.valid, bool)[0]
    ids = np.asarray(chunk.token_ids)[0][valid]
    head = [IM_START, 10, NL, 11, 12, IM_END, NL, IM_START, 14, NL]
    prompt = np.asarray([*head, *ids, 15, 16, IM_END, NL, IM_START, 20, NL])
    rows = media_rows(chunk, chunk.embeds, 0, len(head), omni)
    assert rows.layout is not None and rows.layout.shape == (3, len(ids)) and rows.grid is None
    assert {omni.video_token_id, omni.audio_token_id} <= set(ids[1:-1].tolist()) and grid[0] > 1
    mel = log_mel(PCM)
    torch.manual_seed(TS.SEED)  # the DiT's torch.randn is the first draw after it
    with captured_talker(full) as seen, torch.no_grad():
        sequence, wav = full.generate(
            input_ids=torch.as_tensor(prompt)[None], pixel_values_videos=torch.as_tensor(np.asarray(pixel_values)),
            video_grid_thw=torch.as_tensor([grid]),
            video_second_per_grid=torch.as_tensor([vision.temporal_patch_size / FPS]),
            input_features=torch.as_tensor(mel)[None],
            feature_attention_mask=torch.ones((1, mel.shape[1]), dtype=torch.long), use_audio_in_video=True,
            speaker="Chelsie", return_audio=True, thinker_max_new_tokens=TS.ANSWER_TOKENS, thinker_do_sample=False,
            thinker_eos_token_id=IM_END, talker_max_new_tokens=TS.FRAMES, talker_do_sample=False,
            talker_eos_token_id=T.STOP)
    sequence, wav = sequence[0].numpy(), wav.reshape(-1).numpy()
    want_tokens = seen[0][0, len(prompt) + 2:].numpy()
    answer = sequence[len(prompt):]
    assert len(answer) >= 3, "the answer is too short to have trailing text rows"
    spoken = S.speak(model, prompt, answer[:-1], speaker="Chelsie", max_new_tokens=TS.FRAMES,
                     noise=TS._torch_noise, media=[rows])
    assert_speaks_as_transformers(spoken, want_tokens, wav)
    # the layout matters: the unit's tokens at consecutive positions give other speech
    flat = MediaRows(rows.positions, rows.rows, layer=0,
                     layout=np.broadcast_to(np.arange(len(ids), dtype=np.int32), (3, len(ids))))
    other = S.speak(model, prompt, answer[:-1], speaker="Chelsie", max_new_tokens=TS.FRAMES,
                    noise=TS._torch_noise, media=[flat])
    assert not np.array_equal(other.talker_tokens, want_tokens)
    # refused by name: a video without its layout, a layout longer than the prompt
    with pytest.raises(ValueError, match="video group at 10 without its layout"):
        S.speak(model, prompt, answer[:-1], media=[MediaRows(rows.positions, rows.rows, layer=0)])
    with pytest.raises(ValueError, match="runs past its end"):
        S.rope_positions(prompt[:12], omni.audio_start_token_id, omni.audio_token_id, omni.vision_start_token_id,
                         omni.image_token_id, [], 2, 25, what="prompt", video=omni.video_token_id,
                         layouts=[rows.layout])
