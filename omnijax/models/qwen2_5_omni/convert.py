"""Qwen2.5-Omni thinker LLM (and plain Qwen2 / Qwen3 LLMs) -> omnijax decoder conversion.

Three parts:
- `config_from_hf` (in `hf_config`, re-exported here): the Hugging Face config (full model or thinker only) ->
  `DecoderConfig`, refusing every attribute that would change the math in a way the decoder does not implement.
- `NAME_TABLE`: a declarative map from Hugging Face tensor names to paths of the decoder's pure-dict parameter tree
  (`omnijax/models/decoder.py`), plus the few prefixes that are skipped on purpose.
- `convert_params`: validates the whole checkpoint against the table (names and shapes, from the headers only), then
  fills pre-allocated memory-mapped output arrays tensor by tensor, so resident memory stays near the largest
  single tensor whatever the model size.

Tied embeddings are decided from the tensors present, not from the config alone: `lm_head.weight` present -> a
separate head is loaded (even if a `tie_word_embeddings` flag says tied); absent -> the head is tied to the
embedding, provided the config's flag says so (otherwise the tensor is reported missing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from omnijax.checkpoint import loop as streaming
from omnijax.checkpoint import name_tables as tables
from omnijax.checkpoint.name_tables import Component, Rule
from omnijax.checkpoint.safetensors import SafetensorsCheckpoint
from omnijax.checkpoint.special_tokens import read_special_tokens
from omnijax.errors import ConfigError, ConvertError, MissingTensorError
from omnijax.models.config import DecoderConfig
from omnijax.models.encoders import whisper as audio_lib
from omnijax.models.encoders.common import linear_rules
from omnijax.models.qwen2_5_omni import vision as vision_lib
from omnijax.models.qwen2_5_omni import voices as voices_lib
from omnijax.models.qwen2_5_omni.config import OmniConfig
from omnijax.models.qwen2_5_omni.hf_config import (  # the converter's config side, re-exported (`__all__`)
    HF_MODEL_TYPES,
    IM_END_TOKEN_ID,
    OMNIJAX_MODEL_TYPES,
    config_from_hf,
    default_eos,
    has_speech_output,
    model_type_for,
    speech_configs,
    talker_config_from_hf,
)
from omnijax.models.qwen2_5_omni.talker import TALKER_PREFIX, TalkerConfig
from omnijax.models.qwen2_5_omni.token2wav import token2wav_components

__all__ = ["HF_MODEL_TYPES", "IM_END_TOKEN_ID", "NAME_TABLE", "OMNIJAX_MODEL_TYPES", "SPEECH_OUTPUT_PREFIXES",
           "THINKER_PREFIX", "config_from_hf", "convert_params", "decoder_component", "default_eos",
           "encoder_components", "has_speech_output", "model_type_for", "param_shapes", "read_encoders",
           "speech_configs", "talker_component", "talker_config_from_hf"]

_L = "model.layers.{i}."
NAME_TABLE: tuple[Rule, ...] = (
    Rule("model.embed_tokens.weight", "embed", "V D"),
    Rule(_L + "input_layernorm.weight", "layers/input_norm", "D"),
    Rule(_L + "post_attention_layernorm.weight", "layers/post_norm", "D"),
    Rule(_L + "self_attn.q_proj.weight", "layers/q_proj", "D Q", transform="T"),
    Rule(_L + "self_attn.q_proj.bias", "layers/q_bias", "Q", when="qkv_bias"),
    Rule(_L + "self_attn.k_proj.weight", "layers/k_proj", "D K", transform="T"),
    Rule(_L + "self_attn.k_proj.bias", "layers/k_bias", "K", when="qkv_bias"),
    Rule(_L + "self_attn.v_proj.weight", "layers/v_proj", "D K", transform="T"),
    Rule(_L + "self_attn.v_proj.bias", "layers/v_bias", "K", when="qkv_bias"),
    Rule(_L + "self_attn.o_proj.weight", "layers/o_proj", "Q D", transform="T"),
    Rule(_L + "self_attn.q_norm.weight", "layers/q_norm", "d", when="qk_norm"),
    Rule(_L + "self_attn.k_norm.weight", "layers/k_norm", "d", when="qk_norm"),
    Rule(_L + "mlp.gate_proj.weight", "layers/gate_proj", "D I", transform="T", layers="dense", when="dense_mlp"),
    Rule(_L + "mlp.up_proj.weight", "layers/up_proj", "D I", transform="T", layers="dense", when="dense_mlp"),
    Rule(_L + "mlp.down_proj.weight", "layers/down_proj", "I D", transform="T", layers="dense", when="dense_mlp"),
    # Qwen3-MoE layers (`DecoderConfig.sparse_layers`): the router and each expert's SwiGLU, stacked [Lm, E, ...].
    Rule(_L + "mlp.gate.weight", "layers/router", "D E", transform="T", layers="sparse", when="moe"),
    *(Rule(_L + f"mlp.experts.{{e}}.{name}_proj.weight", f"layers/expert_{name}", dims, transform="T",
           layers="sparse", when="moe") for name, dims in (("gate", "D Ie"), ("up", "D Ie"), ("down", "Ie D"))),
    Rule("model.norm.weight", "final_norm", "D"),
    Rule("lm_head.weight", "lm_head", "D V", transform="T", when="untied"),
)
THINKER_PREFIX = "thinker."
# Speech output (talker LM and token-to-waveform vocoder): converted from a full release with audio output
# (`speech_configs`), skipped (and logged) from a config that sets enable_audio_output false.
SPEECH_OUTPUT_PREFIXES = ("talker.", "token2wav.")


def _unused_tensors() -> tuple[str, ...]:
    """Tensors present in releases that the model never reads."""
    return tuple("audio_tower." + name for name in audio_lib.UNUSED_HF_TENSORS)


def _thinker_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    return hf_config.get("thinker_config", {}) if hf_config.get("model_type") == "qwen2_5_omni" else hf_config


def encoder_components(hf_config: Mapping[str, Any], dtype: str) -> dict[str, tuple[Component, dict]]:
    """The encoder components a Qwen2.5-Omni config declares: name -> (component, JSON config)."""
    if model_type_for(hf_config) != "qwen2_5_omni":
        return {}
    return read_encoders(_thinker_config(hf_config), dtype, (
        ("audio", "audio_config", audio_lib.AudioConfig, audio_lib.audio_component),
        ("vision", "vision_config", vision_lib.VisionConfig, vision_lib.vision_component)))


def read_encoders(thinker: Mapping[str, Any], dtype: str,
                  encoders: Iterable[tuple[str, str, Any, Callable[[Any], Any]]]) -> dict[str, tuple[Any, dict]]:
    """The encoders a thinker config declares: for each `(name, config key, config class, tables)` whose key is
    set, name -> (`tables(config)`, the config as JSON); inconsistent values become `ConfigError`s naming the key."""
    out = {}
    for name, key, config_cls, tables_of in encoders:
        if thinker.get(key) is None:
            continue
        try:
            config = config_cls.from_hf(thinker[key], dtype=dtype)
        except ConvertError:
            raise
        except ValueError as e:  # inconsistent values
            raise ConfigError(f"{key}: {e}") from e
        out[name] = (tables_of(config), config.to_json())
    return out


def decoder_component(config: DecoderConfig) -> Component:
    """The decoder's conversion table with its sizes (`Component.name` "decoder")."""
    c = config
    dims = {"V": c.vocab_size, "D": c.hidden_size, "I": c.intermediate_size, "d": c.head_dim,
            "Q": c.num_heads * c.head_dim, "K": c.num_kv_heads * c.head_dim, "E": c.num_experts,
            "Ie": c.moe_intermediate_size}
    sparse = c.sparse_layers
    layer_sets = {"dense": tuple(i for i, s in enumerate(sparse) if not s),
                  "sparse": tuple(i for i, s in enumerate(sparse) if s)}
    flags = {"qkv_bias": c.qkv_bias, "qk_norm": c.qk_norm, "untied": not c.tie_embeddings,
             "dense_mlp": bool(layer_sets["dense"]), "moe": bool(layer_sets["sparse"])}
    return Component(name="decoder", prefix="", rules=NAME_TABLE, dims=dims, num_layers=c.num_layers, flags=flags,
                     layer_sets=layer_sets, num_experts=c.num_experts)


def param_shapes(config: DecoderConfig) -> dict[str, Any]:
    """The decoder's pure-dict parameter tree as nested dicts of shape tuples (layer params lead with `L`)."""
    return tables.param_shapes(decoder_component(config))


# -------------------------------------------------------------------------------------------------- speech output

def talker_component(config: TalkerConfig) -> Component:
    """The talker's conversion table (prefix `talker.`, tree "talker"): the thinker's layer rules (`NAME_TABLE`),
    the codec embedding at the thinker's width, `thinker_to_talker_proj` and the codec head (transposed)."""
    c = config.decoder
    rules = [r for r in NAME_TABLE if r.hf_name not in ("model.embed_tokens.weight", "lm_head.weight")]
    rules += [Rule("model.embed_tokens.weight", "codec_embedding", "V Dt"),
              *linear_rules("thinker_to_talker_proj", "proj", "proj_bias", "Dt D"),
              *linear_rules("codec_head", "codec_head", None, "D V")]
    base = decoder_component(c)
    return Component(name="talker", prefix=TALKER_PREFIX, rules=tuple(rules),
                     dims={**base.dims, "Dt": config.embedding_size}, num_layers=c.num_layers, flags=base.flags,
                     layer_sets=base.layer_sets)


# ------------------------------------------------------------------------------------------------------ conversion


def convert_params(ckpt: SafetensorsCheckpoint, hf_config: Mapping[str, Any], *, dtype: str, staging_dir: Path,
                   progress: bool = True, log: Callable[[str], None] = streaming.stderr
                   ) -> tuple[DecoderConfig, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Converts the thinker LLM's weights into memory-mapped arrays in the decoder's layout.

    Args:
        ckpt: the validated source checkpoint.
        hf_config: its parsed `config.json`.
        dtype: target dtype, "float32" or "bfloat16" (float32 sources cast with round-to-nearest-even).
        staging_dir: directory for the output arrays' memory-mapped files (created; the caller deletes it).
        progress: show a tqdm bar over tensors on stderr.
        log: receives the one-line summaries of skipped tensors.

    Returns:
        `(config, params, source_info, extras)`: the final `DecoderConfig`, the decoder's pure-dict tree of
        `np.memmap` arrays, a JSON-serialisable summary for the manifest, and the other checkpoint components as
        name -> (JSON config, tree or None): the encoders, and the thinker's token ids and TMRoPE timing ("omni").
    """
    config = config_from_hf(hf_config, dtype=dtype)
    # Special ids: the thinker config's, else the tokenizer's added tokens, else the release's. The answer ends at
    # the checkpoint's <|im_end|> (a generation_config.json eos_token_id, read by `convert_checkpoint`, wins).
    special = read_special_tokens(ckpt.directory)
    omni = OmniConfig.from_hf(_thinker_config(hf_config), special) if model_type_for(hf_config) == "qwen2_5_omni" \
        else None
    im_end = omni.im_end_token_id if omni is not None else special.get("<|im_end|>", IM_END_TOKEN_ID)
    config = config.replace(eos_token_ids=(im_end,) if 0 <= im_end < config.vocab_size else ())
    names = ckpt.names()
    has_head = any(n.removeprefix(THINKER_PREFIX) == "lm_head.weight" for n in names)
    if not has_head and not config.tie_embeddings:
        raise MissingTensorError("checkpoint lacks tensor 'lm_head.weight' and the config does not tie embeddings")
    config = config.replace(tie_embeddings=not has_head)
    encoders = encoder_components(hf_config, dtype)
    components = [decoder_component(config)] + [component for component, _ in encoders.values()]
    speech = speech_configs(hf_config, config.hidden_size, dtype) if has_speech_output(hf_config) else None
    voices = voices_lib.read_release_voices(ckpt.directory) if speech is not None else None
    if speech is not None:
        for prefix in SPEECH_OUTPUT_PREFIXES:
            if not any(n.startswith(prefix) for n in names):
                raise MissingTensorError(f"the config enables audio output (enable_audio_output, the default) but "
                                         f"the checkpoint has no {prefix}* tensors; a release without speech output "
                                         "sets enable_audio_output false")
        components += [talker_component(speech[0]), *token2wav_components(speech[1])]
    skipped_speech = () if speech is not None else SPEECH_OUTPUT_PREFIXES
    trees, plan, source_dtypes = streaming.convert_components(
        ckpt, components, dtype=dtype, staging_dir=staging_dir, strip_prefix=THINKER_PREFIX,
        skip_prefixes=skipped_speech + _unused_tensors(), progress=progress)
    streaming.log_skipped(plan.skipped, skipped_speech, log)
    source_info = {
        "tensors_converted": len(plan.assign),
        "source_dtypes": dict(sorted(source_dtypes.items())),
        "skipped": plan.skipped,
        "encoders_converted": sorted(encoders),
        "speech_output": speech is not None,
        "lm_head": "tied to embed" if config.tie_embeddings else "lm_head.weight",
    }
    extras = {name: (encoder_config, trees[name]) for name, (_, encoder_config) in encoders.items()}
    if omni is not None:
        extras["omni"] = (omni.to_json(), None)
    if speech is not None and voices is not None:
        talker, token2wav = speech
        extras["talker"] = (talker.to_json(), trees["talker"])
        extras["token2wav"] = ({"dit": token2wav.dit.to_json(), "bigvgan": token2wav.bigvgan.to_json()},
                               {"dit": trees["dit"], "bigvgan": trees["bigvgan"]})
        extras["speech"] = voices_lib.voices_to_component(voices)
    return config, trees["decoder"], source_info, extras
