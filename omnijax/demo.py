"""`make demo`: what a bounded cache buys on a long audiovisual stream, on a tiny model built here (no download).

Builds a tiny random Qwen2.5-Omni checkpoint in Hugging Face format with a tiny tokenizer, converts it with
`omnijax convert`, loads it, and streams one synthetic session (a system message, `--units` 2 s units of moving
shapes and a tone through the vision and audio encoders, then a question) through `omnijax.Chat` three times: full
context (NoSlide), OmniPick with small watermarks, and OmniPick with tile_skip paging. Prints a table (cells
retained, peak span, active pages, per-unit latency, the answer as text) and what the bounded cache keeps per unit,
writes `session.png` (the three runs over the session) and `clip.mp4` (the session's frames and audio, for
`omnijax watch`), and prints the commands to try next on the tiny checkpoint.

Run: `python -m omnijax.demo [--out DIR] [--units N] [--page-size P] [--high H] [--low L]`.
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
from safetensors.numpy import save_file
from tqdm import tqdm

from omnijax import compilation_cache, plot
from omnijax.chat import Chat, clock, format_kept, kept_by_kind
from omnijax.media import video
from omnijax.models.encoders.whisper import AudioConfig, audio_component
from omnijax.models.frontend import units_for
from omnijax.models.qwen2_5_omni import frontend
from omnijax.models.qwen2_5_omni.config import TOKEN_TEXT, OmniConfig
from omnijax.models.qwen2_5_omni.vision import VisionConfig, vision_component
from omnijax.models.registry import load
from omnijax.models.tokenizer import CHATML_TEMPLATE
from omnijax.models.tokenizer import write_tiny_tokenizer as write
from omnijax.retention import OmniPick
from omnijax.streaming.config import StreamConfig

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
                             encoders: bool = True, token_ids: dict | None = None,
                             silent_ids: tuple[int, int] | None = None) -> Path:
    """Writes `config.json` + `model.safetensors` of a random tiny Qwen2.5-Omni in the release's tensor layout.

    Names carry the `thinker.` prefix of the full model; a few `talker.` and `token2wav.` tensors stand in for the
    speech-output parts a real release ships. With `encoders`, the thinker config also declares a tiny audio tower
    (d_model 32, 1 layer) and vision tower (hidden 32, depth 2, block 1 full attention), both projecting to the text
    hidden size, and their random `thinker.audio_tower.*` / `thinker.visual.*` tensors are generated from the
    conversion tables (plus the unused `audio_tower.audio_bos_eos_token.weight` a release ships). The LM head is
    written unless the text config ties it to the embedding.

    `silent_ids=(start, stop)` zeroes those rows of the embedding: with a tied head their logits are 0, so a random
    model answers mostly with the ids a tiny tokenizer uses (the demo's readable gibberish).

    `token_ids` (OmniConfig field name -> id) replaces the release's special ids: the placeholders and modality
    markers go into the thinker config under their Hugging Face names (`HF_TOKEN_KEYS`), and every special token,
    the chat markers included, into an `added_tokens.json` (the tokenizer's view), as a checkpoint with its own
    vocabulary would ship them.
    """


    cfg = dict(TINY_TEXT_CONFIG if text_config is None else text_config)
    rng = np.random.default_rng(seed)
    D, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, G = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = D // H

    def w(*shape, scale=0.05):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    tied = bool(cfg.get("tie_word_embeddings", False))
    # A tied head reads the embedding back: a smaller scale keeps each token from dominating its own logits.
    embed = w(V, D, scale=0.1 if tied else 0.5)
    if silent_ids is not None:  # ids a tiny tokenizer never produces: zero rows, so a tied head rarely picks them
        embed[silent_ids[0]:silent_ids[1]] = 0
    tensors = {"thinker.model.embed_tokens.weight": embed,
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


def write_tiny_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A tiny byte-level BPE tokenizer for the tiny checkpoint: ChatML template, Qwen2.5-Omni's special tokens at the
    release's ids (`<|endoftext|>` 151643 and every `OmniConfig` token), ordinary tokens below them."""

    release = OmniConfig()
    specials = {"<|endoftext|>": 151643, **{text: getattr(release, field) for field, text in TOKEN_TEXT.items()}}
    return write(directory, vocab_size=vocab_size, special_tokens=specials, chat_template=CHATML_TEMPLATE)


def write_chat_checkpoint(directory: Path) -> Path:
    """The demo's chat-ready source: the tiny tokenizer, then the tiny checkpoint with the ids that tokenizer never
    produces silenced (its answers are the tokenizer's readable gibberish). Returns `directory`."""
    write_tiny_tokenizer(directory, TINY_OMNI_TEXT_CONFIG["vocab_size"])
    vocab = json.loads((Path(directory) / "tokenizer.json").read_text())["model"]["vocab"]
    trained = sum(1 for token in vocab if not token.startswith("<|unused_"))
    write_tiny_hf_checkpoint(directory, text_config=TINY_OMNI_TEXT_CONFIG, silent_ids=(trained, 151_643))
    return Path(directory)


def synthetic_units(num_units: int, seed: int = 1):
    """`num_units` audiovisual 2 s units of moving shapes (56x84 px at 2 fps) and a tone: `[(frames, pcm)]`."""
    units = []
    for k in range(num_units):
        start = k * UNIT_SECONDS
        frames = frontend.synthetic_frames(UNIT_SECONDS, FPS, FRAME_HEIGHT, FRAME_WIDTH, seed=seed, start=start)
        pcm = frontend.tone(UNIT_SECONDS, 220.0 * (1 + k % 4), seed=seed + k, start=start)
        units.append((frames, pcm))
    return units


SYSTEM = "You are watching a live stream. Answer briefly."
QUESTION = "What colour was the first shape you saw?"


def _configs(total_tokens: int, page_size: int, high: int, low: int):
    pick = OmniPick(high_watermark=high, low_watermark=low, recent_units=2)
    bounded = -(-2 * high // page_size) + 8  # room for the trim's high watermark, the answer and class pages
    return {"NoSlide": StreamConfig(num_pages=-(-total_tokens // page_size) + 8, page_size=page_size),
            "OmniPick": StreamConfig(policy=pick, num_pages=bounded, page_size=page_size),
            "OmniPick+tile_skip": StreamConfig(policy=pick, paging="tile_skip", num_pages=bounded,
                                                       page_size=page_size)}


def main(argv=None) -> int:
    compilation_cache.enable()  # a command line caches its compiled programs (OMNIJAX_COMPILATION_CACHE)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_out", help="working directory (replaced)")
    parser.add_argument("--units", type=int, default=48, help="audiovisual 2 s units in the session (default 48)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--high", type=int, default=800, help="OmniPick's high watermark (cells)")
    parser.add_argument("--low", type=int, default=560, help="OmniPick's low watermark (cells)")
    args = parser.parse_args(argv)
    if args.units < 1:
        parser.error("--units must be at least 1")



    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    hf_dir = write_chat_checkpoint(out / "hf")
    print(f"wrote a tiny random Qwen2.5-Omni checkpoint (Hugging Face layout) and a tiny tokenizer to {hf_dir}")
    script = Path(sys.executable).parent / "omnijax"  # the console script installed beside this Python
    cmd = [str(script), "convert", str(hf_dir), str(out / "omnijax"), "--no-progress"]
    print("$ omnijax convert", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)
    model = load(out / "omnijax")
    print(f"loaded: {model.config.num_layers} layers, hidden {model.config.hidden_size}, vocab "
          f"{model.config.vocab_size}; audio and vision encoders: "
          f"{'yes' if model.audio is not None and model.vision is not None else 'no'}; tokenizer: "
          f"{'yes' if model.tokenizer is not None else 'no'}")

    units = synthetic_units(args.units)
    clip = _write_clip(out / "clip.mp4", units)
    video_kwargs = {"min_pixels": DEMO_VIDEO_MIN_PIXELS}
    probe = units_for(model).av(*units[0], 0, **video_kwargs)
    total = args.units * probe.length + 256
    print(f"session: a system message, {args.units} audiovisual units ({args.units * UNIT_SECONDS:g} s: "
          f"{FRAME_HEIGHT}x{FRAME_WIDTH} frames at {FPS:g} fps + a 16 kHz tone; {probe.length} tokens each, "
          f"{args.units * probe.length} in all), then a question answered as text")

    rows, traces, chats = [], {}, {}
    for name, config in _configs(total, args.page_size, args.high, args.low).items():
        chat = Chat(model, config, video_kwargs=video_kwargs)
        chat.system(SYSTEM)
        started = time.perf_counter()
        for k, (frames, pcm) in enumerate(tqdm(units, desc=f"{name:>18}", unit="unit", leave=False, disable=None)):
            chat.av(frames, pcm, label=f"{clock(k * UNIT_SECONDS)}-{clock((k + 1) * UNIT_SECONDS)}")
        answer = "".join(chat.ask(QUESTION, max_tokens=12))
        seconds = time.perf_counter() - started
        av_ms = sorted(s.latency_ms for s in chat.steps if s.label == "av")
        rows.append((name, chat.steps[-1].retained, max(s.physical_span for s in chat.steps),
                     chat.steps[-1].active_pages, config.num_pages, av_ms[len(av_ms) // 2], seconds, answer))
        traces[name], chats[name] = chat.trace(), chat

    header = f"{'policy':>18} {'retained':>8} {'peak span':>9} {'pages':>5} {'pool':>5} {'ms/unit':>7} {'total s':>7}"
    print(header + "  answer (random weights: any text)")
    for name, retained, span, pages, pool, ms, seconds, answer in rows:
        print(f"{name:>18} {retained:>8} {span:>9} {pages:>5} {pool:>5} {ms:>7.1f} {seconds:>7.1f}  {answer!r}")
    print("(retained: cells held at the end; peak span: the largest extent attention traversed; pages: active pages "
          "at the end; ms/unit: median per audiovisual unit, encoders included)")
    kept = chats["OmniPick+tile_skip"].kept()
    print("\nwhat OmniPick+tile_skip keeps, per kind of unit and span (Chat.kept(), summed by kept_by_kind):")
    print(format_kept(kept_by_kind(kept)))
    print("the last audiovisual units and the question, unit by unit:")
    print("\n".join(format_kept(kept).splitlines()[-9:]))
    try:
        figure = plot.compare(traces, out / "session.png", title=f"{args.units} audiovisual units")
        print(f"\nwrote {figure}")
    except ImportError as e:
        print(f"\n(no plot: {e})")
    print(f"\nnext: {script} chat {out / 'omnijax'}")
    if clip is not None:
        print(f"      {script} watch {out / 'omnijax'} {clip} --ask \"What happened?\" --at 0:10 "
              f"--policy omnipick --paging tile_skip --plot {out / 'watch.png'}")
    return 0


def _write_clip(path: Path, units) -> Path | None:
    """The session's frames and audio as an mp4 (for `omnijax watch`), when PyAV is installed."""
    frames = np.concatenate([f for f, _ in units])
    pcm = np.concatenate([p for _, p in units])
    try:
        return video.write_clip(path, frames, int(FPS), pcm)
    except ImportError:
        print("(PyAV is not installed, so no clip.mp4 for `omnijax watch`: pip install 'omnijax[video]')")
        return None


if __name__ == "__main__":
    sys.exit(main())
