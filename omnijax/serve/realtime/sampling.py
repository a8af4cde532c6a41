"""A Realtime session's sampling settings (`session.omnijax`, `client_events.SAMPLING`) as the engine row its
responses draw with, exactly as chat completions builds a request's (`omnijax.serve.chat_sampling`): the settings
given, the server's `RowSampling` defaults for the rest, one row of the batched step (`omnijax.decoding.sampling_row`).

A duplex session (MiniCPM-o 4.5) decides on the host with the release's greedy rule
(`omnijax.models.minicpmo.duplex.DuplexDecodeRule`); of these settings it honours `presence_penalty` and
`frequency_penalty` (over its answer so far, across units: `omnijax.serve.engine.duplex.AnswerPenalties`) and refuses
the others by name.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omnijax.decoding import MAX_LOGIT_BIAS, DecodingStrategy, sampling_row
from omnijax.serve.engine.duplex import AnswerPenalties
from omnijax.serve.realtime.client_events import SAMPLING, RealtimeEventError, SessionSettings

__all__ = ["DUPLEX_SAMPLING", "check_sampling", "duplex_penalties", "session_row"]

# what a duplex session's decisions honour (the rest of `SAMPLING` is refused there)
DUPLEX_SAMPLING = ("presence_penalty", "frequency_penalty")


def given(settings: SessionSettings) -> list[str]:
    """The sampling settings the session sets (not None), in `SAMPLING`'s order."""
    return [name for name in SAMPLING if getattr(settings, name) is not None]


def check_sampling(settings: SessionSettings, *, per_row: bool, duplex: bool, vocab_size: int,
                   event_id: str | None = None) -> None:
    """Refuses, naming the field, sampling settings this session cannot honour: any on a server without per-row
    sampling, those a duplex session does not take, a `logit_bias` id outside the vocabulary or over
    `MAX_LOGIT_BIAS` ids.

    Raises:
        RealtimeEventError: `unsupported` or `invalid_value`, `param` the field.
    """
    names = given(settings)
    if duplex:
        extra = [n for n in names if n not in DUPLEX_SAMPLING]
        if extra:
            raise RealtimeEventError("unsupported", f"'session.omnijax.{extra[0]}': a duplex session decides with "
                                     f"MiniCPM-o 4.5's greedy rule; of the sampling settings it takes only "
                                     f"{' and '.join(DUPLEX_SAMPLING)}", event_id=event_id,
                                     param=f"session.omnijax.{extra[0]}")
        return
    if names and not per_row:
        raise RealtimeEventError("unsupported", f"'session.omnijax.{names[0]}': this server decodes every session "
                                 f"with one strategy; per-session sampling needs omnijax serve's RowSampling",
                                 event_id=event_id, param=f"session.omnijax.{names[0]}")
    bias = settings.logit_bias or ()
    param = "session.omnijax.logit_bias"
    if len(bias) > MAX_LOGIT_BIAS:
        raise RealtimeEventError("invalid_value", f"'{param}' holds {len(bias)} token ids, over the {MAX_LOGIT_BIAS} "
                                 f"a session may bias", event_id=event_id, param=param)
    for token, _ in bias:
        if not 0 <= token < vocab_size:
            raise RealtimeEventError("invalid_value", f"'{param}' key '{token}' is not a token id of the vocabulary "
                                     f"(0 to {vocab_size - 1})", event_id=event_id, param=param)


def session_row(settings: SessionSettings, decoding: DecodingStrategy, vocab_size: int) -> np.ndarray | None:
    """The row (`sampling_row`) a non-duplex session's responses draw with, None for the server's default (no
    setting but `seed`, which reseeds the session instead). Settings not given take the strategy's defaults, as
    chat completions' do; check them first (`check_sampling`)."""
    names = [n for n in given(settings) if n != "seed"]
    if not names:
        return None
    kw: dict[str, Any] = {name: getattr(decoding, name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                                     "repetition_penalty") if hasattr(decoding, name)}
    kw.update({name: getattr(settings, name) for name in names if name != "logit_bias"})
    return sampling_row(kw.pop("temperature", 0.0), kw.pop("top_p", 1.0), **kw,
                        logit_bias=dict(settings.logit_bias or ()), vocab_size=vocab_size)


def duplex_penalties(settings: SessionSettings) -> AnswerPenalties:
    """A duplex session's decision penalties (`presence_penalty`, `frequency_penalty`; not given: 0)."""
    return AnswerPenalties(presence=settings.presence_penalty or 0.0, frequency=settings.frequency_penalty or 0.0)
