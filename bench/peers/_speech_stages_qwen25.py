"""Qwen2.5-Omni's spoken answer stage by stage for `bench.peers.speech_stages` (issue 39 item 5): the thinker, the
talker, Token2Wav's DiT and its BigVGAN, each timed on CPU on a tiny seeded release whose codec runs at the
release's rates (50 codec tokens an audio second: DiT blocks of 24 mel frames, 2 a token, BigVGAN's 240 samples a
frame at 24 kHz), so a stage's seconds per audio second read as its real-time factor.

    thinker     `Chat.ask` of the question without speech; per token = the answer's time / its tokens (an upper
                bound); its RTF at one text token per codec token would be meaningless (the talker reads the whole
                answer first, 50 codec tokens a second), so the row gives the answer's time, spent once before
                the talker starts
    talker      `talker_forward.greedy_tokens` (the spoken path's): its prefill, then one step a codec token, the
                stop ids suppressed so it runs `--frames` tokens
    DiT         `Token2WavStream`'s ODE solves (`_solve` of token2wav_stream: 10 steps, RK4, a window of blocks)
    BigVGAN     `Token2WavStream`'s vocoder calls (`vocode`), timed apart by wrapping the two functions the stream
                calls
    first packet  thinker answer + talker prefill + the talker steps until the first PCM + the DiT and BigVGAN
                calls that made it (serial); streamed with `first_chunk` 4 then 25 codec tokens (2 then 3 DiT
                blocks), the speech output's look-ahead (2 blocks) and the vocoder's whole reach

Tiny weights on CPU: where the time goes, not a GPU or full-size figure.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np

from bench import harness

QUESTION, SYSTEM = "Say hello.", "Be brief."
FIRST_CHUNK, CHUNK = 4, 25  # SpeakOptions' defaults, in codec tokens
CODEC = dict(tts_codec_pad_token_id=58, tts_codec_start_token_id=59, tts_codec_end_token_id=60,
             tts_codec_mask_token_id=61)
VOICES = {"Chelsie": 253, "Ethan": 254}
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
AUDIO = dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, n_window=100, output_dim=64,
             num_mel_bins=128)
VISION = dict(hidden_size=32, depth=1, num_heads=2, intermediate_size=48, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2, fullatt_block_indexes=[0], out_hidden_size=64)
TALKER = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, embedding_size=64, tts_text_start_token_id=250,
              tts_text_end_token_id=251, tts_text_pad_token_id=252,
              rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1]}, **CODEC)
# the release's block (24 frames), repeats (2) and mel width (80); BigVGAN at its 240 samples a mel frame
DIT = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=8, ff_mult=2, emb_dim=16, block_size=24,
           look_ahead_layers=[1], look_backward_layers=[0, 3], repeats=2, num_embeds=64, mel_dim=80, enc_emb_dim=12,
           enc_dim=10, enc_channels=[16, 16, 16, 32], enc_kernel_sizes=[5, 3, 3, 1], enc_dilations=[1, 2, 3, 1],
           enc_attention_channels=8, enc_res2net_scale=4, enc_se_channels=8, max_position_embeddings=8192)
BIGVGAN = dict(mel_dim=80, upsample_initial_channel=64, resblock_kernel_sizes=[3, 5],
               resblock_dilation_sizes=[[1, 3, 5], [1, 2, 4]], upsample_rates=[5, 3, 2, 2, 2, 2],
               upsample_kernel_sizes=[11, 7, 4, 4, 4, 4])


def build_release(root: Path) -> Path:
    """The tiny release saved by transformers (`root/hf25`, with its voices and a ChatML tokenizer), converted to
    `root/omnijax25`; returns the latter."""
    import torch
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniForConditionalGeneration
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniThinkerConfig

    from omnijax.convert import convert_checkpoint
    from omnijax.models.tokenizer import CHATML_TEMPLATE, write_tiny_tokenizer
    from omnijax.testing.checkpoints import HF_TOKEN_KEYS, special_tokens, tiny_token_ids

    ids = tiny_token_ids(TEXT["vocab_size"])
    thinker = Qwen2_5OmniThinkerConfig(text_config=TEXT, audio_config=AUDIO, vision_config=VISION,
                                       **{key: getattr(ids, f) for f, key in HF_TOKEN_KEYS.items()},
                                       im_start_token_id=ids.im_start_token_id, im_end_token_id=ids.im_end_token_id,
                                       tie_word_embeddings=False)
    torch.manual_seed(0)
    full = Qwen2_5OmniForConditionalGeneration(Qwen2_5OmniConfig(
        thinker_config=thinker.to_dict(), talker_config=TALKER,
        token2wav_config=dict(dit_config=DIT, bigvgan_config=BIGVGAN), enable_audio_output=True)).eval()
    with torch.no_grad():  # decisive random weights (the default init gives near-uniform logits)
        for module in (full.talker, full.thinker.model):
            for p in module.parameters():
                p.normal_(0.0, 0.3) if p.ndim > 1 else p.add_(torch.randn_like(p) * 0.2)
        full.thinker.lm_head.weight.normal_(0.0, 0.3)
    src = root / "hf25"
    full.save_pretrained(src, safe_serialization=True)
    gen = torch.Generator().manual_seed(7)
    torch.save({name: {"cond": torch.randn(1, DIT["enc_emb_dim"], generator=gen),
                       "ref_mel": (torch.randn(1, 60, DIT["mel_dim"], generator=gen) - 3.0).to(torch.bfloat16),
                       "bos_token": bos} for name, bos in VOICES.items()}, src / "spk_dict.pt")
    write_tiny_tokenizer(src, vocab_size=TEXT["vocab_size"], special_tokens=special_tokens(ids),
                         chat_template=CHATML_TEMPLATE)
    return convert_checkpoint(src, root / "omnijax25", progress=False, log=lambda _: None)


def _clock():
    return time.perf_counter(), harness.cpu_seconds()


def _since(mark) -> tuple[float, float]:
    wall, cpu = _clock()
    return wall - mark[0], cpu - mark[1]


def _ask(model, answer_tokens: int, speak=False):
    import omnijax

    chat = omnijax.Chat(model, omnijax.StreamConfig(num_pages=64, page_size=16, max_answer_tokens=16))
    chat.system(SYSTEM)
    mark = _clock()
    for _ in chat.ask(QUESTION, max_tokens=answer_tokens, speak=speak):
        pass
    return chat, _since(mark)


def one_round(model, prompt: np.ndarray, answer: np.ndarray, frames: int, answer_tokens: int) -> dict:
    """Every stage once: the thinker's answer, then the talker's tokens streamed into Token2Wav as the spoken path
    does (`token2wav_stream.talker_pcm`), the talker's, DiT's and BigVGAN's calls timed apart."""
    import jax

    from omnijax.models.qwen2_5_omni import speech as S
    from omnijax.models.qwen2_5_omni import talker_forward
    from omnijax.models.qwen2_5_omni import token2wav_stream as ts

    _, thinker = _ask(model, answer_tokens)
    speech = model.speech
    voice = speech.voice("Ethan")
    made = S.talker_input(model, prompt, answer, voice)
    config = speech.talker.config
    times: dict = {"talker": [], "dit": [], "bigvgan": []}
    solve, vocode = ts._solve, ts.vocode

    def timed(name, fn):
        def run(*args, **kwargs):
            mark = _clock()
            out = jax.block_until_ready(fn(*args, **kwargs))
            times[name].append((*_since(mark), time.perf_counter()))
            return out
        return run

    tokens = talker_forward.greedy_tokens(
        config, speech.params, made.rows, made.positions, made.trailing, made.text_pad, prompt_ids=made.prompt_ids,
        max_new_tokens=frames + 1, suppress=[config.codec_bos_id, *config.stop_ids])  # never ends before the limit

    def talker():
        while True:
            mark = _clock()
            token = next(tokens, None)
            if token is None:
                return
            times["talker"].append((*_since(mark), time.perf_counter()))
            yield token

    streaming = ts.Token2WavStreaming.for_tokens(speech.token2wav.config.dit, FIRST_CHUNK, CHUNK,
                                                 right_blocks=speech.streaming.right_blocks)
    stream = ts.Token2WavStream(speech.token2wav, voice.conditioning, voice.reference_mel, streaming=streaming)
    ts._solve, ts.vocode = timed("dit", solve), timed("bigvgan", vocode)
    try:
        start = time.perf_counter()
        chunks = [(time.perf_counter(), pcm.size) for pcm in ts.talker_pcm(talker(), stream)]
    finally:
        ts._solve, ts.vocode = solve, vocode
    samples = sum(n for _, n in chunks)
    assert samples == frames * speech.token2wav.config.samples_per_token, (samples, frames)
    first = chunks[0][0]
    before = {k: sum(t[0] for t in v if t[2] <= first) for k, v in times.items()}
    return dict(thinker=thinker, answer=len(answer), talker=times["talker"], dit=times["dit"],
                bigvgan=times["bigvgan"], samples=samples, first_pcm_s=first - start, before_first=before)


def spoken_ids(model, answer_tokens: int) -> tuple[np.ndarray, int, np.ndarray]:
    """`(prompt, tokens generated, answer spoken)`: the greedy answer `Chat` decodes for the question, spoken up to
    its first special token (an end of turn, or a media placeholder the random thinker may write: an answer is
    text)."""
    from omnijax.chunks.spans import SpanKind

    chat, _ = _ask(model, answer_tokens)
    n = chat.units[-1].fed[int(SpanKind.RESPONSE)]
    ids = list(chat.text_ids)
    prompt, generated = np.asarray(ids[:-n]), ids[-n:]
    special = {*model.speech.placeholders.values(), model.speech.im_end_token_id, *model.config.eos_token_ids}
    cut = next((i for i, t in enumerate(generated) if t in special), len(generated))
    assert cut > 0, f"the thinker's answer starts with a special token: {generated}"
    return prompt, n, np.asarray(generated[:cut])


def measure(root: Path, rounds: int, frames: int, answer_tokens: int) -> tuple[list[dict], dict]:
    """Stage rows (medians over `rounds` after one compiling round) and the details."""
    import omnijax

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = omnijax.load(build_release(root))
    prompt, generated, answer = spoken_ids(model, answer_tokens)
    runs = []
    for r in range(rounds + 1):  # round 0 compiles, unmeasured
        got = one_round(model, prompt, answer, frames, answer_tokens)
        if r:
            runs.append(got)
        print(f"  Qwen2.5-Omni round {r}/{rounds}{' (compile)' if r == 0 else ''}: first PCM after the talker "
              f"started {got['first_pcm_s'] * 1e3:.0f} ms, {got['samples']} samples", flush=True)
    rate = model.speech.sample_rate
    audio_s = runs[0]["samples"] / rate
    med = lambda xs: float(np.median(xs))  # noqa: E731
    rows = []
    for i, unit in enumerate(("wall", "cpu")):
        per = {"talker": med([sum(t[i] for t in g["talker"]) for g in runs]) / audio_s,
               "DiT": med([sum(t[i] for t in g["dit"]) for g in runs]) / audio_s,
               "BigVGAN": med([sum(t[i] for t in g["bigvgan"]) for g in runs]) / audio_s}
        thinker = med([g["thinker"][i] for g in runs])
        rows.append(dict(stage="thinker (answer, once)", clock=unit, seconds=thinker, rtf=None,
                         ms_per_token=thinker / generated * 1e3))
        for stage, rtf in per.items():
            rows.append(dict(stage=stage, clock=unit, seconds=rtf * audio_s, rtf=rtf,
                             ms_per_token=rtf * audio_s / frames * 1e3))
        rows.append(dict(stage="talker + DiT + BigVGAN", clock=unit, seconds=sum(per.values()) * audio_s,
                         rtf=sum(per.values()), ms_per_token=sum(per.values()) * audio_s / frames * 1e3))
    prefill = med([g["talker"][0][0] for g in runs])
    first = med([g["thinker"][0] + sum(g["before_first"].values()) for g in runs])
    detail = dict(frames=frames, audio_s=audio_s, answer_tokens=generated, spoken_tokens=len(answer),
                  talker_prefill_ms=prefill * 1e3,
                  first_packet_ms=first * 1e3, first_pcm_after_talker_ms=med([g["first_pcm_s"] for g in runs]) * 1e3,
                  dit_calls=len(runs[0]["dit"]), bigvgan_calls=len(runs[0]["bigvgan"]),
                  first_chunk=FIRST_CHUNK, chunk=CHUNK, codec_tokens_per_s=rate / (audio_s * rate / frames))
    return rows, detail
