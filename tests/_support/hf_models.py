"""Tiny Hugging Face Qwen2.5-Omni thinkers built in code (no network), saved in the release's tensor layout.

Their special ids are those of the tiny checkpoints (`omnijax.testing.checkpoints.tiny_token_ids`: the top of the
300-token vocabulary, the release's in a vocabulary that holds them), set in the thinker config, so transformers and
the converted checkpoint read the same ids and the loader's vocabulary check passes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omnijax.models.qwen2_5_omni.config import OmniConfig

TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
            tie_word_embeddings=False)
AUDIO = dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, n_window=100, output_dim=64,
             num_mel_bins=128)
VISION = dict(hidden_size=32, depth=1, num_heads=2, intermediate_size=48, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2, fullatt_block_indexes=[0], out_hidden_size=64)


def thinker_config(ids: OmniConfig | None = None, **text_overrides):
    """The tiny thinker config with `ids` (default `tiny_token_ids` of its vocabulary) as its special ids: the
    placeholders and modality markers under transformers' names, the chat markers (which transformers' thinker does
    not read) as extra attributes the converter reads from `config.json`."""
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniThinkerConfig

    from omnijax.testing.checkpoints import HF_TOKEN_KEYS, tiny_token_ids

    text = dict(TEXT, **text_overrides)
    ids = tiny_token_ids(text["vocab_size"]) if ids is None else ids
    named = {key: getattr(ids, field) for field, key in HF_TOKEN_KEYS.items()}
    return Qwen2_5OmniThinkerConfig(text_config=text, audio_config=AUDIO, vision_config=VISION, **named,
                                    im_start_token_id=ids.im_start_token_id, im_end_token_id=ids.im_end_token_id,
                                    tie_word_embeddings=text["tie_word_embeddings"])


def build_thinker(seed: int = 0, scale: float = 0.0, ids: OmniConfig | None = None, **text_overrides):
    """A random tiny thinker in eval mode. `scale` > 0 re-draws every weight as N(0, scale) for sharper attention;
    `ids`: its special ids (see `thinker_config`)."""
    import torch
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5OmniThinkerForConditionalGeneration(thinker_config(ids, **text_overrides)).eval()
    if scale > 0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith("model.") or name.startswith("lm_head"):
                    p.normal_(0.0, scale) if p.ndim > 1 else p.add_(torch.randn_like(p) * scale)
    return model


def save_full(thinker, directory: Path, **kwargs) -> Path:
    """Saves `thinker` inside a full Qwen2.5-Omni model (names prefixed with `thinker.`)."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration

    full = Qwen2_5OmniForConditionalGeneration(
        Qwen2_5OmniConfig(thinker_config=thinker.config.to_dict(), enable_audio_output=False))
    full.thinker.load_state_dict(thinker.state_dict())
    full.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory
