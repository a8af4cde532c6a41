"""What Qwen3-Omni's talker reads of a conversation holding media, as transformers 5.2.0's
`Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)` builds it:

- `user_turns`: the prompt positions the talker reads (user turns; system turns, earlier answers and what precedes
  the first `<|im_start|>` are skipped).
- `thinker_hidden`: the rows standing for the thinker's `hidden_states[accept_hidden_layer]`: the embedding rows,
  with the kept `MediaRows` scattered in at the placeholders (only placeholder rows of user turns are read, and each
  of them must have its kept row).
- `talker_positions`: the talker's own M-RoPE positions, `get_rope_index` over the talker's input ids with the talker
  config's token ids: consecutive unless an image group is among them, then laid out with the images' grids.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from omnijax.models.qwen3_omni import positions as positions_lib
from omnijax.models.qwen3_omni.talker import TalkerConfig
from omnijax.models.speech import MediaRows

__all__ = ["talker_positions", "thinker_hidden", "user_turns"]


def user_turns(prompt: np.ndarray, im_start: int, user: int) -> np.ndarray:
    """`[T0]` bool: the prompt positions inside user turns (from a `<|im_start|>` followed by the user role token to
    the next `<|im_start|>`)."""
    read = np.zeros(prompt.shape, bool)
    starts = list(np.flatnonzero(prompt == im_start)) + [len(prompt)]
    for start, end in zip(starts[:-1], starts[1:]):
        if start + 1 < len(prompt) and prompt[start + 1] == user:
            read[start:end] = True
    return read


def thinker_hidden(embeds: jax.Array, sequence: np.ndarray, prompt_len: int, read: np.ndarray,
                   placeholders: dict[str, int], media: Sequence[MediaRows], layer: int) -> jax.Array:
    """The thinker rows the talker's hidden projection reads: `embeds [T, Dt]` with `media` scattered in.

    Raises:
        ValueError: a video placeholder in a user turn; a placeholder of a user turn without a row; a row of another
            layer or width, at a position that is not a placeholder of a user turn, or given twice; placeholders in
            the answer.
    """
    ids = {i: name for name, i in placeholders.items()}
    found = np.isin(sequence, list(ids))
    if found[prompt_len:].any():
        raise ValueError(f"answer_ids holds multimodal placeholders "
                         f"({', '.join(sorted({ids[int(t)] for t in sequence[prompt_len:][found[prompt_len:]]}))}); "
                         "an answer is text")
    need = found[:prompt_len] & read
    video = placeholders.get("video_token_id")
    if video is not None and (sequence[:prompt_len][need] == video).any():
        raise ValueError("a user turn holds a video (video_token_id placeholders): the talker's positions for videos "
                         "are not built (the reference does not pass use_audio_in_video to its talker); speak only "
                         "conversations whose videos lie outside user turns")
    covered = np.zeros(prompt_len, bool)
    for k, unit in enumerate(media):
        if not isinstance(unit, MediaRows):
            raise ValueError(f"media[{k}] must be a MediaRows, got {type(unit).__name__}")
        pos, rows = np.asarray(unit.positions), np.asarray(unit.rows)
        if unit.layer != layer:
            raise ValueError(f"media[{k}] holds hidden_states[{unit.layer}], the talker reads "
                             f"hidden_states[{layer}] (accept_hidden_layer)")
        if rows.shape[1] != embeds.shape[-1]:
            raise ValueError(f"media[{k}] rows are {rows.shape[1]} wide, the thinker's hidden size is "
                             f"{embeds.shape[-1]}")
        if pos.size and (pos.min() < 0 or pos.max() >= prompt_len or not need[pos].all()):
            bad = [int(p) for p in pos if not (0 <= p < prompt_len and need[p])]
            raise ValueError(f"media[{k}] has rows at prompt positions {bad[:4]} that are not placeholders of a user "
                             "turn (the talker reads none there)")
        if covered[pos].any():
            raise ValueError(f"media[{k}] gives rows at positions another unit already gave")
        covered[pos] = True
    missing = np.flatnonzero(need & ~covered)
    if missing.size:
        names = sorted({ids[int(t)] for t in sequence[missing]})
        raise ValueError(f"the prompt holds multimodal placeholders ({', '.join(names)}) in user turns at positions "
                         f"{missing[:4].tolist()}{'...' if missing.size > 4 else ''} without their thinker states "
                         f"(hidden_states[{layer}], which the talker reads there): pass them as media (MediaRows; "
                         "omnijax.Chat keeps them from the steps that fed the units)")
    if not media:
        return embeds
    at = np.concatenate([np.asarray(u.positions) for u in media])
    rows = np.concatenate([np.asarray(u.rows) for u in media]).astype(embeds.dtype)
    return embeds.at[jnp.asarray(at)].set(jnp.asarray(rows))


def talker_positions(talker_ids: np.ndarray, config: TalkerConfig, grids: Sequence[tuple[int, int, int]],
                     thinker: positions_lib.Qwen3OmniConfig) -> np.ndarray:
    """`[3, T]` float32: the reference's talker `get_rope_index` over its input ids, read with the talker config's
    token ids; `grids` the patch grids of the images among them, in order. `thinker` gives the end markers (the
    talker config has none; the reference never reads them)."""
    T = len(talker_ids)
    vs, image, video, audio_start, audio = (config.vision_start_token_id, config.image_token_id,
                                            config.video_token_id, config.audio_start_token_id, config.audio_token_id)
    segments: list[positions_lib.Segment] = []
    text = i = 0
    images = list(grids)
    while i < T:
        tok, nxt = int(talker_ids[i]), int(talker_ids[i + 1]) if i + 1 < T else None
        if (tok == vs and nxt in (image, video)) or tok == audio_start:
            if text:
                segments.append(positions_lib.TextRun(text))
                text = 0
            if tok == audio_start:
                j = i + 1
                while j < T and talker_ids[j] == audio:
                    j += 1
                segments.append(positions_lib.AudioGroup(j - i - 1))
                i = j + 1
                continue
            if nxt == video:
                raise ValueError("the talker's input holds a video group: its positions are not built")
            if not images:
                raise ValueError(f"the talker's input holds an image group at {i} without its grid")
            grid = images.pop(0)
            segments.append(positions_lib.ImageGroup(grid))
            i += positions_lib.vision_token_count(grid, config.spatial_merge_size) + 2
        else:
            text, i = text + 1, i + 1
    if text:
        segments.append(positions_lib.TextRun(text))
    if not any(isinstance(s, positions_lib.ImageGroup) for s in segments):
        return np.broadcast_to(np.arange(T, dtype=np.float32), (3, T)).copy()  # the reference's text path
    cfg = positions_lib.Qwen3OmniConfig(
        audio_token_id=audio, image_token_id=image, video_token_id=video, vision_start_token_id=vs,
        vision_end_token_id=thinker.vision_end_token_id, audio_start_token_id=audio_start,
        audio_end_token_id=thinker.audio_end_token_id, im_start_token_id=thinker.im_start_token_id,
        im_end_token_id=thinker.im_end_token_id, position_id_per_seconds=config.position_id_per_seconds,
        spatial_merge_size=config.spatial_merge_size)
    out = positions_lib.place(segments, cfg)
    if out.shape[1] != T:
        raise ValueError(f"the talker's input ids ({T}) do not match its media groups ({out.shape[1]} positions): an "
                         "image grid does not fit its placeholders")
    return out
