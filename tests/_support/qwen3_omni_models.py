"""Tiny Hugging Face Qwen3-Omni thinkers built in code (no network), saved in the release's tensor layout.

The text config mixes MoE and dense layers (`mlp_only_layers`), has one KV head, and the vision config taps two
DeepStack levels, as the tests of issue 24 ask.
"""

from __future__ import annotations

from pathlib import Path

TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3],
                             "interleaved": True})
AUDIO = dict(num_mel_bins=16, d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
             output_dim=64, downsample_hidden_size=8, n_window=50, n_window_infer=200)
VISION = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
# Token ids far below the release's so that the tiny vocabulary holds them (the loader refuses ids outside it), the
# chat markers included: a checkpoint converted without tokenizer files reads them from the config too.
IDS = dict(audio_token_id=290, image_token_id=291, video_token_id=292, audio_start_token_id=293,
           audio_end_token_id=294, vision_start_token_id=295, vision_end_token_id=296, im_start_token_id=297,
           im_end_token_id=298, position_id_per_seconds=13)


def thinker_config(*, audio_overrides: dict | None = None, **text_overrides):
    """The tiny thinker config; `audio_overrides` replace `AUDIO` entries (e.g. `num_mel_bins=128`)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig

    # The end-marker and chat-marker ids are not thinker config attributes in transformers; set here they are saved
    # in config.json (the converter reads them there, else from the tokenizer, else the release's).
    return Qwen3OmniMoeThinkerConfig(text_config=dict(TEXT, **text_overrides),
                                     audio_config=dict(AUDIO, **(audio_overrides or {})), vision_config=VISION, **IDS)


def build_thinker(seed: int = 0, scale: float = 0.1, *, audio_overrides: dict | None = None, **text_overrides):
    """A random tiny thinker in eval mode, every LLM weight redrawn as N(0, scale) (sharper routing and attention);
    `audio_overrides` replace `AUDIO` entries."""
    import torch
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3OmniMoeThinkerForConditionalGeneration(
        thinker_config(audio_overrides=audio_overrides, **text_overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.") or name.startswith("lm_head"):
                p.normal_(0.0, scale) if p.ndim > 1 else p.add_(torch.randn_like(p) * scale)
    return model


def save_thinker(thinker, directory: Path, **kwargs) -> Path:
    """Saves the thinker alone (`model_type` "qwen3_omni_moe_thinker", names without `thinker.`)."""
    thinker.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


def save_full(thinker, directory: Path, **kwargs) -> Path:
    """Saves `thinker` inside a full Qwen3-Omni model without its talker (names prefixed with `thinker.`)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

    full = Qwen3OmniMoeForConditionalGeneration(
        Qwen3OmniMoeConfig(thinker_config=thinker.config.to_dict(), enable_audio_output=False))
    full.thinker.load_state_dict(thinker.state_dict())
    full.save_pretrained(directory, safe_serialization=True, **kwargs)
    return directory


class windowed_audio:
    """Within the block, the reference audio tower attends within its `n_window_infer` windows, as deployments
    (and its flash-attention path) do: each layer gets the block-diagonal mask the reference builds from its own
    `cu_seqlens` (`_prepare_attention_mask`), which its eager path never passes."""

    def __init__(self, tower):
        self.tower, self.hooks = tower, []

    def __enter__(self):
        def add_mask(layer, args, kwargs):
            hidden, cu_seqlens = args[0], args[1]
            return args, {**kwargs, "attention_mask": self.tower._prepare_attention_mask(hidden, cu_seqlens)}

        self.hooks = [layer.register_forward_pre_hook(add_mask, with_kwargs=True) for layer in self.tower.layers]
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        return False


SPECIALS = {"<|endoftext|>": 289, "<|audio_pad|>": 290, "<|image_pad|>": 291, "<|video_pad|>": 292,
            "<|audio_start|>": 293, "<|audio_end|>": 294, "<|vision_start|>": 295, "<|vision_end|>": 296,
            "<|im_start|>": 297, "<|im_end|>": 298}


def write_tokenizer(directory: Path) -> Path:
    """A tiny byte-level BPE with the tiny thinker's special ids (ChatML template) next to a saved checkpoint."""
    from omnijax.models.tokenizer import CHATML_TEMPLATE, write_tiny_tokenizer

    return write_tiny_tokenizer(directory, vocab_size=TEXT["vocab_size"], special_tokens=SPECIALS,
                                chat_template=CHATML_TEMPLATE)
