"""Qwen3-Omni's speech pool, its Code2Wav side (`Code2WavChunks`, a mixin of
`omnijax.serve.engine.speech.SpeechPool`): which sessions' chunks are due, in what order they are decoded
(playback deadline first, first chunks before any other), how the due chunks share batched Code2Wav calls (a short
last chunk padded to the next power of two), the vocoder's time budget a tick, and the warm-up of every call a tick
can make. See `omnijax.serve.engine.speech`'s docstring (step 3 of a tick).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from omnijax.models.qwen3_omni import code2wav_rows
from omnijax.serve.engine.speech_config import SpeechChunk, SpeechConfig

__all__ = ["Code2WavChunks"]


class Code2WavChunks:
    """The vocoder chunks of a Qwen3-Omni speech pool. The pool sets `config` (`SpeechConfig`), `speech` (the
    model's speech output), `talker` (its talker config), `clock`, `stats`, `_utterances` (speech id -> utterance:
    `ready` frames, `pushed`, `samples`, `state`, `first_s`, `opened_s`, `done`), `_c2w` / `_c2w_params` (Code2Wav's
    config and parameters), `_fillers` (the filler states of padded rows, by started) and `_vocoder_rows`, and
    defines `close`."""

    config: SpeechConfig
    speech: Any
    talker: Any
    clock: Callable[[], float]
    stats: dict[str, Any]
    _utterances: dict
    _c2w: Any
    _c2w_params: Any
    _fillers: dict[bool, Any]
    _vocoder_rows: int
    close: Callable[[str], None]  # the pool's `SpeechPool.close`

    def warm_vocoder(self) -> int:
        """Compiles every one-session Code2Wav call a tick can make (first and later calls, full and each shorter
        power-of-two length) on zero codes, changing nothing; returns the calls run (the server's warm-up). Later
        calls continue a first call's returned state, as an utterance's do (a filler state compiles apart)."""
        calls, later = 0, self._fillers[True]
        for started, full in ((False, self.config.first_chunk), (True, self.config.chunk)):
            for frames in sorted({full, *(1 << k for k in range(max(1, full).bit_length()) if 1 << k < full)}):
                codes = np.zeros((1, self._c2w.num_quantizers, frames), np.int32)
                state = later if started else self._fillers[False]
                _, new = code2wav_rows.decode_rows(self._c2w_params, self._c2w, codes, [state])
                later = later if started else new[0]  # a first call's returned state
                calls += 1
        return calls

    def _due(self, u: Any) -> int:
        """Frames of the utterance's next vocoder call if one is due now, else 0."""
        need = self.config.first_chunk if u.pushed == 0 else self.config.chunk
        if len(u.ready) >= need:
            return need
        return len(u.ready) if u.done else 0

    def _deadline(self, u: Any) -> float:
        """When the audio sent so far runs out (-inf before the first chunk: nothing plays yet)."""
        if u.first_s is None:
            return -math.inf
        return u.first_s + u.samples / self.speech.sample_rate

    def _vocode(self) -> list[SpeechChunk]:
        out: list[SpeechChunk] = []
        start = self.clock()
        budget, slack = self.config.vocoder_budget_s, self.config.slack_s
        pending = sorted(((self._deadline(u), s) for s, u in self._utterances.items() if self._due(u)
                          or (u.done and not u.ready)), key=lambda x: x[0])
        while pending:
            now = self.clock()
            if budget is not None and out and now - start >= budget:
                urgent = [p for p in pending if p[0] - now <= slack]
                self.stats["deferred"] += len(pending) - len(urgent)
                pending = urgent
                if not pending:
                    break
            key = self._call_key(self._utterances[pending[0][1]])
            group = [p for p in pending if self._call_key(self._utterances[p[1]]) == key][:self._vocoder_rows]
            pending = [p for p in pending if p not in group]
            out.extend(self._vocode_rows(group, *key))
        self.stats["vocoder_s"] += self.clock() - start
        return out

    def _call_key(self, u: Any) -> tuple[bool, int]:
        """The Code2Wav call an utterance's due chunk joins: (a later call, its frames). A full chunk's frames are
        `first_chunk` / `chunk`; a shorter last chunk's the next power of two (at most the full chunk), so padding
        costs less than twice its frames and few lengths compile."""
        started, n = u.pushed > 0, self._due(u)
        full = self.config.chunk if started else self.config.first_chunk
        return started, full if n >= full else min(full, 1 << max(0, n - 1).bit_length())

    def _vocode_rows(self, group: list[tuple[float, str]], started: bool, frames: int) -> list[SpeechChunk]:
        """One Code2Wav call of `frames` frames for the due chunks of `group` (the same `_call_key`), each row on
        its own state; a shorter last chunk is padded to the call's length and its padding's samples cut."""
        calls = []
        for deadline, s in group:
            u = self._utterances[s]
            n = self._due(u)
            codes = (np.stack(u.ready[:n], axis=1) if n else np.zeros((self.talker.num_code_groups, 0), np.int32))
            u.ready = u.ready[n:]
            calls.append((deadline, s, u, codes))
        rows = [c for c in calls if c[3].shape[1]]
        pcm: dict[str, np.ndarray] = {}
        if rows:
            bucket = 1 if len(rows) == 1 else next(b for b in self.config.rows if b >= len(rows))
            codes = np.stack([code2wav_rows.pad_codes(c[3], frames) for c in rows]
                             + [np.zeros((self._c2w.num_quantizers, frames), np.int32)] * (bucket - len(rows)))
            states = [c[2].state for c in rows] + [self._fillers[started]] * (bucket - len(rows))
            wav, new = code2wav_rows.decode_rows(self._c2w_params, self._c2w, codes, states)
            self.stats["vocoder_calls"] += 1
            self.stats["vocoder_rows"] += len(rows)
            wav = np.asarray(wav, np.float32)
            for r, (_, s, u, c) in enumerate(rows):
                u.state = new[r]
                pcm[s] = wav[r, :code2wav_rows.kept_samples(self._c2w, c.shape[1], started)]
        out = []
        now = self.clock()
        for deadline, s, u, codes in calls:
            samples = pcm.get(s, np.zeros((0,), np.float32))
            late = 0.0 if u.first_s is None else max(0.0, now - deadline)
            first = None
            if u.first_s is None and samples.size:
                u.first_s, first = now, now - u.opened_s
            chunk = SpeechChunk(s, samples, codes, u.pushed, u.done and not u.ready, late, first)
            u.pushed += codes.shape[1]
            u.samples += samples.size
            self.stats["chunks"] += 1
            if late > 0:
                self.stats["late_chunks"] += 1
                self.stats["late_s"] += late
            out.append(chunk)
            if chunk.final:
                self.close(s)
        return out
