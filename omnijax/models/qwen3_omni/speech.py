"""Qwen3-Omni speech output, whole utterances: a converted full release's talker, code predictor and Code2Wav
(`Qwen3Speech`, `model.speech` of a loaded checkpoint), and `speak`, which turns a thinker's prompt and text answer
into 24 kHz PCM as transformers' `Qwen3OmniMoeForConditionalGeneration.generate(..., return_audio=True)` does under
greedy decoding.

What `speak` feeds the talker (`talker_forward.talker_prompt`): the thinker's embedding-layer rows of the prompt's
user turns and of the answer (system turns and earlier answers are skipped), the `tts_bos` / `tts_eos` / `tts_pad`
rows, the speaker's codec id, and at the audio / image placeholders of user turns the thinker's
`hidden_states[accept_hidden_layer]` (layer k's output before DeepStack, as transformers records it), given as
`media` (`omnijax.models.speech.MediaRows`: `omnijax.Chat` keeps them from the step that fed each media unit, a tap
of the compiled step). The talker's own positions are the thinker-style `get_rope_index` of its input ids (user
turns and the assistant prefix), with the grids of the images in them (audio and text ids are consecutive). Videos
in a user turn are refused by name (the reference's talker is not given `use_audio_in_video`). Placeholders outside
user turns are not read (system turns and earlier answers are skipped), so need no rows.

Decoding is greedy for the talker and its code predictor unless `sampling` is given (`talker_decode.TalkerSampling`):
then both draw as the reference does by default (top-k 50, temperature 0.9 and a repetition penalty of 1.05 for the
talker, top-k 50 / top-p 0.8 hard-coded for the predictor), seeded. Code2Wav decodes the codes in one call (the
reference's `chunked_decode` equals it up to 300 frames; see `code2wav_decode` for streaming). `speak_streamed`
(`Qwen3Speech.speak_chunks`, what `omnijax.Chat` and the server call) runs the same talker and hands its codec frames to
Code2Wav's streamed decode chunk by chunk as they are decoded, yielding each chunk's PCM.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from omnijax._checks import JsonConfig
from omnijax.errors import ConfigError, ConvertError, UnsupportedConfigError
from omnijax.models.family import OmniModel
from omnijax.models.qwen3_omni import positions as positions_lib
from omnijax.models.qwen3_omni import speech_media, talker_decode, talker_forward
from omnijax.models.qwen3_omni.code2wav import Code2Wav, Code2WavConfig
from omnijax.models.qwen3_omni.code2wav_decode import FrameChunks, decode
from omnijax.models.qwen3_omni.speech_stream import AnswerSpeech
from omnijax.models.qwen3_omni.talker import Talker, TalkerConfig
from omnijax.models.qwen3_omni.talker_decode import TalkerSampling
from omnijax.models.speech import MediaRows, Utterance, token_ids
from omnijax.models.talker_kv import bounded_capacity

__all__ = ["SAMPLE_RATE", "Qwen3Speech", "SpeechTokens", "SpeechUnavailableError", "TalkerInput", "TalkerSampling",
           "UnknownVoiceError", "Utterance", "has_speech_output", "speak", "speak_streamed", "speech_configs",
           "talker_input"]

SAMPLE_RATE = 24_000  # Code2Wav's output rate (1,920 samples per 80 ms codec frame for the release)
# transformers' generate suppresses the top 1,024 codec ids (the control ids live there), the end of speech excepted.
SUPPRESSED_TOP_IDS = 1024


class SpeechUnavailableError(ValueError):
    """Speech was asked of a checkpoint without speech output (thinker-only, or audio output disabled)."""


class UnknownVoiceError(ValueError):
    """A speaker / voice the checkpoint does not have. Attributes: `voice`, `voices` (the checkpoint's)."""

    def __init__(self, voice: str, voices: Sequence[str]):
        self.voice, self.voices = voice, tuple(voices)
        super().__init__(f"unknown speaker {voice!r}: this checkpoint's voices are {list(self.voices)}")


@dataclasses.dataclass(frozen=True)
class SpeechTokens(JsonConfig):
    """The thinker-vocabulary ids the speech path reads (the full config's top level, transformers' defaults).

    Attributes:
        tts_bos_token_id, tts_eos_token_id, tts_pad_token_id: the text rows that open, close and pad the answer in
            the talker's input.
        im_start_token_id, im_end_token_id: the chat turn markers (turns are cut at `<|im_start|>`; a trailing
            `<|im_end|>` of an answer is not spoken).
        system_token_id, user_token_id, assistant_token_id: the role tokens after `<|im_start|>`.
    """

    tts_bos_token_id: int = 151672
    tts_eos_token_id: int = 151673
    tts_pad_token_id: int = 151671
    im_start_token_id: int = 151644
    im_end_token_id: int = 151645
    system_token_id: int = 8948
    user_token_id: int = 872
    assistant_token_id: int = 77091

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{field.name} must be a non-negative integer, got {value!r}")

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any]) -> "SpeechTokens":
        """The ids a full Hugging Face `Qwen3OmniMoeConfig` sets (transformers' defaults where absent)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{k: hf_config[k] for k in names if hf_config.get(k) is not None})


def has_speech_output(hf_config: Mapping[str, Any]) -> bool:
    """A full release's config with audio output enabled (transformers' default); a thinker-only config has none."""
    return hf_config.get("model_type") == "qwen3_omni_moe" and hf_config.get("enable_audio_output", True) is not False


def speech_configs(hf_config: Mapping[str, Any], thinker_hidden_size: int, dtype: str
                   ) -> tuple[TalkerConfig, Code2WavConfig, SpeechTokens]:
    """The talker, Code2Wav and thinker-side id settings of a full release's config, checked against each other.

    Raises:
        UnsupportedConfigError: an attribute omnijax does not implement.
        ConfigError: missing or inconsistent settings (each names the attribute).
    """
    for key in ("talker_config", "code2wav_config"):
        if not isinstance(hf_config.get(key), dict):
            raise ConfigError(f"config enables audio output (enable_audio_output) but has no {key!r} object")
    try:
        talker = TalkerConfig.from_hf(hf_config["talker_config"], dtype=dtype)
        code2wav = Code2WavConfig.from_hf(hf_config["code2wav_config"], dtype=dtype)
        tokens = SpeechTokens.from_hf(hf_config)
    except ConvertError:
        raise
    except (TypeError, ValueError) as e:  # inconsistent values the sub-configs' dataclasses refuse
        raise ConfigError(f"speech output config: {e}") from e
    if talker.thinker_hidden_size != thinker_hidden_size:
        raise UnsupportedConfigError("talker_config.thinker_hidden_size", talker.thinker_hidden_size,
                                     f"must equal the thinker's hidden_size={thinker_hidden_size}")
    if code2wav.num_quantizers != talker.num_code_groups:
        raise UnsupportedConfigError("code2wav_config.num_quantizers", code2wav.num_quantizers,
                                     f"must equal talker_config.num_code_groups={talker.num_code_groups}")
    if talker.predictor.vocab_size > code2wav.codebook_size:
        raise UnsupportedConfigError("code2wav_config.codebook_size", code2wav.codebook_size,
                                     f"must hold the code predictor's {talker.predictor.vocab_size} codes")
    return talker, code2wav, tokens


class Qwen3Speech:
    """A loaded Qwen3-Omni release's speech output (`omnijax.models.family.SpeechOutput`): the talker with its code
    predictor, Code2Wav, and the thinker-side ids `speak` reads.

    Attributes:
        talker: the `Talker` module (config in `talker.config`).
        code2wav: the `Code2Wav` module.
        tokens: the `SpeechTokens`.
        placeholders: the thinker's audio / image / video placeholder ids by field name (`audio_token_id`, ...),
            where the reference's talker reads layer `accept_hidden_layer`.
        sample_rate: 24,000.
    """

    sample_rate: int = SAMPLE_RATE

    def __init__(self, talker: Talker, code2wav: Code2Wav, tokens: SpeechTokens, placeholders: Mapping[str, int]):
        self.talker, self.code2wav, self.tokens = talker, code2wav, tokens
        self.placeholders = dict(placeholders)
        self.params = talker_forward.talker_params(talker)  # the pure-dict tree the talker's functions take

    @property
    def voices(self) -> tuple[str, ...]:
        """The speaker names of the checkpoint (as its config spells them; matched case-insensitively)."""
        return tuple(name for name, _ in self.talker.config.speakers)

    @property
    def accept_hidden_layer(self) -> int:
        """The thinker `hidden_states` index the talker reads at media placeholders."""
        return self.talker.config.accept_hidden_layer

    def media_tap(self, prefix_ids: Sequence[int]) -> int | None:
        """The thinker `hidden_states` index to keep at the placeholders of a media unit fed after `prefix_ids`
        (the thinker ids fed so far): `accept_hidden_layer` when the unit lies in a user turn (the last
        `<|im_start|>` opens one), else None (the talker skips system turns and earlier answers, and what comes
        before the first turn)."""
        ids = np.asarray(prefix_ids).reshape(-1)
        starts = np.flatnonzero(ids == self.tokens.im_start_token_id)
        if starts.size and starts[-1] + 1 < ids.size and ids[starts[-1] + 1] == self.tokens.user_token_id:
            return self.accept_hidden_layer
        return None

    def speak_chunks(self, model: OmniModel, prompt_ids: Any, answer_ids: Any, *, voice: str,
                     max_new_tokens: int = 4096, first_chunk: int = 4, chunk: int = 25,
                     media: Sequence[MediaRows] = (), sampling: TalkerSampling | None = None,
                     talker_kv: Any = None) -> Iterator[np.ndarray]:
        """`speak_streamed(model, prompt_ids, answer_ids, speaker=voice, ...)` of the model these parts belong to
        (the `omnijax.models.family.SpeechOutput` method): float32 PCM chunks at `sample_rate`."""
        if model.speech is not self:
            raise ValueError("speak_chunks takes the model whose speech output this is (model.speech)")
        return speak_streamed(model, prompt_ids, answer_ids, speaker=voice, max_new_tokens=max_new_tokens,
                              first_chunk=first_chunk, chunk=chunk, media=media, sampling=sampling,
                              talker_kv=talker_kv)

    def answer_stream(self, model: OmniModel, prompt_ids: Any, *, voice: str, max_new_tokens: int = 4096,
                      first_chunk: int = 4, chunk: int = 25, media: Sequence[MediaRows] = (),
                      stop: Sequence[int] = (), sampling: TalkerSampling | None = None,
                      talker_kv: Any = None) -> AnswerSpeech:
        """A `speech_stream.AnswerSpeech`: the answer spoken while the thinker writes it (its tokens pushed as
        they are decoded), equal to `speak_chunks` on the finished answer."""
        if model.speech is not self:
            raise ValueError("answer_stream takes the model whose speech output this is (model.speech)")
        _checked_policy(talker_kv)

        def talker(answer: Sequence[int]) -> functools.partial[Iterator[np.ndarray]]:
            return _talker(model, prompt_ids, answer, voice, max_new_tokens, media, sampling, talker_kv)[1]

        return AnswerSpeech(model, talker, code2wav=self.code2wav, im_end=self.tokens.im_end_token_id,
                            stand_in=self.tokens.tts_pad_token_id, first_chunk=first_chunk, chunk=chunk, stop=stop)

    def chat_tokens(self, multimodal: tuple[int, ...]) -> talker_forward.ChatTokens:
        t = self.tokens
        return talker_forward.ChatTokens(im_start=t.im_start_token_id, system=t.system_token_id,
                                         user=t.user_token_id, assistant=t.assistant_token_id,
                                         tts_pad=t.tts_pad_token_id, multimodal=multimodal)


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _checked_policy(talker_kv: Any) -> None:
    """Refuses (ValueError, by name) a talker KV policy the talker cannot run with (`talker_kv.bounded_capacity`)."""
    if talker_kv is not None:
        bounded_capacity(talker_kv, 0, 1)


def speak(model: OmniModel, thinker_prompt_ids: Any, answer_ids: Any, *, speaker: str = "Ethan",
          max_new_tokens: int = 4096, media: Sequence[MediaRows] = (), sampling: TalkerSampling | None = None,
          talker_kv: Any = None) -> Utterance:
    """Speaks a thinker's answer: talker (greedy, its code predictor greedy too; or both drawn with `sampling`),
    then Code2Wav in one call.

    Args:
        model: a loaded Qwen3-Omni checkpoint converted from a full release (`model.speech` set).
        thinker_prompt_ids: `[T0]` the thinker's prompt, chat-templated, ending with the assistant turn's opening
            (`<|im_start|>assistant\\n`); audio / image placeholders in user turns need their `media` rows.
        answer_ids: `[N]` the answer's tokens as the thinker produced them; a trailing `<|im_end|>` is not spoken.
            transformers' generate reads every generated row but the last token's, so to equal it on an answer cut
            short (no `<|im_end|>`) pass the answer without its last token.
        speaker: a voice of the checkpoint (`model.speech.voices`), matched case-insensitively.
        max_new_tokens: talker tokens at most (one per 80 ms frame; the reference's `talker_max_new_tokens`).
        media: the thinker's `hidden_states[accept_hidden_layer]` at the placeholders of the user turns' media
            units (`MediaRows`, one per unit; images with their grids).
        sampling: None (greedy, what equals transformers' `generate(talker_do_sample=False)`), or a
            `TalkerSampling` (the reference's default draws, seeded).
        talker_kv: None (the talker's cache holds its prompt and every token: what equals the reference), or a
            retention policy with a cell budget (`omnijax.models.talker_kv.talker_policy(window)`): the cache is
            built for it and trimmed after the prefill and every step (`talker_decode.TalkerDecode`).

    Returns:
        The `Utterance` (float32 PCM at 24 kHz, `pcm16()` for int16, the codes and talker tokens).

    Raises:
        SpeechUnavailableError: the checkpoint has no speech output (names the fix).
        UnknownVoiceError: `speaker` is not one of the checkpoint's voices (names them).
        ValueError: ids outside the vocabulary, placeholders of a user turn without their `media` rows (or rows of
            another layer, width or place), a video in a user turn, placeholders in the answer, an empty answer, a
            prompt whose last turn is not the assistant's, a `max_new_tokens` below 1, or a `talker_kv` without a
            cell budget or keeping fewer than `MIN_TALKER_WINDOW` newest cells.
    """
    speech, frames = _talker(model, thinker_prompt_ids, answer_ids, speaker, max_new_tokens, media, sampling,
                             talker_kv)
    tokens: list[int] = []
    decoded = list(frames(tokens=tokens))
    codes = np.stack(decoded, axis=1) if decoded else np.zeros((speech.talker.config.num_code_groups, 0), np.int32)
    talker_tokens = np.asarray(tokens, np.int32)
    pcm = np.asarray(decode(speech.code2wav, codes[None]))[0] if codes.shape[1] else np.zeros((0,), np.float32)
    return Utterance(pcm=pcm.astype(np.float32), codes=codes, talker_tokens=talker_tokens)


def speak_streamed(model: OmniModel, thinker_prompt_ids: Any, answer_ids: Any, *, speaker: str = "Ethan",
                   max_new_tokens: int = 4096, first_chunk: int = 4, chunk: int = 25,
                   media: Sequence[MediaRows] = (), sampling: TalkerSampling | None = None,
                   talker_kv: Any = None) -> Iterator[np.ndarray]:
    """`speak` streamed, talker and vocoder: every refusal of `speak` is raised at the call (before anything runs);
    then the talker decodes codec frames one by one, and as soon as `first_chunk` frames are ready -- then each
    further `chunk`, then what is left when the speech ends -- Code2Wav decodes them (`code2wav_decode.Code2WavStream`,
    its state carried between calls) and the iterator yields their float32 PCM at 24 kHz. The first chunk is out
    after `first_chunk` talker steps, not after the whole answer; the chunks concatenated equal `speak(...).pcm`.

    Raises:
        As `speak`; ValueError also for a `first_chunk` or `chunk` below 1.
    """
    first_chunk, chunk = _check_positive("first_chunk", first_chunk), _check_positive("chunk", chunk)
    speech, frames = _talker(model, thinker_prompt_ids, answer_ids, speaker, max_new_tokens, media, sampling,
                             talker_kv)
    return _streamed(speech.code2wav, frames(), first_chunk, chunk)


def _streamed(code2wav: Code2Wav, frames: Iterator[np.ndarray], first_chunk: int, chunk: int
              ) -> Iterator[np.ndarray]:
    chunks = FrameChunks(code2wav, first_chunk, chunk)
    for frame in frames:
        pcm = chunks.add(frame)
        if pcm is not None:
            yield pcm
    pcm = chunks.flush()
    if pcm is not None:
        yield pcm


class TalkerInput(NamedTuple):
    """What `speak` hands the talker: `rows [T, D]` its prompt's input embeddings, `positions [3, T]` their M-RoPE
    positions, `trailing [N, D]` the text rows added one per decoding step."""

    rows: np.ndarray
    positions: np.ndarray
    trailing: np.ndarray


def talker_input(model: OmniModel, thinker_prompt_ids: Any, answer_ids: Any, *, speaker: str = "Ethan",
                 media: Sequence[MediaRows] = ()) -> TalkerInput:
    """The talker's input `speak(model, thinker_prompt_ids, answer_ids, speaker=speaker, media=media)` builds
    (checked as `speak` checks it), without running the talker."""
    _, frames = _talker(model, thinker_prompt_ids, answer_ids, speaker, 1, media)
    _, _, rows, positions, trailing, _ = frames.args
    return TalkerInput(np.asarray(rows), np.asarray(positions), np.asarray(trailing))


def _talker(model: OmniModel, thinker_prompt_ids: Any, answer_ids: Any, speaker: str, max_new_tokens: int,
            media: Sequence[MediaRows], sampling: TalkerSampling | None = None, talker_kv: Any = None
            ) -> tuple[Qwen3Speech, functools.partial[Iterator[np.ndarray]]]:
    """Checks a `speak` call and builds the talker's input: (the speech parts, `frames(tokens=list)`, which runs
    the talker greedily, yielding each codec frame `[Q]` as it is decoded: `talker_decode.greedy_frames`)."""
    speech = model.speech
    if not isinstance(speech, Qwen3Speech):
        raise SpeechUnavailableError(
            f"{model.source or 'this checkpoint'} has no speech output (talker, code predictor, Code2Wav): it was "
            "converted from a thinker-only release or from a config with enable_audio_output false; convert the "
            "full Qwen3-Omni release (model_type qwen3_omni_moe, with its talker.* and code2wav.* tensors) with "
            "`omnijax convert` to speak")
    config = speech.talker.config
    if not isinstance(speaker, str) or dict(config.speakers).get(speaker.lower()) is None:
        raise UnknownVoiceError(speaker, speech.voices)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if sampling is not None and not isinstance(sampling, TalkerSampling):
        raise ValueError(f"sampling must be a TalkerSampling or None (greedy), got {type(sampling).__name__}")
    _checked_policy(talker_kv)
    vocab = model.config.vocab_size
    prompt = token_ids("thinker_prompt_ids", thinker_prompt_ids, vocab)
    answer = token_ids("answer_ids", answer_ids, vocab)
    tokens = speech.tokens
    if answer.size and answer[-1] == tokens.im_end_token_id:
        answer = answer[:-1]
    if not answer.size:
        raise ValueError("answer_ids holds no text to speak (empty, or only <|im_end|>)")
    multimodal = speech.placeholders
    sequence = np.concatenate([prompt, answer])
    embed = model.decoder.embed_tokens
    rows = embed(jnp.asarray(sequence, jnp.int32)[None])[0]  # [T, Dt] the thinker's embedding-layer rows
    read = speech_media.user_turns(prompt, tokens.im_start_token_id, tokens.user_token_id)
    # hidden_states[accept_hidden_layer] where the talker reads it (user turns' placeholders), embedding rows elsewhere
    hidden = speech_media.thinker_hidden(rows, sequence, len(prompt), read, multimodal, list(media),
                                         config.accept_hidden_layer)
    specials = embed(jnp.asarray([[tokens.tts_bos_token_id, tokens.tts_eos_token_id, tokens.tts_pad_token_id]],
                                 jnp.int32))[0]
    params = speech.params
    talker_rows, talker_ids, trailing = talker_forward.talker_prompt(
        config, params, prompt, sequence, rows, hidden, specials, speaker=speaker,
        chat=speech.chat_tokens(tuple(multimodal.values())))
    grids = [u.grid for u in sorted(media, key=lambda u: int(np.min(u.positions, initial=len(prompt))))
             if u.grid is not None]
    omni = getattr(model, "omni", None)
    positions = speech_media.talker_positions(
        talker_ids, config, grids, omni if isinstance(omni, positions_lib.Qwen3OmniConfig) else
        positions_lib.Qwen3OmniConfig())
    vocab_codec = config.decoder.vocab_size
    suppress = [i for i in range(max(0, vocab_codec - SUPPRESSED_TOP_IDS), vocab_codec)
                if i != config.codec_eos_token_id]
    pad_row = talker_forward.project_text(config, params, specials)[2]
    return speech, functools.partial(talker_decode.greedy_frames, config, params, talker_rows, positions, trailing,
                                     pad_row, max_new_tokens=int(max_new_tokens), suppress=suppress,
                                     sampling=sampling, policy=talker_kv)
