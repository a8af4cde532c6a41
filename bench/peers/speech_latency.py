"""Spoken-answer latency: the first PCM after the question and the real-time factor, omnijax's `Chat.ask(speak=...)`
(talker frames streamed into Code2Wav chunk by chunk; a sweep of the first chunk's frames) against transformers'
`generate(return_audio=True)` (the whole waveform when everything is done), on the same tiny Qwen3-Omni release.

The release is built in code (seeded, float32): a 3-layer MoE thinker (hidden 64), a 2-layer MoE talker with a
2-layer code predictor over 4 codebooks, and a Code2Wav with the release's upsampling (1,920 samples a frame: 80 ms at
24 kHz) at tiny widths; saved by transformers and converted by `omnijax convert`. Both sides answer the same question
after the same system prompt, the thinker greedily for `--answer-tokens` tokens at most, then the talker greedily
(transformers' code predictor made greedy too) for `--frames` frames (the random talker never ends its speech).

omnijax's talker starts while the thinker still writes (after each decoded block of 16 tokens it runs the steps the
answer so far allows); the arm "omnijax, talker after the text" speaks the same answer only once its text is done
(`ask` without speech, then `speak_chunks` of the same ids: how `Chat` spoke before), in the same process right after
each measured overlapped run, and checks it spoke as many samples. An answer of one block (`--answer-tokens` 16 or
less) cannot overlap; `--answer-tokens 64` shows the difference.

Each side runs in its own process per round, the two alternating round by round, median over `--rounds` (`--smoke`, a
check that measures nothing: one round, each side's worker in the script's own process, `harness.run_worker`). In its
process a side first answers once unmeasured (compilation; torch's first calls), then answers measured, for each
first-chunk size in turn (omnijax) or once (transformers). Figures, from the moment `ask` / `generate` is called:

    first_pcm_ms   the first PCM chunk (transformers: the waveform, all at once)
    last_pcm_ms    the last one
    audio_s        seconds of speech produced
    rtf_speech     (last PCM - end of the text) / audio_s: the talker + vocoder after the text (omnijax; smaller
                   when the talker ran during the text)
    rtf_total      last_pcm_ms / audio_s: thinker, talker and vocoder

CPU figures of tiny weights: they say where the time goes and how chunking moves the first packet, not what a GPU
does at full size (the GPU issue). The JSON also records transformers' PCM peak and the largest difference from its
waveform of omnijax's `speak()` of what transformers' talker reads (every answer row but the last token's: Chat
speaks the whole answer, which differs from it when the answer was cut before `<|im_end|>`).

    python -m bench.peers.speech_latency --rounds 5 --out bench/peers/results
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from bench import harness

SIDES = ("omnijax", "transformers")
AFTER_TEXT = "omnijax, talker after the text"  # the arm that waits for the whole answer (Chat before 2b08788)
SYSTEM, QUESTION = "Be brief.", "Say hello to everyone."
FIRST_CHUNKS = (1, 4, 10, 25)
CHUNK = 25
# the tiny release (transformers config dicts); token ids inside the 300-token vocabulary
IDS = dict(audio_token_id=290, image_token_id=291, video_token_id=292, audio_start_token_id=293,
           audio_end_token_id=294, vision_start_token_id=295, vision_end_token_id=296, im_start_token_id=297,
           im_end_token_id=298, position_id_per_seconds=13)
TTS = dict(tts_pad_token_id=280, tts_bos_token_id=281, tts_eos_token_id=282, im_start_token_id=297,
           im_end_token_id=298, system_token_id=283, user_token_id=284, assistant_token_id=285)
SPECIALS = {"<|endoftext|>": 289, "<|audio_pad|>": 290, "<|image_pad|>": 291, "<|video_pad|>": 292,
            "<|audio_start|>": 293, "<|audio_end|>": 294, "<|vision_start|>": 295, "<|vision_end|>": 296,
            "<|im_start|>": 297, "<|im_end|>": 298, "<|tts_pad|>": 280, "<|tts_bos|>": 281, "<|tts_eos|>": 282,
            "system": 283, "user": 284, "assistant": 285}
THINKER = dict(
    text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, norm_topk_prob=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3],
                                      "interleaved": True}),
    audio_config=dict(num_mel_bins=128, d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                      output_dim=64, downsample_hidden_size=8, n_window=50, n_window_infer=200),
    vision_config=dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, patch_size=16,
                       spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                       deepstack_visual_indexes=[0]), **IDS)
TALKER = dict(
    text_config=dict(vocab_size=1100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=16, shared_expert_intermediate_size=24, norm_topk_prob=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1],
                                      "interleaved": True}),
    code_predictor_config=dict(vocab_size=40, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=8, num_code_groups=4),
    num_code_groups=4, thinker_hidden_size=64, accept_hidden_layer=2, spatial_merge_size=2,
    codec_eos_token_id=1080, codec_nothink_id=1091, codec_think_bos_id=1092, codec_think_eos_id=1093,
    codec_pad_id=1094, codec_bos_id=1095, speaker_id={"ethan": 1088, "chelsie": 1089})
CODE2WAV = dict(codebook_size=80, num_quantizers=4, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                sliding_window=8, intermediate_size=32, num_hidden_layers=2, decoder_dim=64,
                upsample_rates=(8, 5, 4, 3), upsampling_ratios=(2, 2))


def build_release(root: Path) -> Path:
    """The tiny release saved by transformers (`root/hf`, with a ChatML tokenizer) and converted (`root/omnijax`)."""
    import torch
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

    from omnijax.convert import convert_checkpoint
    from omnijax.models.tokenizer import CHATML_TEMPLATE, write_tiny_tokenizer

    torch.manual_seed(0)
    full = Qwen3OmniMoeForConditionalGeneration(Qwen3OmniMoeConfig(
        thinker_config=THINKER, talker_config=TALKER, code2wav_config=CODE2WAV, enable_audio_output=True,
        **TTS)).eval()
    with torch.no_grad():  # decisive random weights (the default init gives near-uniform logits)
        for module in (full.talker, full.thinker.model):
            for p in module.parameters():
                p.normal_(0.0, 0.3) if p.ndim > 1 else p.add_(torch.randn_like(p) * 0.2)
        full.thinker.lm_head.weight.normal_(0.0, 0.3)
    full.save_pretrained(root / "hf", safe_serialization=True)
    write_tiny_tokenizer(root / "hf", vocab_size=300, special_tokens=SPECIALS, chat_template=CHATML_TEMPLATE)
    convert_checkpoint(root / "hf", root / "omnijax", progress=False, log=lambda _: None)
    return root


def _omnijax(root: Path, first_chunks, answer_tokens: int, frames: int, pcm_dir: Path) -> list[dict]:
    import warnings

    import omnijax
    from omnijax.chat import SpeakOptions

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = omnijax.load(root / "omnijax")
    config = omnijax.StreamConfig(num_pages=64, page_size=16, max_answer_tokens=16)
    rows = []
    for first in first_chunks:
        options = SpeakOptions(max_speech_tokens=frames + 1, first_chunk=first, chunk=CHUNK)
        for measured in (False, True):
            chat = omnijax.Chat(model, config)
            chat.system(SYSTEM)
            marks, pcm = {}, []
            start = time.perf_counter()
            for item in chat.ask(QUESTION, max_tokens=answer_tokens, speak=options):
                now = time.perf_counter()
                if isinstance(item, str):
                    marks["text"] = now
                else:
                    marks.setdefault("first", now)
                    marks["last"] = now
                    pcm.append(item)
            if measured:
                wave = np.concatenate(pcm)
                np.save(pcm_dir / f"omnijax_{first}.npy", wave)
                rows.append(dict(first_chunk=first, first_pcm_ms=(marks["first"] - start) * 1e3,
                                 last_pcm_ms=(marks["last"] - start) * 1e3,
                                 text_ms=(marks.get("text", start) - start) * 1e3, samples=int(wave.size),
                                 chunks=len(pcm)))
            after = _after_text(model, config, chat.last_spoken, options, answer_tokens)
            if measured:
                assert after.pop("samples_equal"), "the talker after the text spoke other PCM than while it streamed"
                rows.append(dict(after, first_chunk=first, arm=AFTER_TEXT))
    # what transformers speaks: every answer row but the last token's (the whole answer when it ended)
    from omnijax.models.qwen3_omni import speech as qwen3_speech

    spoken = chat.last_spoken
    assert spoken is not None
    ended = chat.text_ids[-1] in model.config.eos_token_ids
    reads = spoken.answer_ids if ended else spoken.answer_ids[:-1]
    if reads:
        np.save(pcm_dir / "omnijax_reference.npy", qwen3_speech.speak(
            model, np.asarray(spoken.prompt_ids), np.asarray(reads), max_new_tokens=frames + 1).pcm)
    return rows


def _after_text(model, config, spoken, options, answer_tokens: int) -> dict:
    """The same answer spoken only once its text is done (how `Chat` spoke before its talker ran beside the
    thinker): `ask` without speech, then `speak_chunks` of the ids the overlapped run spoke (the thinker is greedy,
    so the same answer)."""
    import omnijax

    chat = omnijax.Chat(model, config)
    chat.system(SYSTEM)
    marks, pcm = {}, []
    start = time.perf_counter()
    for _ in chat.ask(QUESTION, max_tokens=answer_tokens):
        marks["text"] = time.perf_counter()
    for item in model.speech.speak_chunks(model, np.asarray(spoken.prompt_ids), np.asarray(spoken.answer_ids),
                                          voice=options.voice, max_new_tokens=options.max_speech_tokens,
                                          first_chunk=options.first_chunk, chunk=options.chunk):
        marks.setdefault("first", time.perf_counter())
        marks["last"] = time.perf_counter()
        pcm.append(item)
    wave = np.concatenate(pcm)
    return dict(first_pcm_ms=(marks["first"] - start) * 1e3, last_pcm_ms=(marks["last"] - start) * 1e3,
                text_ms=(marks.get("text", start) - start) * 1e3, samples=int(wave.size), chunks=len(pcm),
                samples_equal=bool(wave.size == spoken.samples))


def _transformers(root: Path, answer_tokens: int, frames: int, pcm_dir: Path) -> list[dict]:
    import torch
    import transformers
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeForConditionalGeneration

    full = Qwen3OmniMoeForConditionalGeneration.from_pretrained(root / "hf", dtype=torch.float32).eval()
    predictor = full.talker.code_predictor  # its sampling is hard-coded in the talker: made greedy here
    greedy = predictor.generate
    predictor.generate = lambda **kw: greedy(**{**kw, "do_sample": False, "top_k": None, "top_p": None})
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "hf")
    ids = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
                                        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    rows = []
    for measured in (False, True):
        start = time.perf_counter()
        with torch.inference_mode():
            _, wav = full.generate(input_ids=ids["input_ids"], speaker="Ethan", return_audio=True,
                                   thinker_max_new_tokens=answer_tokens, thinker_do_sample=False,
                                   thinker_eos_token_id=TTS["im_end_token_id"], talker_max_new_tokens=frames + 1,
                                   talker_do_sample=False, talker_repetition_penalty=1.0)
        done = time.perf_counter()
        if measured:
            wave = wav.reshape(-1).float().numpy()
            np.save(pcm_dir / "transformers.npy", wave)
            rows.append(dict(first_chunk=0, first_pcm_ms=(done - start) * 1e3, last_pcm_ms=(done - start) * 1e3,
                             text_ms=float("nan"), samples=int(wave.size), chunks=1))
    return rows


def run_one(side: str, root: Path, first_chunks, answer_tokens: int, frames: int, pcm_dir: Path,
            inline: bool = False) -> list[dict]:
    """`side`'s worker in a fresh process (`inline`, a `--smoke` check: in this one, `harness.run_worker`)."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    load = os.getloadavg()[0]
    done = harness.run_worker(harness.module_command(__spec__.name, "--worker", side, "--root", root,
                                                     "--first-chunks", ",".join(map(str, first_chunks)),
                                                     "--answer-tokens", answer_tokens, "--frames", frames,
                                                     "--pcm-dir", pcm_dir),
                              inline=inline, env=env, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{side} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [dict(r, side=r.pop("arm", side), load_avg=load) for r in json.loads(done.stdout.strip().splitlines()[-1])]


def _chunks(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"first chunk sizes are integers >= 1, got {text!r}")
    return values


def main(argv=None) -> int:
    p = harness.parser(__doc__)
    p.add_argument("--rounds", type=int, default=5, help="processes per side (alternating order)")
    p.add_argument("--first-chunks", type=_chunks, default=FIRST_CHUNKS,
                   help="omnijax's first vocoder call sizes in frames, comma-separated (then 25 a call)")
    p.add_argument("--answer-tokens", type=int, default=16, help="the thinker's answer, tokens at most")
    p.add_argument("--frames", type=int, default=50, help="codec frames of speech (80 ms each)")
    p.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--pcm-dir", help=argparse.SUPPRESS)
    args = harness.parse(p, argv, smoke={"rounds": 1, "first_chunks": (4,), "answer_tokens": 4, "frames": 8})
    for name in ("rounds", "answer_tokens", "frames"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.worker:
        root, pcm_dir = Path(args.root), Path(args.pcm_dir)
        rows = (_omnijax(root, args.first_chunks, args.answer_tokens, args.frames, pcm_dir)
                if args.worker == "omnijax" else _transformers(root, args.answer_tokens, args.frames, pcm_dir))
        print(json.dumps(rows))
        return 0
    out = harness.output_dir(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="speech_latency_") as tmp:
        root = build_release(Path(tmp))
        for r in range(args.rounds):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                got = run_one(side, root, args.first_chunks, args.answer_tokens, args.frames, Path(tmp),
                              inline=args.smoke)
                rows += [dict(g, round=r) for g in got]
                print(f"  round {r + 1}/{args.rounds} {side}: " + ", ".join(
                    f"first PCM {g['first_pcm_ms']:.0f} ms" + (f" (first chunk {g['first_chunk']})"
                                                               if side == "omnijax" else "") for g in got),
                      flush=True)
        reference = Path(tmp) / "omnijax_reference.npy"
        mine = np.load(reference) if reference.exists() else np.zeros((0,), np.float32)
        theirs = np.load(Path(tmp) / "transformers.npy")
    summary = summarise(rows)
    peak = float(np.abs(theirs).max()) if theirs.size else 0.0
    same_length = mine.shape == theirs.shape
    diff = float(np.abs(mine - theirs).max()) / peak if same_length and peak > 0 else None
    harness.print_table(summary, [("side", "side", ""), ("first chunk", "first_chunk", "d"),
                                  ("first PCM ms", "first_pcm_ms", ".0f"), ("last PCM ms", "last_pcm_ms", ".0f"),
                                  ("audio s", "audio_s", ".2f"), ("RTF speech", "rtf_speech", ".2f"),
                                  ("RTF total", "rtf_total", ".2f"), ("first PCM / transformers", "vs", ".2f")])
    print(f"omnijax speak() of what transformers reads vs its waveform: {mine.size} vs {theirs.size} samples, max "
          f"|diff| / peak "
          f"{'n/a (lengths differ)' if diff is None else f'{diff:.2e}'}")
    harness.write_json(out, "speech_latency", {
        "rounds": args.rounds, "answer_tokens": args.answer_tokens, "frames": args.frames, "chunk": CHUNK,
        "summary": summary, "rows": rows, "pcm_peak": peak, "max_diff_over_peak": diff, "smoke": bool(args.smoke),
        "load_avg": [r["load_avg"] for r in rows]})
    plot(summary, out)
    return 0


def summarise(rows: list[dict]) -> list[dict]:
    """Medians per (side, first chunk), with the real-time factors and the first PCM relative to transformers'."""
    out = []
    keys = sorted({(r["side"], r["first_chunk"]) for r in rows}, key=lambda k: (k[0] != "transformers", k[1]))
    base = float(np.median([r["first_pcm_ms"] for r in rows if r["side"] == "transformers"]))
    for side, first in keys:
        group = [r for r in rows if (r["side"], r["first_chunk"]) == (side, first)]
        audio = [r["samples"] / 24_000 for r in group]
        med = {k: float(np.median([r[k] for r in group])) for k in ("first_pcm_ms", "last_pcm_ms", "text_ms")}
        speech = [(r["last_pcm_ms"] - r["text_ms"]) / 1e3 / a for r, a in zip(group, audio)] \
            if side != "transformers" else [float("nan")]
        out.append(dict(side=side, first_chunk=first, **med, audio_s=float(np.median(audio)),
                        rtf_speech=float(np.median(speech)),
                        rtf_total=float(np.median([r["last_pcm_ms"] / 1e3 / a for r, a in zip(group, audio)])),
                        vs=med["first_pcm_ms"] / base, runs=len(group)))
    return out


def plot(summary: list[dict], out: Path) -> None:
    plt = harness.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    ours = [s for s in summary if s["side"] == "omnijax"]
    theirs = next(s for s in summary if s["side"] == "transformers")
    x = [s["first_chunk"] for s in ours]
    a.plot(x, [s["first_pcm_ms"] for s in ours], "o-", label="omnijax: first PCM chunk")
    a.axhline(theirs["first_pcm_ms"], color="C3", ls="--", label="transformers: whole waveform")
    a.set_xlabel("first vocoder call (codec frames of 80 ms)")
    a.set_ylabel("ms after the question")
    a.set_title("first audio packet (tiny Qwen3-Omni, CPU)")
    a.legend()
    b.plot(x, [s["rtf_total"] for s in ours], "o-", label="omnijax, total")
    b.plot(x, [s["rtf_speech"] for s in ours], "s-", label="omnijax, talker + vocoder")
    b.axhline(theirs["rtf_total"], color="C3", ls="--", label="transformers, total")
    b.axhline(1.0, color="gray", lw=0.8)
    b.set_xlabel("first vocoder call (codec frames)")
    b.set_ylabel("real-time factor (lower is faster)")
    b.legend()
    fig.tight_layout()
    harness.save_png(fig, out, "speech_latency")


if __name__ == "__main__":
    raise SystemExit(main())
