"""Qwen2.5-Omni speaks about an image: `speech.speak(..., media=[rows with their grid])` reruns the thinker over a
prompt holding an image (the vision encoder's rows at its placeholders, the thinker's TMRoPE image layout) and lays
the talker's own positions out with its config's ids, and equals transformers' `generate(pixel_values=...,
image_grid_thw=..., return_audio=True, talker_do_sample=False)`: the same talker tokens, the waveform within 1e-4 of
its peak (the DiT's noise drawn from the same torch seed).

The reference is `test_talker`'s tiny full model with its talker config's media ids set to the thinker's (as the
release's are), so that the talker's `get_rope_index` lays the image out too. With the tiny config's default talker
ids (the release's, outside the tiny vocabulary) the reference numbers the talker's image as text; omnijax follows
(checked against transformers once, 2026-12-06; here `rope_positions` with ids that mark no group, to keep the module
under 30 s warm). Mutations the equality test catches: the talker's positions consecutive (13 of 14 talker tokens
differ), the thinker's positions consecutive (11 of 14 differ).
"""

import numpy as np
import pytest

import omnijax
from omnijax.convert import convert_checkpoint
from omnijax.models.encoders import qwen_vl_preprocess as vision_preprocess
from omnijax.models.qwen2_5_omni import frontend as F
from omnijax.models.qwen2_5_omni import speech as S
from omnijax.models.speech import MediaRows
from tests._support import hf_models
from tests._support.speech_refs import assert_speaks_as_transformers, captured_talker

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")
pytest.importorskip("transformers", reason="transformers (the test extra) is the reference")

from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration  # noqa: E402

from tests.models.qwen2_5_omni import test_speech as TS  # noqa: E402
from tests.models.qwen2_5_omni import test_talker as T  # noqa: E402

IM_START, IM_END, NL = TS.IM_START, TS.IM_END, TS.NL
IMAGE = F.synthetic_frames(0.5, 2.0, 56, 84, seed=3)[0]


def _full_model(media_ids: bool):
    """`test_talker.seeded_full_model()`'s weights under a config whose talker reads the thinker's media ids."""
    base = T.seeded_full_model()
    if not media_ids:
        return base
    th = hf_models.thinker_config()
    talker = dict(T.TALKER, audio_token_index=th.audio_token_index, image_token_index=th.image_token_index,
                  video_token_index=th.video_token_index, vision_start_token_id=th.vision_start_token_id,
                  audio_start_token_id=th.audio_start_token_id,
                  spatial_merge_size=th.vision_config.spatial_merge_size, position_id_per_seconds=25)
    full = Qwen2_5OmniForConditionalGeneration(Qwen2_5OmniConfig(
        thinker_config=th.to_dict(), talker_config=talker, token2wav_config=T.TOKEN2WAV,
        enable_audio_output=True)).eval()
    full.load_state_dict(base.state_dict())
    return full


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    full = _full_model(True)
    root = tmp_path_factory.mktemp("speech25img")
    full.save_pretrained(root / "hf", safe_serialization=True)
    voices = TS._voices(full)
    torch.save(voices, root / "hf" / "spk_dict.pt")
    full.load_speakers(root / "hf" / "spk_dict.pt")
    with pytest.warns(UserWarning, match="no tokenizer files"):
        model = omnijax.load(convert_checkpoint(root / "hf", root / "out", progress=False, log=lambda _: None))
    return full, model


def test_speak_about_an_image_equals_transformers_generate_return_audio(pair):
    full, model = pair
    omni = model.omni
    assert model.speech.talker.config.vision_start_token_id == omni.vision_start_token_id
    vision = model.vision.config
    pixel_values, grid = vision_preprocess.preprocess_images(
        IMAGE, patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
        temporal_patch_size=vision.temporal_patch_size)
    grid = tuple(int(g) for g in grid[0])
    chunk = F.image_chunk(model, IMAGE, unit=1)
    valid = np.asarray(chunk.valid, bool)[0]
    ids = np.asarray(chunk.token_ids)[0][valid]
    holes = ids == omni.image_token_id
    head = [IM_START, 10, NL, 11, 12, IM_END, NL, IM_START, 14, NL]
    prompt = np.asarray([*head, *ids, 15, 16, IM_END, NL, IM_START, 20, NL])
    rows = MediaRows(positions=len(head) + np.flatnonzero(holes),
                     rows=np.asarray(chunk.embeds)[0][:valid.shape[0]][valid][holes], layer=0, grid=grid)
    assert rows.rows.shape[0] == 6 and grid[1] != grid[2]  # a 2 x 3 merged grid: height and width positions differ
    torch.manual_seed(TS.SEED)  # the DiT's torch.randn is the first draw after it
    with captured_talker(full) as seen, torch.no_grad():
        sequence, wav = full.generate(
            input_ids=torch.as_tensor(prompt)[None], pixel_values=torch.as_tensor(np.asarray(pixel_values)),
            image_grid_thw=torch.as_tensor([grid]), speaker="Chelsie", return_audio=True,
            thinker_max_new_tokens=TS.ANSWER_TOKENS, thinker_do_sample=False, thinker_eos_token_id=IM_END,
            talker_max_new_tokens=TS.FRAMES, talker_do_sample=False, talker_eos_token_id=T.STOP)
    sequence, wav = sequence[0].numpy(), wav.reshape(-1).numpy()
    want_tokens = seen[0][0, len(prompt) + 2:].numpy()
    answer = sequence[len(prompt):]
    assert len(answer) >= 3, "the answer is too short to have trailing text rows"
    spoken = S.speak(model, prompt, answer[:-1], speaker="Chelsie", max_new_tokens=TS.FRAMES,
                     noise=TS._torch_noise, media=[rows])
    assert_speaks_as_transformers(spoken, want_tokens, wav)
    # the layout: the image's rows on a 2 x 3 grid from its start marker + 1, the text after it from max + 1
    laid = S.rope_positions(prompt, omni.audio_start_token_id, omni.audio_token_id, omni.vision_start_token_id,
                            omni.image_token_id, [grid], vision.spatial_merge_size, 25, what="prompt")
    at = len(head) + 1
    np.testing.assert_array_equal(laid[:, at:at + 6], at + np.asarray([[0] * 6, [0, 0, 0, 1, 1, 1], [0, 1, 2] * 2]))
    np.testing.assert_array_equal(laid[:, at + 6], [at + 3] * 3)  # <|vision_eos|>
    assert laid[0, -1] == at + 3 + (len(prompt) - 1 - (at + 6))  # the text after: one a token from eos + 1
    # ids that mark no group (the talker's with the release's defaults here): text, the grid left unused
    text = S.rope_positions(prompt, -1, -1, -1, -1, [grid], 2, 25, what="talker", strict=False)
    np.testing.assert_array_equal(text, np.broadcast_to(np.arange(len(prompt)), (3, len(prompt))))
    with pytest.raises(ValueError, match="fewer image groups"):
        S.rope_positions(prompt, -1, -1, -1, -1, [grid], 2, 25, what="talker")
    with pytest.raises(ValueError, match="image group at 10 without its grid"):
        S.speak(model, prompt, answer[:-1], media=[MediaRows(rows.positions, rows.rows, layer=0)])
