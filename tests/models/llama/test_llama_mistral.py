"""Llama-3.x (with llama3 RoPE scaling) and Mistral (no sliding window) decoders converted from their Hugging Face
layout (single-file and sharded safetensors) and checked against transformers: padded-batch logits, streamed chunks,
greedy answers, TideKV prefill, the scaled inverse frequencies, key re-rotation, and config refusals."""

import json
import math

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")

import omnijax  # noqa: E402
from omnijax.chunks.chunk import split_text  # noqa: E402
from omnijax.convert import convert_checkpoint  # noqa: E402
from omnijax.convert.__main__ import main as convert_main  # noqa: E402
from omnijax.errors import ConfigError, UnsupportedConfigError  # noqa: E402
from omnijax.kv import paged  # noqa: E402
from omnijax.kv import rope as rope_lib  # noqa: E402
from omnijax.models.llama.convert import config_from_hf  # noqa: E402
from omnijax.retention import base  # noqa: E402
from tests._support import kv_ops  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*has no tokenizer files:UserWarning")

VOCAB, SEQ, CHUNKS, ANSWER = 300, 96, 4, 4
# head_dim 32 (given, != hidden / heads): with theta 5e5 and original length 32 the 16 frequencies fall in all three
# llama3 bands (kept, smoothed, divided by the factor); 96 tokens run three times past the original length.
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5)


def _build(family: str, seed: int):
    import transformers

    torch.manual_seed(seed)
    if family == "llama":
        config = transformers.LlamaConfig(head_dim=32, rope_parameters=dict(LLAMA3), tie_word_embeddings=False,
                                          **COMMON)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.MistralConfig(sliding_window=None, tie_word_embeddings=True,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **COMMON)
        model = transformers.MistralForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # larger weights: sharper attention, so mistakes show
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


_BUILT: dict = {}


def _converted(name: str, tmp_path_factory):
    """`(name, hf model, omnijax model, hf dir)`, built once per module: Llama saved as one file and converted by
    `convert_checkpoint`, Mistral (tied embeddings) sharded and converted by the command line's `main`."""
    if name not in _BUILT:
        hf = _build(name, seed=5)
        root = tmp_path_factory.mktemp(name)
        if name == "llama":
            hf.save_pretrained(root / "hf", safe_serialization=True)
            out = convert_checkpoint(root / "hf", root / "out", progress=False)
        else:
            hf.save_pretrained(root / "hf", safe_serialization=True, max_shard_size="40KB")
            assert len(list((root / "hf").glob("*.safetensors"))) > 2
            assert convert_main([str(root / "hf"), str(root / "out"), "--no-progress"]) == 0
            out = root / "out"
        _BUILT[name] = (name, hf, omnijax.load(out), root / "hf")
    return _BUILT[name]


@pytest.fixture(scope="module", params=["llama", "mistral"])
def family(request, tmp_path_factory):
    return _converted(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    yield _converted("llama", tmp_path_factory)
    _BUILT.clear()  # module teardown: the converted models go with the module


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(2).integers(3, VOCAB, (2, SEQ))


@pytest.fixture(scope="module")
def one_shot(family, ids):
    """`(ours, transformers')` logits `[2, SEQ, V]` of a batch whose second row is left-padded."""
    _, hf, model, _ = family
    mask = np.ones_like(ids)
    mask[1, :7] = 0
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)  # what generate passes for a left-padded row
    with torch.no_grad():
        want = hf(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                  position_ids=torch.as_tensor(positions)).logits.numpy()
    got = np.asarray(model(input_ids=ids, attention_mask=mask))
    return got, want, mask.astype(bool)


def test_config_maps(family):
    name, hf, model, _ = family
    c = model.config
    assert model.model_type == name and c.position_axes == 1 and c.mrope_section is None
    assert not c.qkv_bias and not c.qk_norm and c.rms_norm_eps == 1e-5
    assert (c.num_layers, c.num_heads, c.num_kv_heads) == (2, 4, 2)
    assert c.eos_token_ids == (hf.config.eos_token_id,)
    if name == "llama":
        assert c.head_dim == 32 and c.rope_theta == 5e5 and not c.tie_embeddings
        assert c.rope_scaling == (8.0, 1.0, 4.0, 32.0)
    else:
        assert c.head_dim == 16 and c.rope_theta == 1e6 and c.tie_embeddings and c.rope_scaling is None


def test_padded_batch_logits_match_transformers(one_shot):
    got, want, keep = one_shot
    assert np.abs(got - want)[keep].max() <= 1e-4


def test_stream_equals_one_shot_and_greedy_equals_generate(family, ids, one_shot):
    _, hf, model, _ = family
    got = one_shot[0]
    result = omnijax.stream(model, split_text(ids[0], CHUNKS, answer_tokens=ANSWER), max_answer_tokens=ANSWER,
                            page_size=8)
    ends = np.cumsum([len(p) for p in np.array_split(ids[0], CHUNKS)]) - 1
    np.testing.assert_allclose(np.asarray(result.logits[:, 0]), got[0, ends], atol=1e-4, rtol=0)
    eos = hf.config.eos_token_id
    with torch.no_grad():
        gen = hf.generate(input_ids=torch.as_tensor(ids[:1]), attention_mask=torch.ones(1, SEQ, dtype=int),
                          max_new_tokens=ANSWER, do_sample=False, eos_token_id=eos, pad_token_id=0)
    want = gen[0, SEQ:].tolist()
    want = want[:want.index(eos) + 1] if eos in want else want
    assert np.asarray(result.tokens[-1, 0]).tolist()[:len(want)] == want


def test_tidekv_prefill_and_decode(llama, ids):
    """Layer-major prefill (one family suffices: the path is the shared decoder's) ends at the one-shot logits and
    decodes transformers' greedy tokens far past the original context length."""
    from omnijax.prefill import SnapKV, greedy

    _, hf, model, _ = llama
    with torch.no_grad():
        want = hf(input_ids=torch.as_tensor(ids[:1])).logits[0, -1].numpy()
    full = model.prefill(input_ids=ids[:1], chunk=32, page=16, room=ANSWER)
    np.testing.assert_allclose(np.asarray(full.logits[0]), want, atol=1e-4, rtol=0)
    tokens, _, _ = greedy(model.decoder, full.cache, full.logits, ANSWER)
    with torch.no_grad():
        gen = hf.generate(input_ids=torch.as_tensor(ids[:1]), attention_mask=torch.ones(1, SEQ, dtype=int),
                          max_new_tokens=ANSWER, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert np.asarray(tokens[0]).tolist() == gen[0, SEQ:].tolist()
    compressed = model.prefill(input_ids=ids[:1], chunk=32, page=16, room=ANSWER, selector=SnapKV(window=8),
                               budgets=48)
    np.testing.assert_allclose(np.asarray(compressed.logits), np.asarray(full.logits), atol=1e-5, rtol=0)


def _llama3_reference(head_dim, theta, factor, low, high, original):
    """transformers' llama3 rule read plainly, one frequency at a time, in float64."""
    out = []
    for j in range(0, head_dim, 2):
        f = 1.0 / theta ** (j / head_dim)
        wavelength = 2 * math.pi / f
        if wavelength < original / high:
            out.append(f)
        elif wavelength > original / low:
            out.append(f / factor)
        else:
            s = (original / wavelength - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
    return np.asarray(out)


def test_llama3_inverse_frequencies_equal_transformers(llama):
    _, hf, model, _ = llama
    ours = np.asarray(rope_lib.inverse_frequencies(32, model.config.rope_base))
    theirs = hf.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0)
    reference = _llama3_reference(32, 5e5, 8.0, 1.0, 4.0, 32.0)
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=0)
    unscaled = np.asarray(rope_lib.inverse_frequencies(32, 5e5))
    ratio = ours / unscaled
    kept, divided = np.isclose(ratio, 1.0), np.isclose(ratio, 1 / 8)
    assert kept.any() and divided.any() and (~kept & ~divided).any()  # all three bands are exercised


def test_rerotation_uses_scaled_frequencies(llama):
    """A re-indexing trim re-rotates cached keys with the model's (scaled) RoPE: each survivor's key equals its raw
    key rotated fresh at its new position."""
    model = llama[2]
    rope_base, d, n, groups = model.config.rope_base, 32, 40, 2
    rng = np.random.default_rng(0)
    # Each step runs compiled (one program, not one per primitive); results are indexed on the host.
    rotate = jax.jit(lambda x, pos: rope_lib.apply_rope(x, rope_lib.rope_angles(pos, d, rope_base, None)))
    view_of = jax.jit(base.sequence_view)
    kv = kv_ops.init(num_layers=1, num_kv_heads=groups, head_dim=d, num_pages=5, page_size=8, batch=1,
                     position_axes=1)
    pos = np.arange(n, dtype=np.int32)[None, None]  # [1, 1, n]
    raw = rng.standard_normal((1, 1, n, groups, d)).astype(np.float32)
    k = jax.jit(jax.vmap(rotate, in_axes=(0, None)))(raw, pos)
    z = np.zeros((1, n), np.int32)
    kv, _ = kv_ops.append(kv, k, raw, np.ones((1, n), bool), paged.SlotMeta(pos=pos, unit=z, span=z + 6, offset=z))
    before = view_of(kv)
    live = np.asarray(before.live)  # [1, S] slots in page-table order
    keep = live & (np.arange(live.shape[1]) % 3 == 0)[None]
    trim = jax.jit(lambda kv, keep, next_pos: base.apply(kv, keep, next_pos, reindex=True, rope=(rope_base, None)))
    kv2, next_pos, _ = trim(kv, keep, np.asarray([n], np.int32))
    view = view_of(kv2)
    slots = np.flatnonzero(keep[0])
    new_pos = np.asarray(view.pos)[0, 0, slots]
    order = np.asarray(before.order)[0, slots]
    fresh = rotate(raw[0, 0, order], new_pos[None])  # [kept, G, d]
    table = np.asarray(kv2.page_table)[0]
    cached_k = np.asarray(kv2.k)
    cached = np.stack([cached_k[0, table[s // 8], s % 8] for s in slots])
    assert int(next_pos[0]) == len(slots) and sorted(new_pos.tolist()) == list(range(len(slots)))
    np.testing.assert_allclose(cached, np.asarray(fresh), atol=2e-5)


# ------------------------------------------------------------------------------------------------------- refusals


def _refuses(tmp_path, hf_dir, edit, error, needle):
    """Converting a config-only copy (no tensors at all) fails naming `needle`: the config is read first."""
    config = json.loads((hf_dir / "config.json").read_text())
    edit(config)
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(error, match=needle):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c.update(sliding_window=4096), r"config\.sliding_window=4096"),
    (lambda c: c.update(attention_bias=True), r"config\.attention_bias=True"),
    (lambda c: c.update(mlp_bias=True), r"config\.mlp_bias=True"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), r"config\.rope_parameters\.rope_type='yarn'"),
    (lambda c: c["rope_parameters"].update(beta_fast=32), r"config\.rope_parameters\.beta_fast=32"),
    (lambda c: c.update(logits_scaling=2.0), r"config\.logits_scaling=2\.0"),
])
def test_unsupported_configs_are_refused_before_tensors(family, tmp_path, edit, needle):
    _refuses(tmp_path, family[3], edit, UnsupportedConfigError, needle)


def test_config_spellings_and_errors(family):
    name, hf, model, hf_dir = family
    config = json.loads((hf_dir / "config.json").read_text())
    rope = config.pop("rope_parameters")
    legacy = dict(config, rope_theta=rope.pop("rope_theta"), rope_scaling=rope if rope["rope_type"] != "default"
                  else None)
    assert config_from_hf(legacy).replace(tie_embeddings=model.config.tie_embeddings,
                                          eos_token_ids=model.config.eos_token_ids) == model.config
    if name == "llama":
        broken = dict(legacy, rope_scaling={k: v for k, v in rope.items() if k != "low_freq_factor"})
        with pytest.raises(ConfigError, match="low_freq_factor"):
            config_from_hf(broken)
        with pytest.raises(ConfigError, match="low_freq_factor < high_freq_factor"):
            config_from_hf(dict(legacy, rope_scaling=dict(rope, low_freq_factor=4.0)))
