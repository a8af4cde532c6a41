"""Plain Qwen2 (1D RoPE, q/k/v bias) and Qwen3 (q/k RMSNorm, no bias) decoders converted and checked against
transformers, including streaming and greedy answers on a 1-axis position cache."""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")

import omnijax  # noqa: E402
from omnijax.chunks.chunk import split_text  # noqa: E402
from omnijax.convert import convert_checkpoint  # noqa: E402

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
              tie_word_embeddings=False)


def _build(family: str, seed: int):
    import transformers

    torch.manual_seed(seed)
    if family == "qwen3":
        config = transformers.Qwen3Config(head_dim=16, **COMMON)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**COMMON)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():  # larger weights: sharper attention, so mistakes show
            p.normal_(0.0, 0.2) if p.ndim > 1 else p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def family(request, tmp_path_factory):
    hf = _build(request.param, seed=3)
    root = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(root / "hf", safe_serialization=True)
    model = omnijax.load(convert_checkpoint(root / "hf", root / "out", progress=False))
    return request.param, hf, model


def test_config_detected(family):
    name, _, model = family
    c = model.config
    assert c.mrope_section is None and c.position_axes == 1
    assert (c.qk_norm, c.qkv_bias) == ((True, False) if name == "qwen3" else (False, True))
    assert model.model_type == name


def test_logits_and_stream_match_transformers(family):
    _, hf, model = family
    ids = np.random.default_rng(1).integers(0, COMMON["vocab_size"], (2, 19))
    with torch.no_grad():
        want = hf(input_ids=torch.as_tensor(ids)).logits.numpy()
    got = np.asarray(model(input_ids=ids))
    assert np.abs(got - want).max() <= 1e-4
    result = omnijax.stream(model, split_text(ids[0], 4, answer_tokens=5), max_answer_tokens=5, page_size=4)
    np.testing.assert_allclose(np.asarray(result.logits[-1, 0]), got[0, -1], atol=1e-5, rtol=0)
    with torch.no_grad():
        gen = hf.generate(input_ids=torch.as_tensor(ids[:1]), attention_mask=torch.ones(1, 19, dtype=int),
                          max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert np.asarray(result.tokens[-1, 0]).tolist() == gen[0, 19:].tolist()


def test_qwen3_attention_bias_is_refused(tmp_path):
    from omnijax.errors import UnsupportedConfigError
    from omnijax.models.qwen2_5_omni.convert import config_from_hf

    with pytest.raises(UnsupportedConfigError, match="attention_bias"):
        config_from_hf({"model_type": "qwen3", "attention_bias": True, **COMMON, "head_dim": 16})
