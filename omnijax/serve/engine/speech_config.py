"""The speech pool's settings (`SpeechConfig`) and what a tick sends (`SpeechChunk`); the pool itself is
`omnijax.serve.engine.speech.SpeechPool`, which re-exports both."""

from __future__ import annotations

import dataclasses

import numpy as np

from omnijax.models.talker_kv import DEFAULT_TALKER_SINK, talker_policy
from omnijax.retention.baselines import SinkWindow

__all__ = ["SpeechChunk", "SpeechConfig"]


@dataclasses.dataclass(frozen=True)
class SpeechConfig:
    """Static settings of the engine's speech pool.

    Attributes:
        rows: talker batch sizes, ascending; the largest is the most sessions speaking at once.
        num_pages: pages of the talker's KV pool (shared by every speaking session).
        page_size: slots per talker page (a power of two).
        max_pages: page-table width per row (default: the whole pool): the longest utterance a row holds is
            `max_pages * page_size` talker tokens, prompt included.
        first_chunk: codec frames of a session's first vocoder call (80 ms each for the release).
        chunk: codec frames of each later call.
        vocoder_rows: sessions at most in one Code2Wav call (None: every row; 1: one session a call, unpadded).
        vocoder_budget_s: vocoder seconds per tick after which chunks that are not urgent wait (None: every ready
            chunk runs in its tick).
        slack_s: a chunk whose playback deadline is nearer than this is urgent.
        steps_per_tick: batched talker steps a tick runs at most, each over the rows that can step (1: one frame a
            tick per session; more lets a talker catch up with an answer decoded several tokens a tick, at the cost
            of a longer tick).
        talker_window: None (each talker row holds its prompt and every token: what equals transformers), or the
            newest talker KV cells a row keeps beside `talker_sink` oldest ones (`omnijax.models.talker_kv`): rows
            are trimmed after their prefill and every step, and an utterance reserves the pages of its prompt or
            of `talker_sink + talker_window + 1` cells, whichever is more, whatever its `max_new_tokens`.
        talker_sink: the oldest talker cells kept with `talker_window`.
        early_start: Qwen2.5-Omni: speak an answer while the thinker writes it. The engine's decode programs then
            return each answer token's final-normed last-layer row (`FrameOutput.answer_rows`), and the pool opens
            answers still being written (`Qwen25SpeechPool.open(writing=True)`, `extend(..., rows=...)`). False
            (default): the pool speaks finished answers and the programs are those without the rows. Qwen3-Omni's
            talker reads embedding rows and starts while the answer is written either way (not read there).
    """

    rows: tuple[int, ...] = (1, 2, 4, 8)
    num_pages: int = 64
    page_size: int = 64
    max_pages: int | None = None
    first_chunk: int = 4
    chunk: int = 25
    vocoder_rows: int | None = None
    vocoder_budget_s: float | None = None
    slack_s: float = 0.5
    steps_per_tick: int = 1
    talker_window: int | None = None
    talker_sink: int = DEFAULT_TALKER_SINK
    early_start: bool = False

    def __post_init__(self):
        rows = tuple(int(b) for b in self.rows)
        if not rows or min(rows) < 1 or list(rows) != sorted(set(rows)):
            raise ValueError(f"SpeechConfig.rows must be distinct positive sizes in ascending order, got {self.rows}")
        object.__setattr__(self, "rows", rows)
        for name in ("num_pages", "page_size", "first_chunk", "chunk", "steps_per_tick"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SpeechConfig.{name} must be a positive integer, got {value!r}")
        if self.max_pages is not None and not 1 <= self.max_pages <= self.num_pages:
            raise ValueError(f"SpeechConfig.max_pages must lie in [1, num_pages={self.num_pages}], got "
                             f"{self.max_pages}")
        if self.vocoder_rows is not None and (isinstance(self.vocoder_rows, bool) or not isinstance(
                self.vocoder_rows, int) or self.vocoder_rows < 1):
            raise ValueError(f"SpeechConfig.vocoder_rows must be a positive integer or None, got {self.vocoder_rows!r}")
        if self.vocoder_budget_s is not None and not self.vocoder_budget_s > 0:
            raise ValueError(f"SpeechConfig.vocoder_budget_s must be positive or None, got {self.vocoder_budget_s}")
        if not self.slack_s >= 0:
            raise ValueError(f"SpeechConfig.slack_s must be >= 0, got {self.slack_s}")
        talker_policy(self.talker_window, self.talker_sink, what="SpeechConfig.talker_window")
        if not isinstance(self.early_start, bool):
            raise ValueError(f"SpeechConfig.early_start must be True or False, got {self.early_start!r}")

    @property
    def talker_kv(self) -> SinkWindow | None:
        """The talker rows' KV policy (None: unbounded)."""
        return talker_policy(self.talker_window, self.talker_sink)


@dataclasses.dataclass
class SpeechChunk:
    """One vocoder call's output for one session.

    Attributes:
        speech_id: the utterance.
        pcm: `[samples]` float32 at the model's rate (24 kHz); empty for an utterance that ended without a frame.
        codes: `[Q, n]` the frames it decoded.
        start_frame: index of its first frame in the utterance.
        final: the utterance ended with this chunk (the session left the pool).
        late_s: seconds past its playback deadline when it was sent (0 when on time, and for a first chunk).
        first_pcm_s: seconds from `open` to this chunk, for the utterance's first chunk (else None).
    """

    speech_id: str
    pcm: np.ndarray
    codes: np.ndarray
    start_frame: int
    final: bool
    late_s: float = 0.0
    first_pcm_s: float | None = None
