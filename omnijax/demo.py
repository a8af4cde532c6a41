"""`make demo`: build a tiny random Qwen2.5-Omni checkpoint in Hugging Face format (no download), convert it with
the `omnijax-convert` CLI, load it and stream a synthetic session of text chunks, printing per-chunk latency and KV
statistics.

Run: `python -m omnijax.demo [--out DIR] [--chunks N] [--page-size P]`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# Hugging Face config of the embedded tiny model (full-model layout: thinker + speech-output parts).
TINY_TEXT_CONFIG = {
    "model_type": "qwen2_5_omni_text", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "use_sliding_window": False, "sliding_window": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
    "tie_word_embeddings": False, "attention_dropout": 0.0, "layer_types": ["full_attention"] * 4,
}


def write_tiny_hf_checkpoint(directory: Path, *, seed: int = 0, text_config: dict | None = None) -> Path:
    """Writes `config.json` + `model.safetensors` of a random tiny Qwen2.5-Omni in the release's tensor layout.

    Names carry the `thinker.` prefix of the full model; a few `talker.` and `token2wav.` tensors stand in for the
    speech-output parts a real release ships.
    """
    from safetensors.numpy import save_file

    cfg = dict(TINY_TEXT_CONFIG if text_config is None else text_config)
    rng = np.random.default_rng(seed)
    D, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, G = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = D // H

    def w(*shape, scale=0.05):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    tensors = {"thinker.model.embed_tokens.weight": w(V, D, scale=0.5), "thinker.model.norm.weight": 1 + w(D),
               "thinker.lm_head.weight": w(V, D, scale=0.2)}
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
    tensors["talker.model.norm.weight"] = np.ones(8, np.float32)
    tensors["token2wav.code_embed.weight"] = w(4, 8)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Qwen2_5OmniForConditionalGeneration"], "model_type": "qwen2_5_omni",
        "enable_audio_output": False,
        "thinker_config": {"model_type": "qwen2_5_omni_thinker", "text_config": cfg,
                           "audio_token_index": 151646, "image_token_index": 151655, "video_token_index": 151656,
                           "vision_start_token_id": 151652, "position_id_per_seconds": 25, "seconds_per_chunk": 2},
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _synthetic_session(num_chunks: int, vocab: int, seed: int):
    """A system prompt, then user text chunks of varied length; every third chunk asks for an answer."""
    from omnijax.chunks import text_chunk
    from omnijax.units import SpanKind

    rng = np.random.default_rng(seed)
    chunks = [text_chunk(rng.integers(0, vocab, 24), length=48, unit=0, span=SpanKind.SYSTEM)]
    for i in range(1, num_chunks):
        n = int(rng.integers(8, 48))
        chunks.append(text_chunk(rng.integers(0, vocab, n), length=48, unit=2 * i,
                                 answer_tokens=8 if i % 3 == 0 else 0))
    return chunks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_out", help="working directory (replaced)")
    parser.add_argument("--chunks", type=int, default=12)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args(argv)

    import jax
    import omnijax
    from omnijax.chunks import stack_chunks

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    hf_dir = write_tiny_hf_checkpoint(out / "hf")
    print(f"wrote a tiny random Qwen2.5-Omni checkpoint (Hugging Face layout) to {hf_dir}")
    script = Path(sys.executable).parent / "omnijax-convert"  # the console script installed beside this Python
    cmd = [str(script), str(hf_dir), str(out / "omnijax"), "--dtype", "float32"]
    print("$ omnijax-convert", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    model = omnijax.load(out / "omnijax")
    print(f"loaded: {model.config.num_layers} layers, hidden {model.config.hidden_size}, "
          f"vocab {model.config.vocab_size}, mrope {model.config.mrope_section}")

    chunks = _synthetic_session(args.chunks, model.config.vocab_size, seed=1)
    session = omnijax.Session(model, max_answer_tokens=8, num_pages=64, page_size=args.page_size)
    header = f"{'chunk':>5} {'tokens':>6} {'ms':>8} {'retained':>8} {'span':>6} {'pages':>5} {'subblk':>6} " \
             f"{'free':>5}  answer"
    print(header)
    session_logits = []
    for i, chunk in enumerate(chunks):
        start = time.perf_counter()
        res = session.feed(chunk)
        jax.block_until_ready(res.logits)
        ms = 1e3 * (time.perf_counter() - start)
        s = res.stats.layout
        answer = [t for t in np.asarray(res.tokens[0]).tolist() if t >= 0]
        session_logits.append(np.asarray(res.logits[0]))
        print(f"{i:>5} {int(np.asarray(chunk.valid).sum()):>6} {ms:>8.2f} {int(s.retained_cells[0]):>8} "
              f"{int(s.physical_span[0]):>6} {int(s.active_pages[0]):>5} {int(s.active_subblocks[0]):>6} "
              f"{int(s.free_pages):>5}  {answer if answer else ''}")
    print("(chunk 0 includes compilation)")

    stacked = stack_chunks(chunks)
    start = time.perf_counter()
    result = omnijax.stream(model, stacked, max_answer_tokens=8, num_pages=64, page_size=args.page_size)
    jax.block_until_ready(result.logits)
    first = time.perf_counter() - start
    start = time.perf_counter()
    result = omnijax.stream(model, stacked, max_answer_tokens=8, num_pages=64, page_size=args.page_size)
    jax.block_until_ready(result.logits)
    again = time.perf_counter() - start
    diff = float(np.max(np.abs(np.asarray(result.logits[:, 0]) - np.stack(session_logits))))
    print(f"whole session as one lax.scan: {1e3 * first:.1f} ms with compilation, {1e3 * again:.1f} ms after; "
          f"max |logit difference| vs step-wise Session: {diff:.2e}")
    if not np.isfinite(diff) or diff > 1e-4:
        print("error: stream and Session disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
