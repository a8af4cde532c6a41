"""Building blocks of the Qwen2.5-Omni encoders that MiniCPM-o's encoders reuse (same numerics, same conventions).

- `dense` and `layer_norm`: float32-accumulating Linear and LayerNorm, cast back to the compute dtype.
- `StackedLayers`: base of the modules holding every layer's parameters along a leading `layers` axis.
- `module_from_pure_dict`: an encoder module holding a pure-dict parameter tree, checked leaf by leaf.
- `linear_rules` and `norm_rules`: conversion rules of a torch `Linear` / `LayerNorm`.
- `ConfigAttributeError`, `understood_attributes` and `HF_PRETRAINED_CONFIG_ATTRIBUTES`: what the `from_hf` readers
  of the encoder configs share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from omnijax.checkpoint.name_tables import Rule
from omnijax.errors import ConfigError
from omnijax.models.layers import abstract_module

__all__ = ["ConfigAttributeError", "HF_PRETRAINED_CONFIG_ATTRIBUTES", "StackedLayers", "dense", "layer_norm",
           "linear_rules", "module_from_pure_dict", "norm_rules", "understood_attributes"]

TORCH_LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default epsilon

# Attributes every Hugging Face `PretrainedConfig` may carry; none changes an encoder's math.
HF_PRETRAINED_CONFIG_ATTRIBUTES = frozenset("""
    model_type transformers_version architectures _name_or_path dtype torch_dtype initializer_range init_std
    return_dict output_hidden_states output_attentions torchscript use_bfloat16 tf_legacy_loss
    chunk_size_feed_forward is_encoder_decoder is_decoder add_cross_attention cross_attention_hidden_size
    tie_encoder_decoder tie_word_embeddings pruned_heads id2label label2id num_labels problem_type finetuning_task
    tokenizer_class prefix task_specific_params bos_token_id eos_token_id pad_token_id sep_token_id
    decoder_start_token_id _attn_implementation _attn_implementation_autoset
""".split())
# Generation settings a Hugging Face config may carry (`PretrainedConfig`'s legacy generation attributes): an
# encoder never generates, so they change nothing it computes.
HF_GENERATION_CONFIG_ATTRIBUTES = frozenset("""
    max_length min_length do_sample early_stopping num_beams num_beam_groups diversity_penalty temperature top_k
    top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size
    bad_words_ids num_return_sequences output_scores return_dict_in_generate forced_bos_token_id
    forced_eos_token_id remove_invalid_values exponential_decay_length_penalty suppress_tokens begin_suppress_tokens
""".split())


class ConfigAttributeError(ConfigError, ValueError):
    """Inconsistent encoder settings. Attributes: `attribute`, `value`.

    Subclasses name the config in `subject`, which starts the message.
    """

    subject = "config"

    def __init__(self, attribute: str, value: object, reason: str):
        self.attribute, self.value = attribute, value
        super().__init__(f"{self.subject} {attribute}={value!r}: {reason}")


def understood_attributes(hf_config: Mapping[str, Any], defaults: Mapping[str, Any], harmless: frozenset[str], *,
                          error: type[Exception], where: str, encoder: str) -> dict[str, Any]:
    """`defaults` updated with the values a Hugging Face sub-config sets, after refusing attributes it does not know.

    Args:
        hf_config: the Hugging Face sub-config as a mapping (e.g. `vision_config`).
        defaults: the math-bearing attributes and the values they take when absent.
        harmless: attributes with no effect on the math (ignored).
        error: raised as `error(attribute, value, reason)` for the first attribute in neither set.
        where: prefix of the attribute named in the error (e.g. "vision_config.").
        encoder: what refuses it, in the message (e.g. "vision encoder").

    Returns:
        a new dict with the keys of `defaults`.
    """
    unknown = sorted(k for k in hf_config if k not in defaults and k not in harmless)
    if unknown:
        raise error(f"{where}{unknown[0]}", hf_config[unknown[0]], f"not understood by the omnijax {encoder} "
                    f"(refusing to guess its effect); unknown attributes: {unknown}")
    return {**defaults, **{k: x for k, x in hf_config.items() if k in defaults}}


# ------------------------------------------------------------------------------------------------------- numerics


def dense(x: jnp.ndarray, w: jnp.ndarray, b: jnp.ndarray | None, dtype: DTypeLike) -> jnp.ndarray:
    """`x @ w (+ b)` accumulated in float32, returned in `dtype`: `[..., I] @ [I, O] -> [..., O]`."""
    out = jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32)
    if b is not None:
        out = out + b.astype(jnp.float32)
    return out.astype(dtype)


def layer_norm(x: jnp.ndarray, scale: jnp.ndarray, bias: jnp.ndarray,
               eps: float = TORCH_LAYER_NORM_EPS) -> jnp.ndarray:
    """LayerNorm over the last axis with float32 statistics; the result is cast back to `x.dtype`."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    normed = (xf - mean) * jax.lax.rsqrt(var + eps)
    return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class StackedLayers(nnx.Module):
    """Base of the modules holding all layers' parameters, stacked along a leading `layers` axis."""

    def stacked(self) -> dict[str, jnp.ndarray]:
        """The stacked parameter arrays as a plain dict, what a `lax.scan` over the layers runs on."""
        return {name: value[...] for name, value in vars(self).items() if isinstance(value, nnx.Param)}


# ------------------------------------------------------------------------------------------------------- loading


def module_from_pure_dict(build: Callable[[], nnx.Module], params: Mapping[str, Any], dtype: DTypeLike, *, what: str,
                          missing_error: type[Exception] = ValueError,
                          missing_message: str = "{what} {name} is missing") -> nnx.Module:
    """The module `build()` makes, holding `params` (a pure-dict tree shaped like `nnx.to_pure_dict` of it).

    `build` runs abstractly (`abstract_module`), so no initial values are drawn. Leaves are cast to `dtype`.

    Args:
        build: makes the module (e.g. `lambda: AudioEncoder(config, rngs=nnx.Rngs(0))`).
        params: the parameter tree.
        dtype: the parameters' dtype.
        what: the noun for one parameter in messages (e.g. "audio parameter").
        missing_error: the exception raised for a missing leaf.
        missing_message: its message, formatted with `what` and the leaf's `/`-separated path `name`.

    Raises:
        missing_error: a leaf of the module is missing from `params` (named by its `/`-separated path).
        ValueError: a leaf has another shape than the module's.
    """
    graphdef, state = nnx.split(abstract_module(build))

    def fetch(path, expected):
        keys = [getattr(k, "key", k) for k in path]
        name = "/".join(str(k) for k in keys)
        node = params
        for key in keys:
            if not isinstance(node, Mapping) or key not in node:
                raise missing_error(missing_message.format(what=what, name=name))
            node = node[key]
        if tuple(np.shape(node)) != tuple(expected.shape):
            raise ValueError(f"{what} {name} has shape {tuple(np.shape(node))}, expected {tuple(expected.shape)}")
        return jnp.asarray(node, dtype)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(fetch, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------------- name table


def linear_rules(hf_name: str, weight_path: str, bias_path: str | None, dims: str) -> tuple[Rule, ...]:
    """Rules of a torch `Linear` named `hf_name`: its weight, transposed to `[in, out]` (`dims` "in out" in the
    component's symbols), at `weight_path`, and its bias `[out]` at `bias_path` (None: no bias)."""
    weight = Rule(f"{hf_name}.weight", weight_path, dims, "T")
    if bias_path is None:
        return (weight,)
    return weight, Rule(f"{hf_name}.bias", bias_path, dims.split()[-1])


def norm_rules(hf_name: str, path_prefix: str, dim: str = "D") -> tuple[Rule, Rule]:
    """Rules of a torch `LayerNorm` named `hf_name`: weight -> `{path_prefix}_scale`, bias -> `{path_prefix}_bias`."""
    return Rule(f"{hf_name}.weight", f"{path_prefix}_scale", dim), Rule(f"{hf_name}.bias", f"{path_prefix}_bias", dim)
