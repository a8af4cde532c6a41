"""MiniCPM-o 4.5's LLM (the foundation decoder in Qwen3 mode) against the official code's golden case 1."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from omnijax.checkpoint.name_tables import convert_in_memory
from omnijax.chunks.chunk import stack_chunks, text_chunk
from omnijax.models.decoder import Decoder
from omnijax.models.minicpmo import convert as minicpmo
from omnijax.streaming.session import stream
from tests._support import DATA

GOLDEN = DATA / "minicpmo45"


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


def test_case4_duplex_stream_and_greedy_decisions(llm):
    """The duplex session fed as the release fed it (one chunk per recorded `feed` call, embedding rows included)
    through the step-wise session: incremental logits and every greedy decision match; the one-shot forward over
    everything fed matches the reference's one-shot logits."""
    import omnijax
    from omnijax.chunks.chunk import Chunk, pad_chunk
    from omnijax.models.minicpmo.duplex import DuplexDecodeRule
    case = np.load(GOLDEN / "case4_duplex.npz")
    meta = json.loads((GOLDEN / "case4_duplex.json").read_text())["meta"]
    ids, embeds = case["input_ids"][0], case["inputs_embeds"][0]
    width = int(case["feed_table"][:, 1].max())
    session = omnijax.Session(llm, num_pages=16, page_size=16)
    got, chunks = {}, []
    for start, length, kind, returns in case["feed_table"]:
        is_token = ids[start:start + length] >= 0
        chunk = Chunk(token_ids=np.where(is_token, ids[start:start + length], 0)[None],
                      valid=np.ones((1, length), bool), positions=np.arange(length)[None, None],
                      unit=np.zeros((1, length), np.int32), span=np.zeros((1, length), np.int8),
                      offset=np.zeros((1, length), np.int32), answer_tokens=np.zeros((1,), np.int32),
                      answer_unit=np.zeros((1,), np.int32), advance=np.full((1,), length, np.int32),
                      embeds=embeds[start:start + length][None], embed_mask=~is_token[None])
        chunks.append(pad_chunk(chunk, width))
        out = session.feed(chunks[-1])
        if returns:
            got[int(start + length - 1)] = np.asarray(out.logits[0])
    # The same feeds as one compiled scan: each feed's last-position logits equal the one-shot logits there.
    scanned = omnijax.stream(llm, omnijax.stack_chunks(chunks), page_size=16, num_pages=16)
    ends = case["feed_table"][:, 0] + case["feed_table"][:, 1] - 1
    np.testing.assert_allclose(np.asarray(scanned.logits[:, 0]), case["logits"][0, ends], atol=1e-4, rtol=0)
    positions = case["incremental_logits_positions"]
    np.testing.assert_allclose(np.stack([got[int(p)] for p in positions]), case["incremental_logits"], atol=1e-4,
                               rtol=0)
    special = json.loads((GOLDEN / "info.json").read_text())["special_token_ids_tiny"]
    rule = DuplexDecodeRule(chunk_eos=special["<|chunk_eos|>"], turn_eos=special["<|turn_eos|>"],
                            listen=special["<|listen|>"], tts_bos=special["<|tts_bos|>"],
                            forbidden=tuple(meta["decoder_forbidden_token_ids"]))
    # Decisions: the logits at position p chose the token fed at p + 1, for the text tokens of speaking units.
    history = []
    for p in positions:
        fed = int(ids[p + 1])
        if fed not in meta["decoder_generated_tokens_history"]:
            continue
        assert rule.choose(got[int(p)], history) == fed
        history.append(fed)
    assert history == meta["decoder_generated_tokens_history"]
    from omnijax.prefill import token_major_prefill
    full = token_major_prefill(llm, jnp.asarray(embeds)[None], jnp.asarray(case["position_ids"])[None], page=16)
    np.testing.assert_allclose(np.asarray(llm.logits(full.hidden)), case["logits"], atol=1e-4, rtol=0)
