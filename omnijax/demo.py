"""`make demo`: build a tiny random Qwen2.5-Omni checkpoint in Hugging Face format (no download), convert it with
the `omnijax-convert` CLI, load it and stream a synthetic audiovisual session: a system prompt, 2 s units of video
frames and audio (moving shapes and a tone) through the vision and audio encoders, then a user question answered
with 8 greedy tokens. Prints per-chunk latency and KV statistics, then runs the whole session again as one
`lax.scan` and compares the logits with the step-wise session.

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
# The audiovisual demo needs the real special-token ids (<|VIDEO|> is 151656): the vocabulary of the 3B release,
# with the head tied to the embedding to halve the file.
TINY_OMNI_TEXT_CONFIG = dict(TINY_TEXT_CONFIG, vocab_size=151_936, tie_word_embeddings=True)
# Encoders (their output width is set to the text hidden size when written).
TINY_AUDIO_CONFIG = {"num_mel_bins": 128, "d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 4,
                     "encoder_ffn_dim": 64, "n_window": 100, "max_source_positions": 1500}
TINY_VISION_CONFIG = {"depth": 2, "hidden_size": 32, "num_heads": 4, "intermediate_size": 64, "patch_size": 14,
                      "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                      "fullatt_block_indexes": [1], "in_channels": 3}
# Frames of the demo are small (56x84 px); the processor's video minimum (128 tokens of 28x28 px) would upscale
# them 4.7x, so the demo lowers it to the image processor's 56x56 px: 2x3 LLM tokens per temporal patch.
DEMO_VIDEO_MIN_PIXELS = 56 * 56
FRAME_HEIGHT, FRAME_WIDTH, FPS, UNIT_SECONDS = 56, 84, 2.0, 2.0


def _encoder_tensors(component, init) -> dict[str, np.ndarray]:
    """Random Hugging Face tensors for every rule of a conversion `Component` (all layers of layered rules)."""
    out = {}
    for rule in component.active_rules():
        shape = rule.source_shape(component.dims)
        names = [rule.hf_name.format(i=i) for i in range(component.num_layers)] if rule.layered else [rule.hf_name]
        for name in names:
            out["thinker." + component.prefix + name] = init(name, shape)
    return out


# OmniConfig field -> the Hugging Face thinker config key that holds it (the chat markers live in the tokenizer only).
HF_TOKEN_KEYS = {"audio_token_id": "audio_token_index", "image_token_id": "image_token_index",
                 "video_token_id": "video_token_index", "audio_start_token_id": "audio_start_token_id",
                 "audio_end_token_id": "audio_end_token_id", "vision_start_token_id": "vision_start_token_id",
                 "vision_end_token_id": "vision_end_token_id"}


def write_tiny_hf_checkpoint(directory: Path, *, seed: int = 0, text_config: dict | None = None,
                             encoders: bool = True, token_ids: dict | None = None) -> Path:
    """Writes `config.json` + `model.safetensors` of a random tiny Qwen2.5-Omni in the release's tensor layout.

    Names carry the `thinker.` prefix of the full model; a few `talker.` and `token2wav.` tensors stand in for the
    speech-output parts a real release ships. With `encoders`, the thinker config also declares a tiny audio tower
    (d_model 32, 1 layer) and vision tower (hidden 32, depth 2, block 1 full attention), both projecting to the text
    hidden size, and their random `thinker.audio_tower.*` / `thinker.visual.*` tensors are generated from the
    conversion tables (plus the unused `audio_tower.audio_bos_eos_token.weight` a release ships). The LM head is
    written unless the text config ties it to the embedding.

    `token_ids` (OmniConfig field name -> id) replaces the release's special ids: the placeholders and modality
    markers go into the thinker config under their Hugging Face names (`HF_TOKEN_KEYS`), and every special token,
    the chat markers included, into an `added_tokens.json` (the tokenizer's view), as a checkpoint with its own
    vocabulary would ship them.
    """
    from safetensors.numpy import save_file

    from omnijax.models.qwen2_5_omni.audio import AudioConfig, audio_component
    from omnijax.models.qwen2_5_omni.vision import VisionConfig, vision_component

    cfg = dict(TINY_TEXT_CONFIG if text_config is None else text_config)
    rng = np.random.default_rng(seed)
    D, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, G = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = D // H

    def w(*shape, scale=0.05):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    tied = bool(cfg.get("tie_word_embeddings", False))
    # A tied head reads the embedding back: a smaller scale keeps each token from dominating its own logits.
    tensors = {"thinker.model.embed_tokens.weight": w(V, D, scale=0.1 if tied else 0.5),
               "thinker.model.norm.weight": 1 + w(D)}
    if not tied:
        tensors["thinker.lm_head.weight"] = w(V, D, scale=0.2)
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
    from omnijax.models.qwen2_5_omni.config import TOKEN_TEXT, OmniConfig

    thinker = {"model_type": "qwen2_5_omni_thinker", "text_config": cfg,
               "audio_token_index": 151646, "image_token_index": 151655, "video_token_index": 151656,
               "vision_start_token_id": 151652, "position_id_per_seconds": 25, "seconds_per_chunk": 2}
    if token_ids is not None:
        ids = OmniConfig(**token_ids)  # refuses unknown names
        thinker.update({key: getattr(ids, field) for field, key in HF_TOKEN_KEYS.items()})
    if encoders:
        def init(name, shape):
            if len(shape) == 1:  # norm scales near 1, biases near 0
                return 1 + w(*shape) if "norm" in name or "ln_" in name else w(*shape, scale=0.02)
            fan_in = int(np.prod(shape[1:]))  # torch layouts: [out, in, ...]
            return w(*shape, scale=1.0 / np.sqrt(fan_in))

        audio = AudioConfig(**TINY_AUDIO_CONFIG, output_dim=D)
        vision = VisionConfig(**TINY_VISION_CONFIG, out_hidden_size=D)
        tensors.update(_encoder_tensors(audio_component(audio), init))
        tensors.update(_encoder_tensors(vision_component(vision), init))
        tensors["thinker.audio_tower.audio_bos_eos_token.weight"] = w(2, D)  # in releases, never read
        thinker["audio_config"] = {"model_type": "qwen2_5_omni_audio_encoder", "activation_function": "gelu",
                                   **{k: v for k, v in audio.to_json().items() if k != "dtype"}}
        thinker["vision_config"] = {"model_type": "qwen2_5_omni_vision_encoder", "hidden_act": "silu",
                                    "tokens_per_second": 25,
                                    **{k: v for k, v in vision.to_json().items() if k != "dtype"}}
    tensors["talker.model.norm.weight"] = np.ones(8, np.float32)
    tensors["token2wav.code_embed.weight"] = w(4, 8)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Qwen2_5OmniForConditionalGeneration"], "model_type": "qwen2_5_omni",
        "enable_audio_output": False, "thinker_config": thinker,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    if token_ids is not None:
        added = {text: getattr(ids, field) for field, text in TOKEN_TEXT.items()}
        (directory / "added_tokens.json").write_text(json.dumps(added, indent=2))
    return directory


def _synthetic_session(model, num_units: int, seed: int):
    """System prompt, `num_units` audiovisual 2 s units, then a user question asking for 8 tokens.

    Returns `[(label, build)]`: `build()` runs the frontend (preprocessing and encoders) and returns the chunk.
    """
    from omnijax.adapters.qwen2_5_omni import RELEASE
    from omnijax.models.qwen2_5_omni import frontend

    ids = model.omni or RELEASE  # the checkpoint's chat markers
    IM_START, IM_END = ids.im_start_token_id, ids.im_end_token_id
    rng = np.random.default_rng(seed)
    words = lambda n: rng.integers(0, 1000, n).tolist()  # noqa: E731  (ordinary text ids)
    system_ids = [IM_START, *words(20), IM_END]
    question_ids = [IM_START, *words(12), IM_END, IM_START, *words(2)]
    session = [("system", lambda: frontend.system(model, system_ids, unit=0))]
    for k in range(num_units):
        def build(k=k):
            start = k * UNIT_SECONDS
            frames = frontend.synthetic_frames(UNIT_SECONDS, FPS, FRAME_HEIGHT, FRAME_WIDTH, seed=seed, start=start)
            pcm = frontend.tone(UNIT_SECONDS, 220.0 * (1 + k % 4), seed=seed + k, start=start)
            return frontend.audiovisual_chunk(model, frames, pcm, unit=1 + k, fps=FPS,
                                              min_pixels=DEMO_VIDEO_MIN_PIXELS)
        session.append((f"av {k}", build))
    session.append(("question", lambda: frontend.text(model, question_ids, unit=1 + num_units, answer_tokens=8)))
    return session


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_out", help="working directory (replaced)")
    parser.add_argument("--chunks", type=int, default=12,
                        help="chunks in the session: a system prompt, N-2 audiovisual 2 s units, a question (N >= 3)")
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args(argv)
    if args.chunks < 3:
        parser.error("--chunks must be at least 3 (system prompt, one audiovisual unit, question)")

    import jax
    import omnijax
    from omnijax.chunks import pad_chunk, stack_chunks
    from omnijax.streaming import pages_needed

    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    hf_dir = write_tiny_hf_checkpoint(out / "hf", text_config=TINY_OMNI_TEXT_CONFIG)
    print(f"wrote a tiny random Qwen2.5-Omni checkpoint (Hugging Face layout) to {hf_dir}")
    script = Path(sys.executable).parent / "omnijax-convert"  # the console script installed beside this Python
    cmd = [str(script), str(hf_dir), str(out / "omnijax"), "--dtype", "float32"]
    print("$ omnijax-convert", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    model = omnijax.load(out / "omnijax")
    print(f"loaded: {model.config.num_layers} layers, hidden {model.config.hidden_size}, "
          f"vocab {model.config.vocab_size}, mrope {model.config.mrope_section}; "
          f"audio encoder: {'yes' if model.audio is not None else 'no'}, "
          f"vision encoder: {'yes' if model.vision is not None else 'no'}")
    units = args.chunks - 2
    print(f"session: system prompt, {units} audiovisual units ({UNIT_SECONDS:g} s of {FRAME_HEIGHT}x{FRAME_WIDTH} "
          f"frames at {FPS:g} fps + a 16 kHz tone each), a question answered with 8 tokens")

    header = f"{'chunk':>5} {'kind':>8} {'tokens':>6} {'enc ms':>7} {'ms':>8} {'retained':>8} {'span':>6} " \
             f"{'pages':>5} {'subblk':>6} {'free':>5}  answer"
    chunks, encode_ms = [], []
    for _, build in _synthetic_session(model, units, seed=1):
        start = time.perf_counter()
        chunks.append(build())
        encode_ms.append(1e3 * (time.perf_counter() - start))
    length = max(c.length for c in chunks)  # one padded length: one compiled step for every chunk
    chunks = [pad_chunk(c, length) for c in chunks]
    stacked = stack_chunks(chunks)
    num_pages = pages_needed(stacked, 8, args.page_size) + 4
    labels = [label for label, _ in _synthetic_session(model, units, seed=1)]

    config = omnijax.StreamConfig(max_answer_tokens=8, num_pages=num_pages, page_size=args.page_size)
    session = omnijax.Session(model, config)
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
        print(f"{i:>5} {labels[i]:>8} {int(np.asarray(chunk.valid).sum()):>6} {encode_ms[i]:>7.1f} {ms:>8.2f} "
              f"{int(s.retained_cells[0]):>8} {int(s.physical_span[0]):>6} {int(s.active_pages[0]):>5} "
              f"{int(s.active_subblocks[0]):>6} {int(s.free_pages):>5}  {answer if answer else ''}")
    print("(enc ms: preprocessing and encoders; the first audiovisual unit and chunk 0's ms include compilation)")

    start = time.perf_counter()
    result = omnijax.stream(model, stacked, config)
    jax.block_until_ready(result.logits)
    first = time.perf_counter() - start
    start = time.perf_counter()
    result = omnijax.stream(model, stacked, config)
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
