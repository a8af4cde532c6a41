"""The talker's sampling on the server routes (issue 39): an omnijax extension, since OpenAI's audio output has no
sampling settings for its voice.

Chat completions take it as `audio.sampling` (beside `voice` and `format`): an object of `TalkerSampling`'s fields,
each optional (the reference's defaults: `temperature` 0.9, `top_k` 50, `top_p` 1.0, `repetition_penalty` 1.05,
`predictor_top_k` 50, `predictor_top_p` 0.8, `seed` 0). Without it the speech is greedy (the talker and its code
predictor take the top token: what transformers' `generate(..., talker_do_sample=False)` speaks). A given seed
speaks the same PCM every time (the draws' keys come from it alone, `TalkerSampling`), so the default seed 0 is
reproducible too: send another seed for other speech.

Refused by name (`param`: `audio.sampling.<field>`): an unknown field, a value of the wrong type or out of range
(the ranges `omnijax.decoding.Sampling` checks; `seed` in [0, 2**31 - 1]); and `audio.sampling` on a checkpoint whose
talker does not draw (Qwen2.5-Omni's: `code` "unsupported").
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omnijax.models.qwen3_omni.speech import Qwen3Speech
from omnijax.models.qwen3_omni.talker_decode import TalkerSampling
from omnijax.serve.chat_params import RequestError, check_keys

__all__ = ["FIELDS", "SEED_MAX", "parse_talker_sampling"]

FIELDS = tuple(f.name for f in dataclasses.fields(TalkerSampling))
SEED_MAX = 2**31 - 1  # the draws' keys take the seed as a 32-bit integer
_INTS = ("top_k", "predictor_top_k", "seed")


def parse_talker_sampling(value: Any, where: str, speech: Any) -> TalkerSampling | None:
    """The `TalkerSampling` a request's `where` object asks for (None: not given, greedy).

    Args:
        value: the object as sent (or None).
        where: its name in the request, for the errors (e.g. "audio.sampling").
        speech: the served checkpoint's speech output (`model.speech`).

    Raises:
        RequestError: naming the field (see the module docstring).
    """
    if value is None:
        return None
    if not isinstance(speech, Qwen3Speech):
        raise RequestError(f"'{where}' is not supported: this checkpoint's talker ({type(speech).__name__}) speaks "
                           "greedily only (talker sampling is built for Qwen3-Omni); omit it", code="unsupported",
                           param=where)
    if not isinstance(value, dict):
        raise RequestError(f"'{where}' must be an object of {list(FIELDS)} (each optional), got "
                           f"{type(value).__name__}", param=where)
    check_keys(value, FIELDS, where)
    for name, v in value.items():
        ok = (isinstance(v, int) if name in _INTS else isinstance(v, (int, float))) and not isinstance(v, bool)
        if not ok:
            raise RequestError(f"'{where}.{name}' must be {'an integer' if name in _INTS else 'a number'}, got "
                               f"{v!r}", param=f"{where}.{name}")
        if name == "seed" and not 0 <= v <= SEED_MAX:
            raise RequestError(f"'{where}.seed' must lie in [0, {SEED_MAX}], got {v}", param=f"{where}.seed")
        try:
            TalkerSampling(**{name: v})
        except ValueError as e:
            raise RequestError(f"'{where}.{name}': {e}", param=f"{where}.{name}") from None
    return TalkerSampling(**value)
