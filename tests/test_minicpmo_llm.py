"""MiniCPM-o 4.5's LLM (the foundation decoder in Qwen3 mode) against the official code's golden case 1."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from convert import minicpmo
from convert.tables import convert_in_memory
from omnijax.models.decoder import Decoder
from omnijax.stream import stream
from omnijax.chunks import text_chunk, stack_chunks

GOLDEN = Path(__file__).resolve().parents[2] / "shared" / "golden" / "minicpmo45"
pytestmark = pytest.mark.skipif(not GOLDEN.is_dir(), reason="golden vectors not present")


@pytest.fixture(scope="module")
def llm():
    hf = json.loads((GOLDEN / "checkpoint" / "config.json").read_text())
    config = minicpmo.config_from_hf(hf)
    tensors = {k: v for k, v in load_file(GOLDEN / "checkpoint" / "model.safetensors").items()
               if k.startswith("llm.")}
    params = convert_in_memory(tensors, [minicpmo.decoder_component(config)], strip_prefix="")["decoder"]
    model = Decoder(config)
    graphdef, state = nnx.split(model)
    nnx.replace_by_pure_dict(state, jax_tree(params))
    return nnx.merge(graphdef, state)


def jax_tree(tree):
    return {k: jax_tree(v) if isinstance(v, dict) else jnp.asarray(v) for k, v in tree.items()}


def test_config_is_qwen3_mode():
    hf = json.loads((GOLDEN / "checkpoint" / "config.json").read_text())
    c = minicpmo.config_from_hf(hf)
    assert c.qk_norm and not c.qkv_bias and c.mrope_section is None and c.num_layers == 2 and c.head_dim == 32
    assert c.eos_token_ids == (1922,) and not c.tie_embeddings


def test_case1_text_logits(llm):
    case = np.load(GOLDEN / "case1_text.npz")
    ids = case["input_ids"]
    result = stream(llm, stack_chunks([text_chunk(ids[0], unit=0, answer_tokens=0)]), page_size=16)
    # Last-position logits through the streaming path; all positions through a one-chunk prefill below.
    np.testing.assert_allclose(np.asarray(result.logits[0, 0]), case["logits"][0, -1], atol=1e-4, rtol=0)
    from omnijax.prefill import token_major_prefill
    x = llm.embed_tokens(jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(x), case["inputs_embeds"], atol=0)
    full = token_major_prefill(llm, x, jnp.asarray(case["position_ids"])[None], page=16)
    np.testing.assert_allclose(np.asarray(llm.logits(full.hidden)), case["logits"], atol=1e-4, rtol=0)
