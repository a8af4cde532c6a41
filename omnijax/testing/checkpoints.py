"""Tiny checkpoints built in place (no download), shared by `make demo`, `omnijax serve --demo-model`, the harnesses'
`--demo` runs, the tests and the benchmarks: a random Qwen2.5-Omni checkpoint in Hugging Face format (with encoders
when asked), a tiny tokenizer, the chat-ready pair of both, and synthetic audiovisual units."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from omnijax.models.encoders.whisper import AudioConfig, audio_component
from omnijax.models.qwen2_5_omni import frontend
from omnijax.models.qwen2_5_omni.config import TOKEN_TEXT, OmniConfig
from omnijax.models.qwen2_5_omni.vision import VisionConfig, vision_component
from omnijax.models.tokenizer import CHATML_TEMPLATE
from omnijax.models.tokenizer import write_tiny_tokenizer as write

# Hugging Face config of the embedded tiny model (full-model layout: thinker + speech-output parts).
TINY_TEXT_CONFIG = {
    "model_type": "qwen2_5_omni_text", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "use_sliding_window": False, "sliding_window": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
    "tie_word_embeddings": False, "attention_dropout": 0.0, "layer_types": ["full_attention"] * 4,
}
# The audiovisual demo needs the real special-token ids (<|VIDEO|> is 151656): the vocabulary of the 3B release,
# with the head tied to the embedding to halve the file.
TINY_OMNI_TEXT_CONFIG = dict(TINY_TEXT_CONFIG, vocab_size=151_936, tie_word_embeddings=True)
# Encoders (their output width is set to the text hidden size when written).
TINY_AUDIO_CONFIG = {"num_mel_bins": 128, "d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 4,
                     "encoder_ffn_dim": 64, "n_window": 100, "max_source_positions": 1500}
TINY_VISION_CONFIG = {"depth": 2, "hidden_size": 32, "num_heads": 4, "intermediate_size": 64, "patch_size": 14,
                      "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                      "fullatt_block_indexes": [1], "in_channels": 3}
# Frames of the demo are small (56x84 px); the processor's video minimum (128 tokens of 28x28 px) would upscale
# them 4.7x, so the demo lowers it to the image processor's 56x56 px: 2x3 LLM tokens per temporal patch.
DEMO_VIDEO_MIN_PIXELS = 56 * 56
FRAME_HEIGHT, FRAME_WIDTH, FPS, UNIT_SECONDS = 56, 84, 2.0, 2.0


def _encoder_tensors(component, init) -> dict[str, np.ndarray]:
    """Random Hugging Face tensors for every rule of a conversion `Component` (all layers of layered rules)."""
    out = {}
    for rule in component.active_rules():
        shape = rule.source_shape(component.dims)
        names = [rule.hf_name.format(i=i) for i in range(component.num_layers)] if rule.layered else [rule.hf_name]
        for name in names:
            out["thinker." + component.prefix + name] = init(name, shape)
    return out


# OmniConfig field -> the Hugging Face thinker config key that holds it (the chat markers live in the tokenizer only).
HF_TOKEN_KEYS = {"audio_token_id": "audio_token_index", "image_token_id": "image_token_index",
                 "video_token_id": "video_token_index", "audio_start_token_id": "audio_start_token_id",
                 "audio_end_token_id": "audio_end_token_id", "vision_start_token_id": "vision_start_token_id",
                 "vision_end_token_id": "vision_end_token_id"}
ENDOFTEXT = "<|endoftext|>"
# The top of a small vocabulary: id (vocab_size - k) for each special token, `<|endoftext|>` just below the chat
# markers as in the release (151643, 151644, 151645).
_TOP_OF_VOCAB = {"audio_token_id": 10, "audio_start_token_id": 9, "audio_end_token_id": 8, "vision_start_token_id": 7,
                 "vision_end_token_id": 6, "image_token_id": 5, "video_token_id": 4, "im_start_token_id": 2,
                 "im_end_token_id": 1}


def tiny_token_ids(vocab_size: int) -> OmniConfig:
    """The special ids of a tiny checkpoint with `vocab_size` tokens: the release's where the vocabulary holds them
    (the demo's 151,936, the tests' 151,700), else the top ten ids: `<|AUDIO|>` at vocab_size - 10, `<|audio_bos|>`,
    `<|audio_eos|>`, `<|vision_bos|>`, `<|vision_eos|>`, `<|IMAGE|>`, `<|VIDEO|>` (vocab_size - 4), `<|endoftext|>`
    (`special_tokens`), `<|im_start|>` and `<|im_end|>` (vocab_size - 1). The loader and the converter refuse ids
    outside the vocabulary, so a checkpoint's ids must move with its size."""
    release = OmniConfig()
    if vocab_size > max(release.boundary_ids | release.placeholder_ids):
        return release
    if vocab_size <= max(_TOP_OF_VOCAB.values()):
        raise ValueError(f"a tiny checkpoint's vocabulary must hold its {len(_TOP_OF_VOCAB) + 1} special tokens, got "
                         f"vocab_size={vocab_size}")
    return OmniConfig(**{field: vocab_size - k for field, k in _TOP_OF_VOCAB.items()})


def special_tokens(ids: OmniConfig) -> dict[str, int]:
    """Token text -> id of every special token a tiny tokenizer holds for `ids`: the `OmniConfig` tokens and
    `<|endoftext|>` just below `<|im_start|>`."""
    return {ENDOFTEXT: ids.im_start_token_id - 1, **{text: getattr(ids, field) for field, text in TOKEN_TEXT.items()}}


def write_tiny_hf_checkpoint(directory: Path, *, seed: int = 0, text_config: dict | None = None,
                             encoders: bool = True, token_ids: dict | None = None,
                             silent_ids: tuple[int, int] | None = None) -> Path:
    """Writes `config.json` + `model.safetensors` of a random tiny Qwen2.5-Omni in the release's tensor layout.

    Names carry the `thinker.` prefix of the full model; a few `talker.` and `token2wav.` tensors stand in for the
    speech-output parts a real release ships. With `encoders`, the thinker config also declares a tiny audio tower
    (d_model 32, 1 layer) and vision tower (hidden 32, depth 2, block 1 full attention), both projecting to the text
    hidden size, and their random `thinker.audio_tower.*` / `thinker.visual.*` tensors are generated from the
    conversion tables (plus the unused `audio_tower.audio_bos_eos_token.weight` a release ships). The LM head is
    written unless the text config ties it to the embedding.

    `silent_ids=(start, stop)` zeroes those rows of the embedding: with a tied head their logits are 0, so a random
    model answers mostly with the ids a tiny tokenizer uses (the demo's readable gibberish).

    `token_ids` (OmniConfig field name -> id; default `tiny_token_ids` of the vocabulary: the release's ids where
    they fit, else the top of the vocabulary) are the checkpoint's special ids: the placeholders and modality markers
    go into the thinker config under their Hugging Face names (`HF_TOKEN_KEYS`), and, unless they are the release's,
    every special token, the chat markers included, into an `added_tokens.json` (the tokenizer's view), as a
    checkpoint with its own vocabulary would ship them.
    """
    cfg = dict(TINY_TEXT_CONFIG if text_config is None else text_config)
    rng = np.random.default_rng(seed)
    D, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, G = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = D // H

    def w(*shape, scale=0.05):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    tied = bool(cfg.get("tie_word_embeddings", False))
    # A tied head reads the embedding back: a smaller scale keeps each token from dominating its own logits.
    embed = w(V, D, scale=0.1 if tied else 0.5)
    if silent_ids is not None:  # ids a tiny tokenizer never produces: zero rows, so a tied head rarely picks them
        embed[silent_ids[0]:silent_ids[1]] = 0
    tensors = {"thinker.model.embed_tokens.weight": embed,
               "thinker.model.norm.weight": 1 + w(D)}
    if not tied:
        tensors["thinker.lm_head.weight"] = w(V, D, scale=0.2)
    for i in range(cfg["num_hidden_layers"]):
        p = f"thinker.model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": 1 + w(D), p + "post_attention_layernorm.weight": 1 + w(D),
            p + "self_attn.q_proj.weight": w(H * d, D, scale=0.2), p + "self_attn.q_proj.bias": w(H * d),
            p + "self_attn.k_proj.weight": w(G * d, D, scale=0.2), p + "self_attn.k_proj.bias": w(G * d),
            p + "self_attn.v_proj.weight": w(G * d, D, scale=0.2), p + "self_attn.v_proj.bias": w(G * d),
            p + "self_attn.o_proj.weight": w(D, H * d),
            p + "mlp.gate_proj.weight": w(I, D), p + "mlp.up_proj.weight": w(I, D), p + "mlp.down_proj.weight": w(D, I),
        })

    ids = tiny_token_ids(V) if token_ids is None else OmniConfig(**token_ids)  # refuses unknown names
    thinker = {"model_type": "qwen2_5_omni_thinker", "text_config": cfg,
               **{key: getattr(ids, field) for field, key in HF_TOKEN_KEYS.items()},
               "position_id_per_seconds": 25, "seconds_per_chunk": 2}
    if encoders:
        def init(name, shape):
            if len(shape) == 1:  # norm scales near 1, biases near 0
                return 1 + w(*shape) if "norm" in name or "ln_" in name else w(*shape, scale=0.02)
            fan_in = int(np.prod(shape[1:]))  # torch layouts: [out, in, ...]
            return w(*shape, scale=1.0 / np.sqrt(fan_in))

        audio = AudioConfig(**TINY_AUDIO_CONFIG, output_dim=D)
        vision = VisionConfig(**TINY_VISION_CONFIG, out_hidden_size=D)
        tensors.update(_encoder_tensors(audio_component(audio), init))
        tensors.update(_encoder_tensors(vision_component(vision), init))
        tensors["thinker.audio_tower.audio_bos_eos_token.weight"] = w(2, D)  # in releases, never read
        thinker["audio_config"] = {"model_type": "qwen2_5_omni_audio_encoder", "activation_function": "gelu",
                                   **{k: v for k, v in audio.to_json().items() if k != "dtype"}}
        thinker["vision_config"] = {"model_type": "qwen2_5_omni_vision_encoder", "hidden_act": "silu",
                                    "tokens_per_second": 25,
                                    **{k: v for k, v in vision.to_json().items() if k != "dtype"}}
    tensors["talker.model.norm.weight"] = np.ones(8, np.float32)
    tensors["token2wav.code_embed.weight"] = w(4, 8)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Qwen2_5OmniForConditionalGeneration"], "model_type": "qwen2_5_omni",
        "enable_audio_output": False, "thinker_config": thinker,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if ids != OmniConfig():
        added = {text: getattr(ids, field) for field, text in TOKEN_TEXT.items()}
        (directory / "added_tokens.json").write_text(json.dumps(added, indent=2))
    return directory


def write_tiny_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A tiny byte-level BPE tokenizer for the tiny checkpoint of `vocab_size` tokens: ChatML template, Qwen2.5-Omni's
    special tokens at the checkpoint's ids (`tiny_token_ids`: the release's where they fit, `<|endoftext|>` 151643
    included; else the top of the vocabulary), ordinary tokens below them."""
    return write(directory, vocab_size=vocab_size, special_tokens=special_tokens(tiny_token_ids(vocab_size)),
                 chat_template=CHATML_TEMPLATE)


def write_chat_checkpoint(directory: Path) -> Path:
    """The demo's chat-ready source: the tiny tokenizer, then the tiny checkpoint with the ids that tokenizer never
    produces silenced (its answers are the tokenizer's readable gibberish). Returns `directory`."""
    write_tiny_tokenizer(directory, TINY_OMNI_TEXT_CONFIG["vocab_size"])
    vocab = json.loads((Path(directory) / "tokenizer.json").read_text())["model"]["vocab"]
    trained = sum(1 for token in vocab if not token.startswith("<|unused_"))
    write_tiny_hf_checkpoint(directory, text_config=TINY_OMNI_TEXT_CONFIG, silent_ids=(trained, 151_643))
    return Path(directory)


def synthetic_units(num_units: int, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """`num_units` audiovisual 2 s units of moving shapes (56x84 px at 2 fps) and a tone: `[(frames, pcm)]`."""
    units = []
    for k in range(num_units):
        start = k * UNIT_SECONDS
        frames = frontend.synthetic_frames(UNIT_SECONDS, FPS, FRAME_HEIGHT, FRAME_WIDTH, seed=seed, start=start)
        pcm = frontend.tone(UNIT_SECONDS, 220.0 * (1 + k % 4), seed=seed + k, start=start)
        units.append((frames, pcm))
    return units
