"""GGUF files (llama.cpp) -> omnijax checkpoints, checked against transformers 5.2.0 loading the same file
(`from_pretrained(dir, gguf_file=...)`): tiny GGUFs written here with `gguf.GGUFWriter` for every quantisation type
read (logits <= 1e-4), for each architecture, tokenizers (template strings and ids), and the bad inputs refused by
name with nothing written. The real SmolLM2-135M-Instruct GGUF is checked in test_gguf_smollm2.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (the omnijax[gguf] / test extra) writes the test files")
torch = pytest.importorskip("torch", reason="torch (the test extra) runs the transformers reference")

import omnijax  # noqa: E402
from omnijax.convert import convert_checkpoint, convert_gguf  # noqa: E402
from omnijax.convert.__main__ import main as convert_main  # noqa: E402
from omnijax.convert.gguf import SUPPORTED_TYPES, GGUFError  # noqa: E402
from omnijax.errors import ConvertError, ShapeMismatchError, UnsupportedConfigError, UnsupportedModelError  # noqa: E402
from omnijax.models.tokenizer import Tokenizer, write_tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
T = gguf.GGMLQuantizationType
QUIET = dict(progress=False, log=lambda message: None)
VOCAB, HIDDEN, INTER, LAYERS = 320, 256, 256, 2  # rows of 256: whole K-quant super-blocks
SPECIALS = {"<|endoftext|>": VOCAB - 3, "<|im_start|>": VOCAB - 2, "<|im_end|>": VOCAB - 1}  # pad, bos, eos
CHATML = ("{% for message in messages %}{{ bos_token if loop.first else '' }}{{'<|im_start|>' + message['role'] + "
          "'\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEXTS = ("Hello world! The quick brown fox, 2024.", "  spaces\tand\ttabs\n\nnew lines  ", "café naïve Zürich 😀",
         "<|im_start|>user\nWhat is shown?<|im_end|>\n", "def main():\n    return [x * 2 for x in range(10)]")
# K-quant blocks are written as random bytes (gguf-py cannot quantise to them) with their fp16 scales set small:
# byte offsets of the fp16 fields in a block, and their value.
K_SCALES = {"Q2_K": ((80, 82), 0.01), "Q3_K": ((108,), 1e-3), "Q4_K": ((0, 2), 2e-4), "Q5_K": ((0, 2), 1e-4),
            "Q6_K": ((208,), 5e-5)}


# ------------------------------------------------------------------------------------------------------- writing


def tiny_vocab(tmp: Path) -> tuple[list[str], list[str]]:
    """Tokens and merges of a tiny byte-level BPE with the ChatML specials last."""
    write_tiny_tokenizer(tmp, vocab_size=VOCAB, special_tokens=SPECIALS, chat_template=None)
    model = json.loads((tmp / "tokenizer.json").read_text())["model"]
    vocab = {**model["vocab"], **SPECIALS}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert len(tokens) == VOCAB and [vocab[t] for t in tokens] == list(range(VOCAB))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def hf_weights(rng, *, vocab=VOCAB, heads=4, kv_heads=2, head_dim=64, bias=False, qk_norm=False, experts=0,
               expert_inter=0, tied=True) -> dict[str, np.ndarray]:
    """Random weights in the Hugging Face layout (names and [out, in] shapes)."""
    def mat(*shape):
        return (rng.normal(size=shape) * 0.15).astype(np.float32)

    def norm(n):
        return (1.0 + rng.normal(size=n) * 0.1).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(vocab, HIDDEN), "model.norm.weight": norm(HIDDEN)}
    if not tied:
        w["lm_head.weight"] = mat(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": norm(HIDDEN), p + "post_attention_layernorm.weight": norm(HIDDEN),
              p + "self_attn.q_proj.weight": mat(heads * head_dim, HIDDEN),
              p + "self_attn.k_proj.weight": mat(kv_heads * head_dim, HIDDEN),
              p + "self_attn.v_proj.weight": mat(kv_heads * head_dim, HIDDEN),
              p + "self_attn.o_proj.weight": mat(HIDDEN, heads * head_dim)}
        if bias:
            w |= {p + f"self_attn.{x}_proj.bias": mat(n * head_dim) for x, n in (("q", heads), ("k", kv_heads),
                                                                                  ("v", kv_heads))}
        if qk_norm:
            w |= {p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim)}
        if experts:
            w[p + "mlp.gate.weight"] = mat(experts, HIDDEN)
            w |= {p + f"mlp.experts.{x}_exps": mat(experts, *s) for x, s in
                  (("gate", (expert_inter, HIDDEN)), ("up", (expert_inter, HIDDEN)), ("down", (HIDDEN, expert_inter)))}
        else:
            w |= {p + "mlp.gate_proj.weight": mat(INTER, HIDDEN), p + "mlp.up_proj.weight": mat(INTER, HIDDEN),
                  p + "mlp.down_proj.weight": mat(HIDDEN, INTER)}
    return w


_TO_GGUF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
            "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
            "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
            "mlp.gate.weight": "ffn_gate_inp.weight",
            **{f"self_attn.{x}_proj.{k}": f"attn_{x}.{k}" for x in "qkv" for k in ("weight", "bias")},
            **{f"mlp.{x}_proj.weight": f"ffn_{x}.weight" for x in ("gate", "up", "down")},
            **{f"mlp.experts.{x}_exps": f"ffn_{x}_exps.weight" for x in ("gate", "up", "down")}}


def gguf_name(hf: str) -> str:
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_TO_GGUF[rest]}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (what its converter does to a llama checkpoint)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encoded(array: np.ndarray, qtype: str, rng) -> tuple[np.ndarray, T]:
    """`array` in GGML type `qtype`: quantised by gguf-py, or random K-quant blocks of the same shape."""
    t = T[qtype]
    if qtype in K_SCALES:
        block, size = gguf.GGML_QUANT_SIZES[t]
        rows = int(np.prod(array.shape[:-1]))
        raw = rng.integers(0, 256, (rows * array.shape[-1] // block, size), dtype=np.uint8)
        offsets, scale = K_SCALES[qtype]
        for o in offsets:
            raw[:, o:o + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
        return raw.reshape(*array.shape[:-1], array.shape[-1] // block * size), t
    if qtype == "F32":
        return array, t
    return gguf.quants.quantize(array, t), t


def write_gguf(path: Path, arch: str, weights: dict[str, np.ndarray], tokens, merges, *, qtype="F32", heads=4,
               kv_heads=2, head_dim=None, experts=0, expert_inter=0, extra=None, seed=0, name="tiny",
               tokenizer_model="gpt2") -> Path:
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
        w.add_expert_feed_forward_length(expert_inter)
    for key, value in (extra or {}).items():
        getattr(w, key)(value)
    w.add_tokenizer_model(tokenizer_model)
    w.add_token_list(tokens)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    bos, eos, pad = (SPECIALS[t] if t in tokens else i for t, i in (("<|im_start|>", 1), ("<|im_end|>", 2),
                                                                    ("<|endoftext|>", 0)))
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_pad_token_id(pad)
    w.add_unk_token_id(pad)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for hf, array in weights.items():
        if arch == "llama" and ".q_proj.weight" in hf:
            array = permute(array, heads)
        elif arch == "llama" and ".k_proj.weight" in hf:
            array = permute(array, kv_heads)
        if array.ndim == 1:
            w.add_tensor(gguf_name(hf), array)
        else:
            data, t = encoded(array, qtype, rng)
            w.add_tensor(gguf_name(hf), data, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ----------------------------------------------------------------------------------------------------- the oracle


def transformers_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.numpy()


def omnijax_logits(ckpt: Path, ids: np.ndarray) -> np.ndarray:
    return np.asarray(omnijax.load(ckpt)(input_ids=ids))


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return tiny_vocab(tmp_path_factory.mktemp("vocab"))


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(1).integers(3, VOCAB, (1, 24))


def assert_matches(path: Path, tmp_path: Path, ids, **kwargs) -> Path:
    out = convert_checkpoint(path, tmp_path / "out", **QUIET, **kwargs)
    got, want = omnijax_logits(out, ids), transformers_logits(path, ids)
    assert np.abs(want).max() > 1.0  # the logits are not all near zero
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    return out


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES)
def test_every_quantisation_type_matches_transformers(qtype, vocab, ids, tmp_path):
    """Llama (q/k rows permuted by llama.cpp, an untied head) with every 2-D tensor in `qtype`."""
    path = write_gguf(tmp_path / f"tiny-{qtype}.gguf", "llama", hf_weights(np.random.default_rng(0), tied=False),
                      *vocab, qtype=qtype)
    out = assert_matches(path, tmp_path, ids)
    counts = json.loads((out / "omnijax.json").read_text())["source"]["source_dtypes"]
    matrices, norms = 2 + 7 * LAYERS, 1 + 2 * LAYERS
    assert counts == ({"F32": matrices + norms} if qtype == "F32" else {qtype: matrices, "F32": norms})


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3moe"])
def test_architectures_match_transformers(arch, vocab, ids, tmp_path):
    """Qwen2 (q/k/v biases, tied), Qwen3 (q/k norm; head width 128, transformers' default, as the GGUF mapping of
    transformers 5.2.0 reads none for qwen3) and Qwen3-MoE (4 experts of width 768, transformers' default)."""
    rng = np.random.default_rng(3)
    if arch == "qwen2":
        kw, w = {}, hf_weights(rng, bias=True)
    elif arch == "qwen3":
        kw, w = {"heads": 2, "kv_heads": 1, "head_dim": 128}, hf_weights(rng, heads=2, kv_heads=1, head_dim=128,
                                                                         qk_norm=True, tied=False)
    else:
        kw = {"heads": 2, "kv_heads": 1, "head_dim": 128, "experts": 4, "expert_inter": 768}
        w = hf_weights(rng, heads=2, kv_heads=1, head_dim=128, qk_norm=True, experts=4, expert_inter=768)
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, w, *vocab, qtype="Q8_0", **kw)
    out = assert_matches(path, tmp_path, ids)
    config = omnijax.load(out).config
    assert config.qkv_bias == (arch == "qwen2") and config.qk_norm == (arch != "qwen2")
    assert config.num_experts == (4 if arch == "qwen3moe" else 0) and config.eos_token_ids == (SPECIALS["<|im_end|>"],)


def test_bfloat16_and_the_command_line(vocab, ids, tmp_path, capsys):
    path = write_gguf(tmp_path / "tiny.gguf", "llama", hf_weights(np.random.default_rng(0)), *vocab, qtype="Q4_K")
    assert convert_main([str(path), str(tmp_path / "bf16"), "--dtype", "bfloat16", "--no-progress"]) == 0
    model = omnijax.load(tmp_path / "bf16")
    assert model.config.dtype == "bfloat16" and model.config.tie_embeddings
    want = transformers_logits(path, ids)
    got = np.asarray(model(input_ids=ids), dtype=np.float32)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()  # bfloat16 weights, same answer
    from omnijax.cli import main as cli_main

    assert cli_main(["convert", str(path), str(tmp_path / "cli"), "--no-progress"]) == 0
    assert "wrote" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------ tokenizer


def spm_vocab() -> tuple[list[str], list[float]]:
    """A tiny SentencePiece-style vocabulary: <unk> <s> </s>, the 256 byte tokens, then pieces with scores."""
    pieces = ["▁", "e", "t", "a", "o", "h", "l", "r", "d", "w", "n", "i", "s", "▁t", "he", "▁the", "▁w", "or", "ld",
              "▁world", "▁h", "ll", "▁he", "▁hell", "▁hello", "!", ",", "H", "T", "▁T", "▁The", "q", "u", "c", "k"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    return tokens, scores


@pytest.mark.parametrize("kind", ["gpt2-llama", "gpt2-qwen2", "spm-llama"])
def test_tokenizer_encodes_and_renders_as_transformers(kind, vocab, tmp_path):
    import transformers

    rng = np.random.default_rng(0)
    arch = "qwen2" if kind == "gpt2-qwen2" else "llama"
    if kind == "spm-llama":
        tokens, scores = spm_vocab()
        path = tmp_path / "spm.gguf"
        write_gguf(path, arch, hf_weights(rng, vocab=len(tokens)), tokens, None, tokenizer_model="llama",
                   extra={"add_token_scores": scores, "add_add_space_prefix": True})
    else:
        path = write_gguf(tmp_path / f"{kind}.gguf", arch, hf_weights(rng, bias=arch == "qwen2"), *vocab)
    out = convert_checkpoint(path, tmp_path / "out", **QUIET)
    ours = omnijax.load(out).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = TEXTS if kind != "spm-llama" else ("Hello world, the world!", "The quick  hello", " hello\nThe")
    for text in texts:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    if kind == "spm-llama":
        return
    messages = [{"role": "user", "content": "Hello world!"}, {"role": "assistant", "content": "Hi, café."},
                {"role": "user", "content": "What is 2+2?"}]
    want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # the template renders bos_token: <|im_start|> (the GGUF's BOS) under llama, nothing under Qwen (as transformers)
    assert ours.render(messages) == want
    assert want.startswith("<|im_start|><|im_start|>user" if arch == "llama" else "<|im_start|>user")
    assert ours.apply_chat_template(messages) == theirs.encode(want, add_special_tokens=False)
    # the GGUF's own end token (transformers 5.2.0 names the BOS token as the EOS of a llama-architecture GGUF)
    assert ours.special_tokens["eos_token"] == "<|im_end|>" and ours.eos_token_id == SPECIALS["<|im_end|>"]
    # the converted directory loads in transformers too, encoding the same
    again = transformers.AutoTokenizer.from_pretrained(out)
    assert again.encode(TEXTS[0], add_special_tokens=False) == ours.encode(TEXTS[0])
    assert Tokenizer.from_directory(out).chat_templates["default"] == CHATML


# ------------------------------------------------------------------------------------------------------ bad input


def assert_refused(path: Path, tmp_path: Path, error, *needles):
    dst = tmp_path / "parent" / "out"
    with pytest.raises(error) as raised:
        convert_checkpoint(path, dst, **QUIET)
    message = str(raised.value)
    for needle in needles:
        assert needle in message, (needle, message)
    assert not (tmp_path / "parent").exists()  # nothing written, not even the parent it would have created
    return message


@pytest.fixture
def good(vocab, tmp_path) -> Path:
    return write_gguf(tmp_path / "good.gguf", "llama", hf_weights(np.random.default_rng(0)), *vocab, qtype="Q8_0")


def _tensor_type_offset(path: Path, name: str) -> int:
    """Byte offset of one tensor's GGML type in the tensor table."""
    reader = gguf.GGUFReader(path)
    field = next(t for t in reader.tensors if t.name == name).field
    return field.offset + sum(int(p.nbytes) for p in field.parts[:4])


def test_bad_magic(good, tmp_path):
    data = bytearray(good.read_bytes())
    data[:4] = b"GGUX"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    assert_refused(bad, tmp_path, GGUFError, "not a GGUF file", "b'GGUX'")


@pytest.mark.parametrize("keep", [0.5, 0.98, 0.001])
def test_truncated(good, tmp_path, keep):
    data = good.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: int(len(data) * keep)])
    assert_refused(bad, tmp_path, GGUFError, "truncated", str(bad))


def test_unknown_and_unsupported_quantisation_types(good, tmp_path):
    data = bytearray(good.read_bytes())
    at = _tensor_type_offset(good, "blk.0.attn_q.weight")
    data[at:at + 4] = np.uint32(99).tobytes()
    bad = tmp_path / "unknown.gguf"
    bad.write_bytes(bytes(data))
    assert_refused(bad, tmp_path, UnsupportedConfigError, "'blk.0.attn_q.weight'", "99", "unknown GGML")
    # a type gguf knows but omnijax does not read: a norm of 256 F32 values relabelled IQ4_NL (it fits in the file)
    data = bytearray(good.read_bytes())
    at = _tensor_type_offset(good, "blk.0.attn_norm.weight")
    data[at:at + 4] = np.uint32(int(T.IQ4_NL)).tobytes()
    bad.write_bytes(bytes(data))
    assert_refused(bad, tmp_path, UnsupportedConfigError, "'blk.0.attn_norm.weight'", "IQ4_NL", "Q4_K")


def test_tensor_shape_disagreeing_with_metadata(vocab, tmp_path):
    weights = hf_weights(np.random.default_rng(0))
    weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"][:128]
    path = write_gguf(tmp_path / "shape.gguf", "llama", weights, *vocab)
    assert_refused(path, tmp_path, ShapeMismatchError, "'blk.1.ffn_up.weight'", "(128, 256)", "(256, 256)")


def test_unimplemented_architecture_and_metadata(vocab, tmp_path):
    path = write_gguf(tmp_path / "gemma.gguf", "gemma2", hf_weights(np.random.default_rng(0)), *vocab)
    assert_refused(path, tmp_path, UnsupportedModelError, "'gemma2'", "llama, qwen2, qwen3, qwen3moe")
    path = write_gguf(tmp_path / "window.gguf", "llama", hf_weights(np.random.default_rng(0)), *vocab,
                      extra={"add_sliding_window": 64})
    assert_refused(path, tmp_path, UnsupportedConfigError, "llama.attention.sliding_window")


def test_missing_gguf_package_names_the_extra(good, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert_refused(good, tmp_path, ConvertError, "pip install 'omnijax[gguf]'")


def test_transformers_saved_checkpoint_converts(good, vocab, ids, tmp_path):
    """transformers' save_pretrained of a GGUF-loaded model writes `_model_name_or_path` (the GGUF's general.name)
    and `unk_token_id`: neither changes the forward, so the checkpoint converts; a key that does is still refused."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(good.parent, gguf_file=good.name, dtype=torch.float32)
    model.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["_model_name_or_path"] == "tiny" and "unk_token_id" in config
    out = convert_checkpoint(tmp_path / "hf", tmp_path / "out", **QUIET)
    with torch.no_grad():
        want = model(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(omnijax_logits(out, ids), want, atol=1e-4, rtol=0)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(UnsupportedConfigError, match="attention_bias"):
        convert_checkpoint(tmp_path / "hf", tmp_path / "out2", **QUIET)


def test_destination_rules_are_shared(good, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ConvertError, match="not empty"):
        convert_gguf(good, tmp_path / "full", **QUIET)
    assert (tmp_path / "full" / "keep.txt").read_text() == "x"
    convert_gguf(good, tmp_path / "full", force=True, **QUIET)
    assert not (tmp_path / "full" / "keep.txt").exists() and (tmp_path / "full" / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

