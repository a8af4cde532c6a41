"""Qwen3-Omni Talker (`talker.*` of the full release): config, parameters and conversion tables, in Flax NNX.

transformers 5.2.0's `Qwen3OmniMoeTalkerForConditionalGeneration` is four parts; the math is in `talker_forward`:

- `text_projection` / `hidden_projection` (`Qwen3OmniMoeTalkerResizeMLP`): `fc2(silu(fc1 x))` with biases, thinker
  width -> talker width. The text one reads the thinker's *embedding layer* (its `hidden_states[0]`) for every text
  token; the hidden one reads the thinker's layer `accept_hidden_layer` output (`hidden_states[k]`, before the final
  norm) at audio / image / video placeholders of user turns.
- the talker decoder: Qwen3-MoE attention (q/k RMSNorm, no biases, interleaved 3-axis mrope over the thinker-style
  positions of the talker's own input sequence) and, in *every* layer whatever `mlp_only_layers` /
  `decoder_sparse_step` say (the reference overwrites the layer's MLP), the routed experts (softmax, top-k,
  `norm_topk_prob`) plus a shared SwiGLU expert scaled by `sigmoid(x @ shared_expert_gate)`. It reads summed input
  embeddings and has no token embedding lookup of its own on the prompt; `codec_embedding [V, D]` embeds codec ids,
  `codec_head [D, V]` (untied) gives the logits of the frame's first codebook.
- the code predictor (MTP): a small dense Qwen3 decoder (q/k norm, 1-D RoPE) that, per frame, reads
  `[talker's final-normed hidden state of the previous position, embedding of codebook 0]` and predicts codebooks
  1 .. Q-1 one at a time, codebook g with its own head `lm_head[g - 1]` and fed back through its own embedding
  `codec_embedding[g - 1]`.

The parameters reuse the shared decoder's layout (`omnijax.models.decoder.DecoderLayers`: stacked `[L, ...]`, the MoE
stacks `router` / `expert_*`), plus what differs:

    codec_embedding [V, D]     final_norm [D]     codec_head [D, V]
    layers:  (DecoderLayers of `config.decoder`: every layer MoE)
    shared:  gate_proj [L, D, Is]  up_proj [L, D, Is]  down_proj [L, Is, D]  gate [L, D, 1]
    text_projection, hidden_projection:  fc1 [Dt, P]  fc1_bias [P]  fc2 [P, D]  fc2_bias [D]
    code_predictor:  layers (DecoderLayers of `config.predictor`, dense)  final_norm [Dp]
                     codec_embedding [Q-1, Vp, Dp]  lm_head [Q-1, Dp, Vp]

Conversion: `talker_components(config)` are the name tables of the release's `talker.` tensors (experts one tensor
per expert, as releases save them); the Qwen3-Omni converter writes them as the checkpoint's "talker" component.

Streaming design (what the engine needs next; `talker_forward` has the pieces):

- Thinker states the talker reads: per thinker token of a user turn, the embedding-layer row (text tokens) or the
  layer-`accept_hidden_layer` row (multimodal placeholders); of the answered assistant turn, only embedding-layer rows.
  The talker never reads the thinker's KV cache, so the thinker's retention may evict anything once these rows are
  projected: keep `text_projection(embed)` / `hidden_projection(layer k)` per token (talker width, D = 1,024 for the
  release) as the talker consumes them, never the KV. The answer's text enters one row per talker step: the
  prefix holds answer token 0, talker step i (frame i's first codebook is its input) adds answer token i + 1, and
  after the answer `tts_eos`, then `tts_pad` rows (the reference gives the talker every answer row but the last
  token's, usually `<|im_end|>`). So the talker can start once the thinker has its first text token, and to equal
  the reference a step must wait for its text row (padding early changes the speech): the talker runs behind the
  thinker, at most at the thinker's token rate while the text lasts (real time needs 12.5 frames a second). The
  reference also prefixes the user turns (system turns and earlier answers are skipped: `talker_prompt`). The
  layer-`accept_hidden_layer` rows come from the thinker's chunk step itself (`chunk_step(..., tap=k)`, a static
  option: `Decoder.run_layers_tapped`); `omnijax.Chat` keeps them at the placeholders of user turns' media units
  (`speech_media`, `omnijax.models.speech.MediaRows`).
- The talker's KV cache: one decoder over the paged substrate (`omnijax.kv.paged`, mrope positions `[3, B, T]`), one
  token per 80 ms frame plus the prompt (the user turns it reads, and 9 assistant-prefix tokens); bounded by the same
  policies as the thinker's. Decoding positions continue from the prompt's largest position + 1.
- The code predictor's per-frame loop is one compiled step (`talker_forward.predict_codes`): a 2-token prefill and
  Q - 2 one-token steps in a `lax.fori_loop` over a dense KV buffer of Q slots that lives only for the frame (no paging:
  it is reset every frame); then the talker's next input is the sum of the Q codebook embeddings plus the text row,
  so predictor + talker step fuse into one jitted `talker_step` per frame.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from flax import nnx

from omnijax._checks import JsonConfig, check_config_fields
from omnijax.checkpoint.name_tables import Component, Rule
from omnijax.errors import UnsupportedConfigError
from omnijax.models.config import DecoderConfig, default_head_dim
from omnijax.models.decoder import DecoderLayers
from omnijax.models.encoders.common import (
    HF_PRETRAINED_CONFIG_ATTRIBUTES,
    ConfigAttributeError,
    linear_rules,
    module_from_pure_dict,
)
from omnijax.models.layers import new_param

__all__ = ["PREDICTOR_PREFIX", "TALKER_PREFIX", "CodePredictor", "Talker", "TalkerConfig", "TalkerConfigError",
           "talker_components", "talker_from_params"]

TALKER_PREFIX = "talker."
PREDICTOR_PREFIX = "talker.code_predictor."


class TalkerConfigError(ConfigAttributeError):
    """Inconsistent talker settings. Attributes: `attribute`, `value`."""

    subject = "Qwen3-Omni talker config"


# Attributes with no effect on the forward (training-only, bookkeeping), per sub-config. The talker decoder's
# attention never uses a sliding window (the reference sets none), so `sliding_window` is inert there; the release's
# talker config also carries `audio_end_token_id` and `seconds_per_chunk`, which transformers never reads.
_COMMON_INERT = HF_PRETRAINED_CONFIG_ATTRIBUTES | frozenset("""
    max_position_embeddings initializer_range use_cache attention_dropout output_router_logits router_aux_loss_coef
    use_sliding_window sliding_window max_window_layers audio_end_token_id seconds_per_chunk
""".split())
_TEXT_READ = frozenset("""
    vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim
    hidden_act rms_norm_eps attention_bias rope_parameters rope_scaling rope_theta decoder_sparse_step
    moe_intermediate_size num_experts_per_tok num_experts num_local_experts norm_topk_prob mlp_only_layers
    shared_expert_intermediate_size layer_types
""".split())
_PREDICTOR_READ = frozenset("""
    vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim
    hidden_act rms_norm_eps attention_bias rope_parameters rope_scaling rope_theta layer_types num_code_groups
""".split())
_TALKER_READ = frozenset("""
    code_predictor_config text_config num_code_groups thinker_hidden_size accept_hidden_layer codec_eos_token_id
    codec_nothink_id codec_think_bos_id codec_think_eos_id codec_pad_id codec_bos_id audio_token_id image_token_id
    video_token_id vision_start_token_id audio_start_token_id position_id_per_seconds speaker_id spatial_merge_size
""".split())
# transformers' defaults (`Qwen3OmniMoeTalkerConfig`) of the talker-level ids.
_TALKER_DEFAULTS = dict(codec_eos_token_id=4198, codec_nothink_id=4203, codec_think_bos_id=4204,
                        codec_think_eos_id=4205, codec_pad_id=4196, codec_bos_id=4197, accept_hidden_layer=18,
                        thinker_hidden_size=2048, num_code_groups=32, audio_token_id=151646, image_token_id=151655,
                        video_token_id=151656, vision_start_token_id=151652, audio_start_token_id=151669,
                        position_id_per_seconds=25, spatial_merge_size=2)


@dataclasses.dataclass(frozen=True)
class TalkerConfig(JsonConfig):
    """Static hyperparameters of the Qwen3-Omni talker (`from_hf` reads transformers' `Qwen3OmniMoeTalkerConfig`).

    Attributes:
        decoder: the talker decoder (codec vocabulary; every layer MoE; interleaved mrope; q/k norm).
        shared_expert_intermediate_size: width Is of each layer's shared SwiGLU expert.
        predictor: the code predictor's dense decoder (1-D RoPE, q/k norm); `vocab_size` is one codebook's size.
        num_code_groups: codebooks Q per frame (the talker predicts the first, the predictor the other Q - 1).
        thinker_hidden_size: width Dt of the thinker states the projections read.
        projection_size: width P of the two ResizeMLPs (the talker text config's `intermediate_size`).
        accept_hidden_layer: the thinker `hidden_states` index the hidden projection reads (layer k's output).
        codec_*: special codec ids of the assistant prefix and the end of speech.
        speakers: (name, codec id) pairs as the config's `speaker_id` spells them (looked up lower-cased, as the
            reference does, so only lower-case names are reachable).
        audio_token_id, image_token_id, video_token_id, vision_start_token_id, audio_start_token_id,
        position_id_per_seconds, spatial_merge_size: what positions the talker's input sequence gets (as the
            thinker's `get_rope_index` computes them over that sequence).
        dtype: compute and parameter dtype name.
    """

    decoder: DecoderConfig
    shared_expert_intermediate_size: int
    predictor: DecoderConfig
    num_code_groups: int
    thinker_hidden_size: int
    projection_size: int
    accept_hidden_layer: int = 18
    codec_eos_token_id: int = 4198
    codec_nothink_id: int = 4203
    codec_think_bos_id: int = 4204
    codec_think_eos_id: int = 4205
    codec_pad_id: int = 4196
    codec_bos_id: int = 4197
    speakers: tuple[tuple[str, int], ...] = ()
    audio_token_id: int = 151646
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    audio_start_token_id: int = 151669
    position_id_per_seconds: int = 25
    spatial_merge_size: int = 2
    dtype: str = "float32"

    def __post_init__(self):
        check_config_fields(self, TalkerConfigError,
                            positive=("shared_expert_intermediate_size", "thinker_hidden_size", "projection_size"))
        if isinstance(self.num_code_groups, bool) or not isinstance(self.num_code_groups, int) or \
                self.num_code_groups < 2:
            raise TalkerConfigError("num_code_groups", self.num_code_groups, "must be an integer >= 2")
        if not all(self.decoder.sparse_layers) or self.decoder.num_experts < 1:
            raise TalkerConfigError("text_config.num_experts", self.decoder.num_experts,
                                    "the talker's layers are all MoE: needs experts in every layer")
        if self.predictor.num_experts:
            raise TalkerConfigError("code_predictor_config.num_experts", self.predictor.num_experts,
                                    "the code predictor is dense")
        if self.predictor.hidden_size != self.decoder.hidden_size:
            raise TalkerConfigError("code_predictor_config.hidden_size", self.predictor.hidden_size,
                                    f"must equal the talker's hidden_size={self.decoder.hidden_size} (the predictor "
                                    "reads the talker's hidden state)")
        if self.decoder.mrope_section is None or self.predictor.mrope_section is not None:
            raise TalkerConfigError("decoder.mrope_section", self.decoder.mrope_section,
                                    "the talker uses 3-axis mrope and the code predictor 1-D RoPE")
        for name, value in self.speakers:
            if not isinstance(name, str) or not 0 <= value < self.decoder.vocab_size:
                raise TalkerConfigError(f"speaker_id.{name}", value,
                                        f"must be a codec id in [0, {self.decoder.vocab_size})")

    def to_json(self) -> dict[str, Any]:
        data = super().to_json()
        data.update(decoder=self.decoder.to_json(), predictor=self.predictor.to_json(),
                    speakers=[list(pair) for pair in self.speakers])
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TalkerConfig":
        data = dict(data)
        nested = {"decoder": DecoderConfig.from_json(data.pop("decoder")),
                  "predictor": DecoderConfig.from_json(data.pop("predictor")),
                  "speakers": tuple((str(n), int(i)) for n, i in data.pop("speakers", ()))}
        return dataclasses.replace(super().from_json(data | {"decoder": nested["decoder"],
                                                             "predictor": nested["predictor"]}), **nested)

    def speaker(self, name: str) -> int:
        """The codec id of speaker `name`, looked up lower-cased as the reference does.

        Raises:
            KeyError: naming the speaker and the ones the checkpoint has.
        """
        found = dict(self.speakers).get(name.lower())
        if found is None:
            raise KeyError(f"speaker {name!r} is not one of this talker's: {sorted(dict(self.speakers))}")
        return found

    @classmethod
    def from_hf(cls, talker_config: Mapping[str, Any] | Any, dtype: str = "float32") -> "TalkerConfig":
        """Reads a Hugging Face `Qwen3OmniMoeTalkerConfig` (a dict or an object with `to_dict`).

        Raises:
            UnsupportedConfigError: an attribute this module does not implement or understand.
            TalkerConfigError / ConfigValueError: inconsistent values.
        """
        data = dict(talker_config.to_dict() if hasattr(talker_config, "to_dict") else talker_config)
        _refuse_unknown(data, _TALKER_READ, "talker_config.")
        text = _sub(data, "text_config")
        pred = _sub(data, "code_predictor_config")
        _refuse_unknown(text, _TEXT_READ, "talker_config.text_config.")
        _refuse_unknown(pred, _PREDICTOR_READ, "talker_config.code_predictor_config.")
        values = {k: data.get(k, v) if data.get(k) is not None else v for k, v in _TALKER_DEFAULTS.items()}
        groups = values.pop("num_code_groups")
        if pred.get("num_code_groups", 32) != groups:
            raise TalkerConfigError("code_predictor_config.num_code_groups", pred.get("num_code_groups", 32),
                                    f"must equal the talker's num_code_groups={groups}")
        experts = text.get("num_experts", text.get("num_local_experts", 128))
        decoder = _decoder(text, "text_config", dtype, mrope=True, num_experts=experts,
                           num_experts_per_tok=text.get("num_experts_per_tok", 8),
                           moe_intermediate_size=text.get("moe_intermediate_size", 768),
                           norm_topk_prob=bool(text.get("norm_topk_prob", False)))
        predictor = _decoder(pred, "code_predictor_config", dtype, mrope=False)
        speakers = tuple(sorted((str(k), int(v)) for k, v in (data.get("speaker_id") or {}).items()))
        if "shared_expert_intermediate_size" not in text:
            raise TalkerConfigError("text_config.shared_expert_intermediate_size", None,
                                    "is required (the reference's shared expert reads it)")
        return cls(decoder=decoder, shared_expert_intermediate_size=text["shared_expert_intermediate_size"],
                   predictor=predictor, num_code_groups=groups, projection_size=text.get("intermediate_size", 2048),
                   speakers=speakers, dtype=dtype, **values)


def _sub(data: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key) or {}
    if not isinstance(value, Mapping):
        raise UnsupportedConfigError(f"talker_config.{key}", value, "must be an object")
    return dict(value.to_dict() if hasattr(value, "to_dict") else value)


def _refuse_unknown(data: Mapping[str, Any], read: frozenset[str], where: str) -> None:
    unknown = sorted(k for k in data if k not in read and k not in _COMMON_INERT)
    if unknown:
        raise UnsupportedConfigError(f"{where}{unknown[0]}", data[unknown[0]],
                                     f"not understood by the omnijax talker (refusing to guess its effect); "
                                     f"unknown attributes: {unknown}")


def _decoder(text: Mapping[str, Any], scope: str, dtype: str, *, mrope: bool, **moe: Any) -> DecoderConfig:
    """The `DecoderConfig` of the talker decoder (`mrope`) or the code predictor, refusing what they lack."""
    where = f"talker_config.{scope}."
    act = text.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedConfigError(where + "hidden_act", act, "only the SiLU-gated MLP is implemented")
    if text.get("attention_bias"):
        raise UnsupportedConfigError(where + "attention_bias", text["attention_bias"], "not implemented")
    if text.get("tie_word_embeddings"):
        raise UnsupportedConfigError(where + "tie_word_embeddings", True, "the talker's heads are separate tensors")
    for i, kind in enumerate(text.get("layer_types") or ()):
        if kind != "full_attention":
            raise UnsupportedConfigError(f"{where}layer_types[{i}]", kind, "only full attention is implemented")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise UnsupportedConfigError(where + "rope_parameters", rope, "must be an object")
    allowed = {"rope_type", "type", "rope_theta"} | ({"mrope_section", "interleaved", "mrope_interleaved"}
                                                     if mrope else set())
    extra = sorted(set(rope) - allowed)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if extra or kind != "default":
        raise UnsupportedConfigError(where + "rope_parameters", dict(rope),
                                     f"only default RoPE ({sorted(allowed)}) is implemented")
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    # The talker's rotary table interleaves the three axes whatever `interleaved` says (default section 24/20/20).
    section = tuple(rope.get("mrope_section", (24, 20, 20))) if mrope else None
    hidden, heads = text.get("hidden_size", 1024), text.get("num_attention_heads", 16)
    head_dim = text.get("head_dim") or default_head_dim(hidden, heads)
    return DecoderConfig(
        vocab_size=text.get("vocab_size", 3072 if mrope else 2048), hidden_size=hidden,
        intermediate_size=0 if mrope else text.get("intermediate_size", 3072),
        num_layers=text.get("num_hidden_layers", 20 if mrope else 5), num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads", 2 if mrope else 8), head_dim=head_dim, rope_theta=theta,
        mrope_section=section, mrope_interleaved=mrope, rms_norm_eps=text.get("rms_norm_eps", 1e-6), qkv_bias=False,
        qk_norm=True, tie_embeddings=False, dtype=dtype, **moe)


# ------------------------------------------------------------------------------------------------------- module


class _Node(nnx.Module):
    """A named group of parameters."""

    def __init__(self, **params: nnx.Param | nnx.Module):
        for name, value in params.items():
            setattr(self, name, value)


def _resize_mlp(rngs: nnx.Rngs, dt, d_in: int, width: int, d_out: int) -> _Node:
    return _Node(fc1=new_param((d_in, width), dt, rngs), fc1_bias=new_param((width,), dt, rngs, zeros=True),
                 fc2=new_param((width, d_out), dt, rngs), fc2_bias=new_param((d_out,), dt, rngs, zeros=True))


class CodePredictor(nnx.Module):
    """The code predictor's parameters (module docstring)."""

    def __init__(self, config: DecoderConfig, num_code_groups: int, *, rngs: nnx.Rngs):
        c, dt, G = config, config.jnp_dtype, num_code_groups - 1
        self.layers = DecoderLayers(c, rngs=rngs)
        self.final_norm = new_param((c.hidden_size,), dt, rngs, ones=True)
        self.codec_embedding = new_param((G, c.vocab_size, c.hidden_size), dt, rngs)
        self.lm_head = new_param((G, c.hidden_size, c.vocab_size), dt, rngs)


class Talker(nnx.Module):
    """Qwen3-Omni talker parameters (module docstring); the math is in `talker_forward`."""

    def __init__(self, config: TalkerConfig, *, rngs: nnx.Rngs | None = None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        c, dt = config.decoder, config.jnp_dtype
        L, D, Is = c.num_layers, c.hidden_size, config.shared_expert_intermediate_size
        self.config = config
        self.codec_embedding = new_param((c.vocab_size, D), dt, rngs)
        self.layers = DecoderLayers(c, rngs=rngs)
        self.shared = _Node(gate_proj=new_param((L, D, Is), dt, rngs), up_proj=new_param((L, D, Is), dt, rngs),
                            down_proj=new_param((L, Is, D), dt, rngs), gate=new_param((L, D, 1), dt, rngs))
        self.final_norm = new_param((D,), dt, rngs, ones=True)
        self.codec_head = new_param((D, c.vocab_size), dt, rngs)
        self.text_projection = _resize_mlp(rngs, dt, config.thinker_hidden_size, config.projection_size, D)
        self.hidden_projection = _resize_mlp(rngs, dt, config.thinker_hidden_size, config.projection_size, D)
        self.code_predictor = CodePredictor(config.predictor, config.num_code_groups, rngs=rngs)


def talker_from_params(config: TalkerConfig, params: Mapping[str, Any]) -> Talker:
    """A `Talker` holding a pure-dict tree: the "talker" tree of `talker_components` with the "code_predictor" tree
    under key `code_predictor` (`{**trees["talker"], "code_predictor": trees["code_predictor"]}`)."""
    return module_from_pure_dict(lambda: Talker(config, rngs=nnx.Rngs(0)), params, config.jnp_dtype,
                                 what="talker parameter", missing_error=KeyError)


# ---------------------------------------------------------------------------------------------------- name tables

_L = "model.layers.{i}."


def _attention_rules() -> list[Rule]:
    return [Rule(_L + "input_layernorm.weight", "layers/input_norm", "D"),
            Rule(_L + "post_attention_layernorm.weight", "layers/post_norm", "D"),
            *linear_rules(_L + "self_attn.q_proj", "layers/q_proj", None, "D Q"),
            *linear_rules(_L + "self_attn.k_proj", "layers/k_proj", None, "D K"),
            *linear_rules(_L + "self_attn.v_proj", "layers/v_proj", None, "D K"),
            *linear_rules(_L + "self_attn.o_proj", "layers/o_proj", None, "Q D"),
            Rule(_L + "self_attn.q_norm.weight", "layers/q_norm", "d"),
            Rule(_L + "self_attn.k_norm.weight", "layers/k_norm", "d"),
            Rule("model.norm.weight", "final_norm", "D")]


def _dims(c: DecoderConfig) -> dict[str, int]:
    return {"V": c.vocab_size, "D": c.hidden_size, "Q": c.num_heads * c.head_dim, "K": c.num_kv_heads * c.head_dim,
            "d": c.head_dim, "I": c.intermediate_size, "E": c.num_experts, "Ie": c.moe_intermediate_size, "one": 1}


def talker_components(config: TalkerConfig) -> tuple[Component, Component]:
    """The conversion tables of the talker (Hugging Face prefix `talker.`, tree "talker") and its code predictor
    (`talker.code_predictor.`, tree "code_predictor"; its Q - 1 embeddings and heads fill the tables' per-expert
    axis). Linear weights are transposed to `[in, out]`; the experts are one tensor per expert, as releases save them.
    The Qwen3-Omni converter writes them as the checkpoint's "talker" component."""
    c, p = config.decoder, config.predictor
    talker_rules = [
        Rule("model.codec_embedding.weight", "codec_embedding", "V D"),
        *_attention_rules(),
        *linear_rules(_L + "mlp.gate", "layers/router", None, "D E"),
        *(Rule(_L + f"mlp.experts.{{e}}.{name}_proj.weight", f"layers/expert_{name}", dims, "T")
          for name, dims in (("gate", "D Ie"), ("up", "D Ie"), ("down", "Ie D"))),
        *(Rule(_L + f"mlp.shared_expert.{name}_proj.weight", f"shared/{name}_proj", dims, "T")
          for name, dims in (("gate", "D Is"), ("up", "D Is"), ("down", "Is D"))),
        *linear_rules(_L + "mlp.shared_expert_gate", "shared/gate", None, "D one"),
        *linear_rules("codec_head", "codec_head", None, "D V"),
        *(rule for name in ("text_projection", "hidden_projection") for rule in (
            *linear_rules(f"{name}.linear_fc1", f"{name}/fc1", f"{name}/fc1_bias", "Dt P"),
            *linear_rules(f"{name}.linear_fc2", f"{name}/fc2", f"{name}/fc2_bias", "P D"))),
    ]
    talker = Component(name="talker", prefix=TALKER_PREFIX, rules=tuple(talker_rules),
                       dims={**_dims(c), "Is": config.shared_expert_intermediate_size,
                             "Dt": config.thinker_hidden_size, "P": config.projection_size},
                       num_layers=c.num_layers, num_experts=c.num_experts)
    predictor_rules = [
        *_attention_rules(),
        *(rule for name, dims in (("gate", "D I"), ("up", "D I"), ("down", "I D"))
          for rule in linear_rules(_L + f"mlp.{name}_proj", f"layers/{name}_proj", None, dims)),
        Rule("model.codec_embedding.{e}.weight", "codec_embedding", "V D"),
        Rule("lm_head.{e}.weight", "lm_head", "D V", "T"),
    ]
    predictor = Component(name="code_predictor", prefix=PREDICTOR_PREFIX, rules=tuple(predictor_rules),
                          dims=_dims(p), num_layers=p.num_layers, num_experts=config.num_code_groups - 1)
    return talker, predictor
