"""What `Chat.ask(..., speak=...)` takes and leaves: `SpeakOptions` (voice, talker length, vocoder chunks, talker
sampling), `SpokenAnswer` (what was spoken last, `Chat.last_spoken`), and `check_speak`, the checks a spoken answer
passes before anything is fed (a checkpoint with speech output, one of its voices, a conversation its talker can
read). How the talker reads the conversation is told in `omnijax.chat`'s docstring."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from omnijax.models.family import OmniModel
from omnijax.models.qwen3_omni.talker_decode import TalkerSampling
from omnijax.models.speech import MediaRows
from omnijax.models.talker_kv import DEFAULT_TALKER_SINK, talker_policy
from omnijax.retention.baselines import SinkWindow

MEDIA_KINDS = ("image", "audio", "av")
DEFAULT_SPEECH_MEDIA_BYTES = 64 << 20  # the talker's kept thinker rows at media placeholders (16K bf16 tokens of 2048)


@dataclasses.dataclass(frozen=True)
class SpeakOptions:
    """How `Chat.ask(..., speak=...)` speaks an answer.

    Attributes:
        voice: one of the checkpoint's voices (`model.speech.voices`, matched case-insensitively); "Ethan" is the
            Qwen3-Omni reference's default speaker.
        max_speech_tokens: the talker's tokens at most (one per 80 ms codec frame; the reference's
            `talker_max_new_tokens`, 4,096 by default). A talker that has not ended the speech by then is cut there.
        first_chunk: codec frames of the vocoder's first call (a small one gets the first audio out sooner).
        chunk: codec frames of each later call.
        sampling: None (greedy talker and code predictor: what equals transformers' `talker_do_sample=False`), or
            a `TalkerSampling` (Qwen3-Omni: the reference's default draws, seeded; refused by a greedy-only talker).
        talker_window: None (the talker's KV holds its prompt and every token: what equals transformers), or the
            newest talker KV cells kept (>= `MIN_TALKER_WINDOW`) beside `talker_sink` pinned oldest ones: the
            talker's cache is built for `talker_sink + talker_window` cells and trimmed after its prefill and every
            step (`omnijax.models.talker_kv`), so a long spoken answer holds bounded memory (other speech than the
            unbounded talker's once cells are dropped).
        talker_sink: the oldest talker cells kept with `talker_window` (the prompt's opening).
        early_start: Qwen2.5-Omni: the talker starts after the answer's first block instead of after the answer,
            reading each answer token's row as the streamed step computed it (`chunk_step(..., tap_answer=True)`,
            `omnijax.models.qwen2_5_omni.speech_stream`): no second thinker pass over the answer, the same speech
            whether the talker runs early or at the end, and the same codes as the default path unless rounding
            (the chunked stream against one full forward) flips a talker choice or the thinker's policy trims
            during the answer (the answer's rows are then those of the bounded cache the text was written from:
            other speech than the default's full-attention rows). False (default): the finish-first path, one
            thinker forward over prompt and answer, equal to transformers. Qwen3-Omni's talker always starts early.
    """

    voice: str = "Ethan"
    max_speech_tokens: int = 4096
    first_chunk: int = 4
    chunk: int = 25
    sampling: TalkerSampling | None = None
    talker_window: int | None = None
    talker_sink: int = DEFAULT_TALKER_SINK
    early_start: bool = False

    def __post_init__(self):
        if not isinstance(self.voice, str) or not self.voice:
            raise ValueError(f"voice must be a non-empty string, got {self.voice!r}")
        if self.sampling is not None and not isinstance(self.sampling, TalkerSampling):
            raise ValueError(f"sampling must be a TalkerSampling or None (greedy), got {type(self.sampling).__name__}")
        for name in ("max_speech_tokens", "first_chunk", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.early_start, bool):
            raise ValueError(f"early_start must be a bool, got {self.early_start!r}")
        talker_policy(self.talker_window, self.talker_sink)  # refuses a window or sink the talker cannot run with

    @property
    def talker_kv(self) -> SinkWindow | None:
        """The talker's KV policy (`talker_window` / `talker_sink`; None: unbounded)."""
        return talker_policy(self.talker_window, self.talker_sink)


@dataclasses.dataclass(frozen=True)
class SpokenAnswer:
    """What `ask(..., speak=...)` spoke: the thinker-vocabulary ids of the talker's prompt (everything fed before
    the answer, media units' ids included, ending with the generation prompt) and of the answer spoken, the voice,
    the PCM samples yielded, and the kept media rows the talker read (`speak(..., media=...)`)."""

    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    voice: str
    samples: int
    media: tuple[MediaRows, ...] = ()


def check_speak(model: OmniModel, speak: bool | SpeakOptions, unit_kinds: Iterable[str],
                unspeakable: str | None) -> SpeakOptions | None:
    """The options a spoken answer of `model` would use (None: not spoken).

    Args:
        model: the chat's model (`model.speech` is its speech output, None without one).
        speak: what `ask(speak=...)` was given.
        unit_kinds: the kinds of the units the conversation has fed.
        unspeakable: why the conversation can no longer be spoken (None: it can).

    Raises:
        ValueError: naming the problem: not a bool or `SpeakOptions`, no speech output, an unknown voice, media units
            a talker that reads every position's last layer cannot read, an unspeakable conversation, or sampling
            for a greedy-only talker.
    """
    if speak is False:
        return None
    if not isinstance(speak, (bool, SpeakOptions)):
        raise ValueError(f"speak must be a bool or a SpeakOptions, got {type(speak).__name__}")
    options = SpeakOptions() if speak is True else speak
    speech = model.speech
    if speech is None:
        raise ValueError(f"speak: {model.source or 'this checkpoint'} has no speech output (a talker and a "
                         "vocoder); convert the model's full release (e.g. Qwen3-Omni's, with its talker.* and "
                         "code2wav.* tensors) to speak")
    if options.voice.lower() not in {v.lower() for v in speech.voices}:
        raise ValueError(f"speak: unknown voice {options.voice!r}: this checkpoint's voices are "
                         f"{list(speech.voices)}")
    media = sorted({kind for kind in unit_kinds if kind in MEDIA_KINDS})
    if media and getattr(speech, "media_tap", None) is None:
        raise ValueError(f"speak: this conversation holds media units ({', '.join(media)}); this checkpoint's "
                         "talker reads the thinker's last-layer states at every position, which the chat does "
                         "not keep: its spoken answers take text-only conversations")
    if unspeakable is not None:
        raise ValueError(f"speak: {unspeakable}")
    if options.sampling is not None and getattr(speech, "answer_stream", None) is None:
        raise ValueError("speak: sampling: this checkpoint's talker decodes greedily only (Qwen2.5-Omni here); "
                         "leave SpeakOptions.sampling None")
    return options


__all__ = ["DEFAULT_SPEECH_MEDIA_BYTES", "MEDIA_KINDS", "SpeakOptions", "SpokenAnswer", "check_speak"]
