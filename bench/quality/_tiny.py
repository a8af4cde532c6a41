"""The `--smoke` model of the quality scripts: a tiny random Llama in Hugging Face format, built on the fly and
converted by `omnijax convert`, so every code path of a quality script runs in seconds without the real model.

The Hugging Face folder (`config.json`, `model.safetensors`, `tokenizer.json`, `tokenizer_config.json` with a ChatML
template) is what transformers / kvpress load; its omnijax conversion is what omnijax loads: both sides run the same
weights, as the GGUF gives them for the real model. The weights are random, so accuracies and perplexities measured on
it mean nothing; the code paths, the tables, the JSON and the PNG are what a smoke run checks.

Both are kept under `<work>/tiny-llama-<digest>` (the digest covers this file, so an edited builder builds again) and
reused by later runs; concurrent runs (the smoke suite starts several scripts at once) each build in a private folder
and the first to finish publishes it with an atomic rename.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from bench.quality._common import FILLER, INTRO, MULTI_ACK, MULTI_QUESTION, QUESTION, key_sentence, natural_text

VOCAB = 512
SPECIALS = {"<|endoftext|>": VOCAB - 3, "<|im_start|>": VOCAB - 2, "<|im_end|>": VOCAB - 1}
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}, "tie_word_embeddings": True,
    "attention_bias": False, "mlp_bias": False, "bos_token_id": SPECIALS["<|im_start|>"],
    "eos_token_id": SPECIALS["<|im_end|>"], "torch_dtype": "float32",
}
"""SmolLM2's shape in miniature: Llama, grouped-query attention, tied embeddings, rope_theta 1e5."""
SEED = 0


def _corpus() -> list[str]:
    """Training text of the tokenizer: the pass-key prompts' sentences and the vendored Alice text."""
    alice = natural_text("alice29.txt")
    return [FILLER * 4, INTRO, QUESTION, MULTI_QUESTION, MULTI_ACK, key_sentence("12345"), "0123456789 " * 8,
            *alice.split("\n\n")]


def _weights() -> dict[str, np.ndarray]:
    """Random tensors under Hugging Face Llama names (`lm_head` absent: tied to the embedding)."""
    rng = np.random.default_rng(SEED)
    c = CONFIG
    D, I, V, L = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    H, G, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]

    def w(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(V, D, scale=0.1), "model.norm.weight": 1 + w(D, scale=0.05)}
    for i in range(L):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": 1 + w(D, scale=0.05),
            p + "post_attention_layernorm.weight": 1 + w(D, scale=0.05),
            p + "self_attn.q_proj.weight": w(H * d, D), p + "self_attn.k_proj.weight": w(G * d, D),
            p + "self_attn.v_proj.weight": w(G * d, D), p + "self_attn.o_proj.weight": w(D, H * d),
            p + "mlp.gate_proj.weight": w(I, D), p + "mlp.up_proj.weight": w(I, D), p + "mlp.down_proj.weight": w(D, I),
        })
    return tensors


def _digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def write_hf(directory: Path) -> Path:
    """Writes the tiny Hugging Face Llama (weights, config, tokenizer with a ChatML template) into `directory`."""
    from safetensors.numpy import save_file

    from omnijax.models.chat_templates import CHATML_TEMPLATE
    from omnijax.models.tokenizer import write_tiny_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    write_tiny_tokenizer(directory, vocab_size=VOCAB, special_tokens=SPECIALS, chat_template=CHATML_TEMPLATE,
                         corpus=_corpus(), eos_token="<|im_end|>")
    save_file(_weights(), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": CONFIG["eos_token_id"],
                                                                 "bos_token_id": CONFIG["bos_token_id"]}))
    return directory


def tiny_model(work: str | os.PathLike) -> tuple[Path, Path]:
    """`(omnijax checkpoint, Hugging Face folder)` of the tiny Llama under `work`, built when absent.

    Args:
        work: the folder kept between runs (the scripts' `--work`).

    Returns:
        The converted checkpoint directory and the Hugging Face folder it was converted from.
    """
    final = Path(work) / f"tiny-llama-{_digest()}"
    if not (final / "omnijax" / "omnijax.json").is_file():
        from omnijax.convert import convert_checkpoint

        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=final.parent))
        try:
            write_hf(tmp / "hf")
            convert_checkpoint(tmp / "hf", tmp / "omnijax", progress=False, log=lambda line: None)
            try:
                os.rename(tmp, final)  # atomic; fails when another run published first
                print(f"built the tiny random Llama in {final}", flush=True)
            except OSError:
                if not (final / "omnijax" / "omnijax.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final / "omnijax", final / "hf"
