"""Qwen2.5-Omni speech output, whole utterances: a converted full release's talker, Token2Wav and voices
(`Qwen25Speech`, `model.speech` of a loaded checkpoint), and `speak`, which turns a thinker's prompt and text answer
into 24 kHz PCM as transformers' `Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)` does with
`talker_do_sample=False`.

What `speak` feeds the talker (`talker_forward`): per thinker token of the prompt and the answer, the thinker's
final-normed hidden state plus its embedding; the voice's start token; the codec pad / bos embeddings; after the
answer the `text_eos` row, then `text_pad` rows. The reference zeroes the embedding rows of audio / image / video
placeholders and reads the thinker's hidden states over the encoded media. `speak` recomputes those states: one
thinker forward over prompt and answer (full attention, as the reference), the audio encoder's rows given as `media`
at the audio placeholders (`omnijax.Chat` keeps them as a unit is fed: hidden size x dtype bytes a placeholder, the
same as Qwen3-Omni's kept rows; keeping the last layer of every position instead would grow with the whole
conversation, answers included, and differ from the reference once retention evicts). Audio tokens take consecutive
positions (the reference's `get_rope_index`), so the text path's positions hold. An image's rows (the vision
encoder's, with their `grid`) are placed at the thinker's TMRoPE image layout (`rope_positions`), and the talker's
own positions are laid out over its input ids with the talker config's ids, as the reference's talker
`get_rope_index` does (the release's talker ids are the thinker's). A video or audiovisual unit's rows (the vision and
audio encoders', audio-in-video interleaved) are placed at the positions the unit was fed with (`MediaRows.layout`:
`omnijax.Chat` feeds a unit at transformers' `use_audio_in_video` layout), for the thinker and, as the reference
passes `use_audio_in_video` and the video grids to its talker, for the talker's own layout.

`omnijax.Chat` keeps an image's rows (tap 0, the vision encoder's) with its patch grid (`media_rows` with the vision
merge size this output holds) as it keeps an audio clip's, and an audiovisual unit's with its layout.

Decoding is greedy, with the reference's repetition penalty (1.05 unless told otherwise: transformers passes it to
the talker even when `talker_do_sample=False`), its codec-bos suppression and its stop ids (the codec pad and end
ids: the reference's hard-coded `talker_eos_token_id=[8292, 8294]` are the release's). Token2Wav solves its ODE from
an initial noise the reference draws with `torch.randn` inside: `speak` takes it from `noise` (a function of the
shape) or draws it from `seed`. `speak` decodes the codes in one Token2Wav call (the reference's); `speak_chunks` (the
`SpeechOutput` method `Chat` calls) streams it as the talker decodes (`spoken_chunks`: the talker's tokens one at a
time, `talker_forward.greedy_tokens`, each handed to a `token2wav_stream.Token2WavStream` at once, so PCM comes out
while the talker still decodes; `speak_streamed` collects it). The talker is `speak`'s; Token2Wav equals `speak`'s
where the look-ahead covers the utterance and otherwise differs by what a finite look-ahead changes (measured in
`token2wav_stream`). `Qwen25Speech.tapped_answer_stream` (`omnijax.Chat` with `SpeakOptions(early_start=True)`)
starts the talker while the answer is written, from the answer rows the streamed step computed (`speech_stream`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.models.family import OmniModel
from omnijax.models.qwen2_5_omni import positions as tmrope
from omnijax.models.qwen2_5_omni import talker_forward
from omnijax.models.qwen2_5_omni.speech_stream import AnswerSpeech
from omnijax.models.qwen2_5_omni.talker import Talker
from omnijax.models.qwen2_5_omni.token2wav import Token2Wav, synthesize
from omnijax.models.qwen2_5_omni.token2wav_stream import Token2WavStream, Token2WavStreaming, frame_noise, talker_pcm
from omnijax.models.qwen2_5_omni.voices import Voice
from omnijax.models.qwen3_omni import speech_media
from omnijax.models.speech import MediaRows, Utterance, token_ids
from omnijax.models.talker_kv import bounded_capacity

__all__ = ["SAMPLE_RATE", "Qwen25Speech", "SpeechUnavailableError", "TalkerInput", "UnknownVoiceError", "Utterance",
           "checked_request", "rope_positions", "speak", "speak_streamed", "spoken_chunks", "talker_input"]

SAMPLE_RATE = 24_000  # BigVGAN's output rate (480 samples per codec token for the release)


class SpeechUnavailableError(ValueError):
    """Speech was asked of a checkpoint without speech output (thinker-only, or audio output disabled)."""


class UnknownVoiceError(ValueError):
    """A voice the checkpoint does not have. Attributes: `voice`, `voices` (the checkpoint's)."""

    def __init__(self, voice: Any, voices: tuple[str, ...]):
        self.voice, self.voices = voice, tuple(voices)
        super().__init__(f"unknown speaker {voice!r}: this checkpoint's voices are {list(self.voices)}")


class Qwen25Speech:
    """A loaded Qwen2.5-Omni release's speech output (`omnijax.models.family.SpeechOutput`).

    Attributes:
        talker: the `Talker` module (config in `talker.config`).
        token2wav: the `Token2Wav` module (DiT and BigVGAN).
        speakers: the voices by name (`voices.Voice`: conditioning vector, reference mel, start token).
        im_end_token_id: the thinker's `<|im_end|>` (a trailing one is not spoken).
        placeholders: the thinker's audio / image / video placeholder ids by field name.
        sample_rate: 24,000.
    """

    sample_rate: int = SAMPLE_RATE

    def __init__(self, talker: Talker, token2wav: Token2Wav, speakers: Mapping[str, Voice], *, im_end_token_id: int,
                 placeholders: Mapping[str, int]):
        self.talker, self.token2wav, self.speakers = talker, token2wav, dict(speakers)
        self.im_end_token_id, self.placeholders = int(im_end_token_id), dict(placeholders)
        self.params = talker_forward.talker_params(talker)

    media_kinds = ("audio", "image", "av")  # the units `Chat` may feed before a spoken answer
    # the vision encoder's merge size (set at load when the checkpoint has one): `media_rows` reads an image's grid
    spatial_merge_size: int | None = None

    def media_tap(self, prefix_ids: Sequence[int]) -> int | None:
        """The thinker `hidden_states` index to keep at a media unit's placeholders (`omnijax.Chat`): 0, the input
        rows (the audio / vision encoder's features), wherever the unit lies: this talker reads every prompt
        position, and `speak` recomputes the thinker's last layer over the whole conversation with them."""
        return 0

    @property
    def voices(self) -> tuple[str, ...]:
        """The speaker names as the release spells them ("Chelsie", "Ethan"); matched case-insensitively."""
        return tuple(sorted(self.speakers))

    def voice(self, name: Any) -> Voice:
        """The voice `name` (exact, else case-insensitive). Raises UnknownVoiceError naming the checkpoint's."""
        if isinstance(name, str):
            found = self.speakers.get(name) or {k.lower(): v for k, v in self.speakers.items()}.get(name.lower())
            if found is not None:
                return found
        raise UnknownVoiceError(name, self.voices)

    def speak_chunks(self, model: OmniModel, prompt_ids: Any, answer_ids: Any, *, voice: str,
                     max_new_tokens: int = 4096, first_chunk: int = 4, chunk: int = 25,
                     media: Sequence[MediaRows] = (), talker_kv: Any = None) -> Iterator[np.ndarray]:
        """The answer spoken as `speak` does, Token2Wav streamed (`spoken_chunks`): PCM chunks as the
        talker's codes complete them, the DiT solved in chunks of `first_chunk` then `chunk` codec tokens rounded
        up to whole DiT blocks, with `self.streaming`'s look-ahead; the talker's KV bounded by `talker_kv` (a
        retention policy with a cell budget, `omnijax.models.talker_kv.talker_policy`), else by `self.talker_kv`.
        Every refusal is raised at the call."""
        if model.speech is not self:
            raise ValueError("speak_chunks takes the model whose speech output this is (model.speech)")
        streaming = Token2WavStreaming.for_tokens(self.token2wav.config.dit, first_chunk, chunk,
                                                  right_blocks=self.streaming.right_blocks,
                                                  vocoder_right=self.streaming.vocoder_right)
        return spoken_chunks(model, prompt_ids, answer_ids, speaker=voice, max_new_tokens=max_new_tokens,
                             streaming=streaming, media=media,
                             talker_kv=self.talker_kv if talker_kv is None else talker_kv)

    def tapped_answer_stream(self, model: OmniModel, prompt_ids: Any, *, voice: str, max_new_tokens: int = 4096,
                             first_chunk: int = 4, chunk: int = 25, stop: Sequence[int] = (),
                             media: Sequence[MediaRows] = (), talker_kv: Any = None,
                             sampling: Any = None) -> AnswerSpeech:
        """A `speech_stream.AnswerSpeech`: the answer spoken while the thinker writes it, from the rows the stream
        computed (`chunk_step(..., tap_answer=True)`; `omnijax.Chat` with `SpeakOptions(early_start=True)`), the
        talker and Token2Wav as `speak_chunks`'. Refusals of the prompt, voice, limits, chunks and KV policy are
        raised at the call, those of the media rows at the first block; `sampling` must be None (greedy only)."""
        if model.speech is not self:
            raise ValueError("tapped_answer_stream takes the model whose speech output this is (model.speech)")
        if sampling is not None:
            raise ValueError("sampling: this checkpoint's talker decodes greedily only (Qwen2.5-Omni); pass None")
        taken = {int(i) for i in self.placeholders.values()} | {self.im_end_token_id}
        stand_in = next(i for i in range(model.config.vocab_size) if i not in taken)  # a plain text id
        _, spoken, prompt, _ = checked_request(model, prompt_ids, [stand_in], voice, max_new_tokens, 1.05)
        policy = self.talker_kv if talker_kv is None else talker_kv
        if policy is not None:
            bounded_capacity(policy, 0, 1)  # refused by name now
        streaming = Token2WavStreaming.for_tokens(self.token2wav.config.dit, first_chunk, chunk,
                                                  right_blocks=self.streaming.right_blocks,
                                                  vocoder_right=self.streaming.vocoder_right)
        stream = Token2WavStream(self.token2wav, spoken.conditioning, spoken.reference_mel, streaming=streaming)
        rows = tuple(media)

        def prepare(first: np.ndarray, answer_rows: tuple[jax.Array, jax.Array]) -> TalkerInput:
            return talker_input(model, prompt, first, spoken, rows, answer_rows=answer_rows)

        return AnswerSpeech(model, prepare, stream, max_new_tokens=int(max_new_tokens), policy=policy,
                            droppable=(*stop, self.im_end_token_id), placeholders=tuple(self.placeholders.values()))

    # the stream's look-ahead and vocoder context (`speak_chunks`' chunk sizes come from its arguments)
    streaming: Token2WavStreaming = Token2WavStreaming()
    # the talker's KV policy on the spoken path (None: unbounded, the reference's; a `retention.SinkWindow` bounds
    # it: `talker_forward.greedy_tokens`)
    talker_kv: Any = None


def rope_positions(ids: np.ndarray, audio_start: int, audio: int, vision_start: int, image: int,
                   grids: Sequence[tuple[int, int, int]], spatial_merge_size: int, position_id_per_seconds: int, *,
                   what: str, strict: bool = True, video: int | None = None,
                   layouts: Sequence[np.ndarray] = ()) -> np.ndarray:
    """`[3, T]` TMRoPE positions of `ids` as transformers' `get_rope_index` lays them out, media groups found by
    their start marker (`audio_start` then `audio` placeholders; `vision_start` then `image` placeholders, laid out
    on the next of `grids`, in order; `vision_start` then `video` placeholders or `audio_start` (a video with its
    audio), laid out as the next of `layouts` says, the unit's positions as fed, `MediaRows.layout`): the thinker's
    with the thinker config's ids, the talker's with its own.

    Raises:
        ValueError: an image group without its grid or not filling its grid's placeholders, a video group without
            its layout or longer than the ids, grids or layouts left over (`strict`: the talker's reference skips
            groups its config's ids do not mark, and so unused ones).
    """
    T, segments, text, i, images, videos = len(ids), [], 0, 0, list(grids), [np.asarray(x) for x in layouts]
    while i < T:
        tok, nxt = int(ids[i]), int(ids[i + 1]) if i + 1 < T else None
        if video is not None and tok == vision_start and nxt in (video, audio_start):
            if text:
                segments.append(tmrope.text_positions(text))
                text = 0
            if not videos:
                raise ValueError(f"{what} holds a video group at {i} without its layout (MediaRows.layout)")
            layout = videos.pop(0)
            if i + layout.shape[1] > T:
                raise ValueError(f"{what} has a video group at {i} whose layout ({layout.shape[1]} tokens) runs past "
                                 "its end")
            segments.append(tmrope.Segment(layout, int(layout[0, -1]) + 1))  # the next starts past its eos marker
            i += layout.shape[1]
        elif (tok == vision_start and nxt == image) or (tok == audio_start and nxt == audio):
            if text:
                segments.append(tmrope.text_positions(text))
                text = 0
            if tok == audio_start:
                n = int(np.argmax(np.append(ids[i + 1:] != audio, True)))
                seg = tmrope.audio_positions(n)
            elif not images:
                raise ValueError(f"{what} holds an image group at {i} without its grid (MediaRows.grid)")
            else:
                seg = tmrope.image_positions(images.pop(0), spatial_merge_size=spatial_merge_size,
                                             position_id_per_seconds=position_id_per_seconds)
                n = seg.positions.shape[1] - 2
                if i + n + 1 >= T or not (ids[i + 1:i + 1 + n] == image).all() or ids[i + 1 + n] == image:
                    raise ValueError(f"{what} has an image group at {i} that does not fill its grid's {n} "
                                     "placeholders")
            segments.append(seg)
            i += seg.positions.shape[1]
        else:
            text, i = text + 1, i + 1
    if text:
        segments.append(tmrope.text_positions(text))
    if images and strict:
        raise ValueError(f"{what} holds fewer image groups than the media's grids ({len(images)} left over)")
    if videos and strict:
        raise ValueError(f"{what} holds fewer video groups than the media's layouts ({len(videos)} left over)")
    return tmrope.place(segments)[0]


class TalkerInput(NamedTuple):
    """What the talker decodes from (`talker_input`), as `speak` feeds `talker_forward.generate_greedy`.

    Attributes:
        rows: `[T, Dt]` the prefill rows (`talker_forward.talker_prompt`).
        positions: `[3, T]` their TMRoPE positions; decoding continues at `positions.max() + 1`, one per token.
        trailing: `[N, Dt]` the rows decoding steps 0 .. N-1 add (answer rows 1 .., then `text_eos`).
        text_pad: `[Dt]` the row every later step adds.
        prompt_ids: the talker's input ids of the prefill (what the repetition penalty reads besides the tokens).
    """

    rows: jax.Array
    positions: np.ndarray
    trailing: jax.Array
    text_pad: jax.Array
    prompt_ids: list[int]


def talker_input(model: OmniModel, prompt: np.ndarray, answer: np.ndarray, voice: Voice,
                 media: Sequence[MediaRows] = (), answer_rows: tuple[jax.Array, jax.Array] | None = None
                 ) -> TalkerInput:
    """The talker's input for a checked prompt and answer (ids in the vocabulary, both non-empty, the answer
    without its final `<|im_end|>`) spoken with `voice` (`speak`'s arguments checked, which calls it; the engine's
    speech pool calls it too). Raises ValueError as `speak` names it (media rows that do not fit).

    `answer_rows`: `(embeds, hidden)` `[len(answer), Dt]` the answer's thinker rows as the stream computed them
    (`speech_stream.AnswerSpeech`): the thinker forward then runs over the prompt only. None: over prompt and
    answer (`thinker_rows`, what equals the reference)."""
    speech = model.speech
    assert isinstance(speech, Qwen25Speech)
    config, params = speech.talker.config, speech.params
    sequence = np.concatenate([prompt, answer])
    found = sorted(n for n, i in speech.placeholders.items() if np.isin(i, sequence).any())
    inputs, positions = None, None
    if found or media:  # the encoders' rows at every audio / image / video placeholder (the answer may hold none)
        # (keyed "video", not "video_token_id": Qwen3-Omni's check refuses videos its reference's talker cannot lay
        # out; this reference passes use_audio_in_video and the video grids to its talker)
        holders = {("video" if n == "video_token_id" else n): i for n, i in speech.placeholders.items()}
        inputs = speech_media.thinker_hidden(model.decoder.embed_tokens(jnp.asarray(sequence[None], jnp.int32))[0],
                                             sequence, len(prompt), np.ones(len(prompt), bool), holders,
                                             tuple(media), 0)
        ordered = sorted(media, key=lambda u: int(np.min(u.positions, initial=len(sequence))))
        grids = [u.grid for u in ordered if u.grid is not None]
        layouts = [np.asarray(u.layout) for u in ordered if u.layout is not None]
        omni = model.omni  # type: ignore[attr-defined]
        positions = rope_positions(sequence, omni.audio_start_token_id, omni.audio_token_id,
                                   omni.vision_start_token_id, omni.image_token_id, grids,
                                   model.vision.config.spatial_merge_size,  # type: ignore[attr-defined]
                                   omni.position_id_per_seconds, what="the thinker's prompt",
                                   video=omni.video_token_id, layouts=layouts)
    if answer_rows is None:
        embeds, hidden = talker_forward.thinker_rows(model.decoder, sequence, inputs, positions)
    else:  # the prompt's rows from one forward over it; the answer's as the stream computed them
        P = len(prompt)
        embeds, hidden = talker_forward.thinker_rows(model.decoder, prompt, None if inputs is None else inputs[:P],
                                                     None if positions is None else positions[:, :P])
        embeds = jnp.concatenate([embeds, jnp.asarray(answer_rows[0], embeds.dtype)])
        hidden = jnp.concatenate([hidden, jnp.asarray(answer_rows[1], hidden.dtype)])
    holes = np.flatnonzero(np.isin(sequence, [speech.placeholders[n] for n in found]))
    if holes.size:  # the reference hands its talker zeros in place of the placeholders' embedding rows
        embeds = embeds.at[jnp.asarray(holes)].set(0)
    specials = model.decoder.embed_tokens(jnp.asarray([[voice.bos_token, config.text_eos_id, config.text_pad_id]],
                                                      jnp.int32))[0]
    prefill, trailing = talker_forward.talker_prompt(config, params, embeds, hidden, len(prompt), specials[0],
                                                     specials[1])
    T = prefill.shape[0]
    if positions is None:
        positions = np.broadcast_to(np.arange(T), (3, T))  # get_rope_index over text-only ids: consecutive
    else:  # the talker's own get_rope_index over prompt, voice start, first answer token, with its config's ids
        positions = rope_positions(np.concatenate([prompt, [voice.bos_token], answer[:1]]), config.audio_start_token_id,
                                   config.audio_token_id, config.vision_start_token_id, config.image_token_id, grids,
                                   config.spatial_merge_size, config.position_id_per_seconds,
                                   what="the talker's input", strict=False, video=config.video_token_id,
                                   layouts=layouts)
    talker_ids = [config.codec_mask_id] * len(prompt) + [config.codec_pad_id, config.codec_bos_id]
    return TalkerInput(prefill, np.asarray(positions), trailing, specials[2], talker_ids)


def checked_request(model: OmniModel, prompt_ids: Any, answer_ids: Any, speaker: str, max_new_tokens: int,
                    repetition_penalty: float) -> tuple[Qwen25Speech, Voice, np.ndarray, np.ndarray]:
    """`speak`'s checks of its arguments: `(speech, voice, prompt, answer)`, the answer without a final
    `<|im_end|>`. Raises what `speak` names (no speech output, an unknown voice, bad ids or limits)."""
    speech = model.speech
    if not isinstance(speech, Qwen25Speech):
        raise SpeechUnavailableError(
            f"{model.source or 'this checkpoint'} has no Qwen2.5-Omni speech output (talker, Token2Wav, voices): it "
            "was converted from a thinker-only release or from a config with enable_audio_output false; convert the "
            "full release (model_type qwen2_5_omni, with its talker.* and token2wav.* tensors and spk_dict.pt) with "
            "`omnijax convert` to speak")
    voice = speech.voice(speaker)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if isinstance(repetition_penalty, bool) or not isinstance(repetition_penalty, (int, float)) or \
            not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be a number > 0, got {repetition_penalty!r}")
    vocab = model.config.vocab_size
    prompt, answer = token_ids("prompt_ids", prompt_ids, vocab), token_ids("answer_ids", answer_ids, vocab)
    if answer.size and answer[-1] == speech.im_end_token_id:
        answer = answer[:-1]
    if not answer.size or not prompt.size:
        raise ValueError("answer_ids holds no text to speak (empty, or only <|im_end|>)" if prompt.size else
                         "prompt_ids is empty")
    return speech, voice, prompt, answer


def speak(model: OmniModel, prompt_ids: Any, answer_ids: Any, *, speaker: str = "Chelsie",
          max_new_tokens: int = 4096, repetition_penalty: float = 1.05,
          noise: Callable[[tuple[int, int, int]], Any] | None = None, seed: int = 0, num_steps: int = 10,
          guidance_scale: float = 0.5, sway: float | None = -1.0, media: Sequence[MediaRows] = (),
          talker_kv: Any = None) -> Utterance:
    """Speaks a thinker's answer: the talker (greedy), then Token2Wav (DiT ODE solve, BigVGAN) in one call.

    Args:
        model: a loaded Qwen2.5-Omni checkpoint converted from a full release (`model.speech` set).
        prompt_ids: `[T0]` the thinker's prompt, chat-templated (text, audio and image placeholders, their rows in
            `media`).
        answer_ids: `[N]` the answer's tokens; a trailing `<|im_end|>` is not spoken. transformers' generate reads
            every generated row but the last token's, so to equal it on an answer cut short (no `<|im_end|>`) pass
            the answer without its last token.
        speaker: a voice of the checkpoint (`model.speech.voices`; exact, else case-insensitive).
        max_new_tokens: talker tokens at most (the reference's `talker_max_new_tokens`).
        repetition_penalty: the talker's repetition penalty (transformers' `talker_repetition_penalty`, 1.05).
        noise: `noise((1, frames, mel_dim))` -> the ODE's initial state (the reference's `torch.randn` draw); None:
            standard normal drawn per DiT block from `seed` (`token2wav_stream.frame_noise`, what the streamed
            decode draws).
        seed: the noise's seed when `noise` is None.
        num_steps, guidance_scale, sway: Token2Wav's ODE settings (the reference's defaults).
        media: the encoders' rows at the prompt's audio, image and video placeholders (`MediaRows` of
            `hidden_states[0]`, one per clip, image or audiovisual unit, an image's with its patch `grid`, a video's
            with its `layout`; `omnijax.Chat` keeps them from the chunks it feeds): every placeholder needs its row.
        talker_kv: None (the talker's cache holds its prompt and every token: what equals the reference), or a
            retention policy with a cell budget (`omnijax.models.talker_kv.talker_policy(window)`):
            `talker_forward.greedy_tokens`.

    Returns:
        The `Utterance` (float32 PCM at 24 kHz, `pcm16()` for int16, the codes and talker tokens); no samples when
        the talker stopped at once.

    Raises:
        SpeechUnavailableError: the checkpoint has no speech output (names the fix).
        UnknownVoiceError: `speaker` is not one of the checkpoint's voices (names them).
        ValueError: ids outside the vocabulary, a media placeholder without its row in `media` (or a row
            elsewhere, of another layer or width), an image without its grid or not filling it, a video without its
            layout, an empty answer or prompt, a `max_new_tokens` below 1, a `repetition_penalty` not > 0, noise of
            the wrong shape, a `talker_kv` without a cell budget or keeping fewer than `MIN_TALKER_WINDOW` cells.
    """
    speech, voice, prompt, answer = checked_request(model, prompt_ids, answer_ids, speaker, max_new_tokens,
                                                    repetition_penalty)
    if talker_kv is not None:
        bounded_capacity(talker_kv, 0, 1)
    talker = talker_input(model, prompt, answer, voice, media)
    config = speech.talker.config
    tokens = talker_forward.generate_greedy(
        config, speech.params, talker.rows, talker.positions, talker.trailing, talker.text_pad,
        prompt_ids=talker.prompt_ids, max_new_tokens=int(max_new_tokens),
        repetition_penalty=float(repetition_penalty), suppress=[config.codec_bos_id], policy=talker_kv)
    codes = tokens[:-1]
    if not codes.size:
        return Utterance(pcm=np.zeros((0,), np.float32), codes=codes, talker_tokens=tokens)
    dit = speech.token2wav.config.dit
    shape = (1, int(codes.size) * dit.repeats, dit.mel_dim)
    initial = (frame_noise(seed, 0, shape[1], block=dit.block_size, mel_dim=dit.mel_dim) if noise is None
               else np.asarray(noise(shape), np.float32))
    if initial.shape != shape:
        raise ValueError(f"noise returned shape {initial.shape}, expected {shape}")
    pcm = synthesize(speech.token2wav, codes[None], voice.conditioning[None], voice.reference_mel[None], initial,
                     num_steps=num_steps, guidance_scale=guidance_scale, sway=sway)
    return Utterance(pcm=np.asarray(pcm, np.float32)[0], codes=codes, talker_tokens=tokens)


def _streamed(model: OmniModel, prompt_ids: Any, answer_ids: Any, *, speaker: str, max_new_tokens: int,
              repetition_penalty: float, streaming: Token2WavStreaming, seed: int, num_steps: int,
              guidance_scale: float, sway: float | None, media: Sequence[MediaRows], talker_kv: Any
              ) -> tuple[Iterator[int], Token2WavStream]:
    speech, voice, prompt, answer = checked_request(model, prompt_ids, answer_ids, speaker, max_new_tokens,
                                                    repetition_penalty)
    if not isinstance(streaming, Token2WavStreaming):
        raise ValueError(f"streaming must be a Token2WavStreaming, got {type(streaming).__name__}")
    if talker_kv is not None:
        bounded_capacity(talker_kv, 0, 1)  # refused by name now, not at the iterator's first read
    talker = talker_input(model, prompt, answer, voice, media)
    config = speech.talker.config
    tokens = talker_forward.greedy_tokens(
        config, speech.params, talker.rows, talker.positions, talker.trailing, talker.text_pad,
        prompt_ids=talker.prompt_ids, max_new_tokens=int(max_new_tokens),
        repetition_penalty=float(repetition_penalty), suppress=[config.codec_bos_id], policy=talker_kv)
    stream = Token2WavStream(speech.token2wav, voice.conditioning, voice.reference_mel, streaming=streaming,
                             seed=seed, num_steps=num_steps, guidance_scale=guidance_scale, sway=sway)
    return tokens, stream


def spoken_chunks(model: OmniModel, prompt_ids: Any, answer_ids: Any, *, speaker: str = "Chelsie",
                  max_new_tokens: int = 4096, repetition_penalty: float = 1.05,
                  streaming: Token2WavStreaming = Token2WavStreaming(), seed: int = 0, num_steps: int = 10,
                  guidance_scale: float = 0.5, sway: float | None = -1.0,
                  media: Sequence[MediaRows] = (), talker_kv: Any = None) -> Iterator[np.ndarray]:
    """The answer spoken, PCM chunks (float32, 24 kHz) yielded as the talker's codes complete them (module
    docstring). Arguments as `speak` (no `noise`: the stream draws `seed`'s per DiT block, as `speak` does by
    default); `streaming`: the chunking and look-ahead; `talker_kv`: the talker's KV policy (None: unbounded;
    `talker_forward.greedy_tokens`). Every refusal `speak` names is raised at the call; the
    thinker rows and the talker's prefill are computed at the call too, the talker steps and Token2Wav as the
    iterator is read."""
    tokens, stream = _streamed(model, prompt_ids, answer_ids, speaker=speaker, max_new_tokens=max_new_tokens,
                               repetition_penalty=repetition_penalty, streaming=streaming, seed=seed,
                               num_steps=num_steps, guidance_scale=guidance_scale, sway=sway, media=media,
                               talker_kv=talker_kv)
    return talker_pcm(tokens, stream)


def speak_streamed(model: OmniModel, prompt_ids: Any, answer_ids: Any, *, speaker: str = "Chelsie",
                   max_new_tokens: int = 4096, repetition_penalty: float = 1.05,
                   streaming: Token2WavStreaming = Token2WavStreaming(), seed: int = 0, num_steps: int = 10,
                   guidance_scale: float = 0.5, sway: float | None = -1.0,
                   media: Sequence[MediaRows] = (), talker_kv: Any = None) -> Utterance:
    """`spoken_chunks` collected into an `Utterance` (the PCM concatenated, the codes, the talker's tokens)."""
    tokens, stream = _streamed(model, prompt_ids, answer_ids, speaker=speaker, max_new_tokens=max_new_tokens,
                               repetition_penalty=repetition_penalty, streaming=streaming, seed=seed,
                               num_steps=num_steps, guidance_scale=guidance_scale, sway=sway, media=media,
                               talker_kv=talker_kv)
    seen: list[int] = []
    chunks = list(talker_pcm(tokens, stream, seen))
    talker = np.asarray(seen, np.int32)
    pcm = np.concatenate(chunks) if chunks else np.zeros((0,), np.float32)
    return Utterance(pcm=pcm.astype(np.float32), codes=talker[:-1], talker_tokens=talker)
