"""Decoding Qwen3-Omni Code2Wav (`code2wav.py`): one shot, streamed with carried state, or re-decoded in chunks.

All three run one pure function, `decode_frames(params, config, codes [B, Q, n], state) -> (wav, state)`: it
decodes the next n frames after `state` (`Code2WavState`, an immutable pytree) and returns the samples that follow
the previous calls' -- n * F of them (F = `samples_per_frame`, 1,920), or n * F - lag on the first call (lag = 555
for the release: the transposed convs' one-step look-ahead, `Code2WavConfig.lag`). The state holds the last W - 1
keys/values of each attention layer, the last `(k - 1) * dilation` inputs of each causal conv and the last input of
each decoder block's transposed conv: bounded, whatever the length (`Code2WavState`).

- `decode(model, codes)`: one call from `init_state` -- what transformers' `Qwen3OmniMoeCode2Wav(codes)` returns.
- `Code2WavStream`: `push(codes)` per chunk, the state carried between calls; the concatenated chunks equal
  `decode` on all the codes, whatever the chunk sizes (first 4 frames, then 25, say), with no recomputation.
- `decode_chunked(model, codes, first_chunk, chunk, left_context)`: stateless, as upstream's `chunked_decode`:
  each chunk is decoded again from scratch with `left_context` frames before it, and the last `chunk * F` samples
  are kept. Upstream keeps everything after `left_context * F` instead, which -- as every decode returns `lag`
  samples fewer than `frames * F` -- leaves a `lag`-sample (23 ms) hole at every boundary. Exact only when the left
  context covers the receptive field (`min_left_context`: `num_hidden_layers * (sliding_window - 1)` frames of
  attention plus the convs' reach: 578 frames = 46 s for the release, so it costs ~24x the streamed decode at
  chunks of 25); a shorter one is refused, naming the minimum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from omnijax.kept_executables import cached_jit
from omnijax.kv.rope import apply_rope, rope_angles
from omnijax.models.encoders.common import dense, layer_norm
from omnijax.models.layers import rms_norm
from omnijax.models.qwen3_omni.code2wav import DILATIONS, KERNEL, Code2Wav, Code2WavConfig

__all__ = ["Code2WavStream", "Code2WavState", "FrameChunks", "check_codes", "decode", "decode_chunked",
           "decode_frames", "decode_streamed", "earliest_frame", "init_state", "min_left_context", "model_params"]

# ------------------------------------------------------------------------------------------------------- state


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Code2WavState:
    """What a decode call leaves for the next one (immutable; `decode_frames` returns a new one).

    Attributes:
        position: `[]` int32, frames decoded so far (the RoPE position of the next frame).
        keys: `[L, B, W - 1, kv_heads, head_dim]` the last W - 1 frames' rotated keys per layer (slots before
            position 0 are masked out).
        values: same shape, their values.
        carries: per causal conv, its last `(k - 1) * dilation` inputs `[B, r, C]` (zeros before the start, which is
            the reference's zero padding); per decoder block `block{b}.up`, the transposed conv's last input
            `[B, 1, C]`.
        started: a call has run (static): the transposed convs then prepend their carried input.
    """

    position: jax.Array
    keys: jax.Array
    values: jax.Array
    carries: dict[str, jax.Array]
    started: bool = dataclasses.field(default=False, metadata=dict(static=True))


def _carry_widths(config: Code2WavConfig) -> dict[str, tuple[int, int]]:
    """Name -> (carried inputs, channels) of every carry, in network order."""
    c, D = config, config.hidden_size
    widths = {f"up{j}.dw": (KERNEL - 1, D) for j in range(len(c.upsampling_ratios))}
    widths["conv_in"] = (KERNEL - 1, D)
    for b in range(len(c.upsample_rates)):
        widths[f"block{b}.up"] = (1, c.channels(b))
        for u, d in enumerate(DILATIONS):
            widths[f"block{b}.res{u}"] = ((KERNEL - 1) * d, c.channels(b + 1))
    widths["conv_out"] = (KERNEL - 1, c.channels(len(c.upsample_rates)))
    return widths


def init_state(config: Code2WavConfig, batch: int = 1) -> Code2WavState:
    """The state before the first frame: zero carries, an empty (fully masked) attention window."""
    dt = config.jnp_dtype
    cache = (config.num_hidden_layers, batch, config.sliding_window - 1, config.num_key_value_heads, config.head_dim)
    return Code2WavState(position=jnp.zeros((), jnp.int32), keys=jnp.zeros(cache, dt), values=jnp.zeros(cache, dt),
                         carries={k: jnp.zeros((batch, n, ch), dt) for k, (n, ch) in _carry_widths(config).items()})


# -------------------------------------------------------------------------------------------------------- math

_F32 = jnp.float32


def _snake(x: jax.Array, alpha: jax.Array, beta: jax.Array) -> jax.Array:
    """SnakeBeta on `[B, n, C]`: `x + sin(x * e^alpha)^2 / (e^beta + 1e-9)` per channel, in float32."""
    xf = x.astype(_F32)
    return (xf + jnp.sin(xf * jnp.exp(alpha.astype(_F32))) ** 2 / (jnp.exp(beta.astype(_F32)) + 1e-9)).astype(x.dtype)


def _causal_conv(x: jax.Array, kernel: jax.Array, bias: jax.Array, carry: jax.Array, *, dilation: int = 1,
                 groups: int = 1) -> tuple[jax.Array, jax.Array]:
    """Causal Conv1d: `x [B, n, Cin]` after the carried inputs `carry [B, r, Cin]`, r = (k - 1) * dilation,
    kernel `[Cout, Cin / groups, k]` -> (`[B, n, Cout]`, the new carry: the last r inputs)."""
    r = carry.shape[1]
    xc = jnp.concatenate([carry, x], axis=1)  # [B, r + n, Cin]
    y = jax.lax.conv_general_dilated(xc, kernel.transpose(2, 1, 0), (1,), "VALID", rhs_dilation=(dilation,),
                                     dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=groups,
                                     preferred_element_type=_F32)
    return (y + bias.astype(_F32)).astype(x.dtype), xc[:, xc.shape[1] - r:]


def _trans_conv(x: jax.Array, kernel: jax.Array, bias: jax.Array, stride: int) -> jax.Array:
    """The reference's trimmed transposed conv, kernel `[Cin, Cout, K]`, K = s or 2s (s = stride).

    K = s: `[B, n, Cin]` -> `[B, n * s, Cout]`, output q*s + j = x[q] @ w[:, :, j].
    K = 2s: -> `[B, (n - 1) * s, Cout]`, output q*s + j = x[q] @ w[:, :, s + j] + x[q + 1] @ w[:, :, j] (the
    transposed conv's full output with K - s trimmed from each end).
    """
    B, n, _ = x.shape
    s, k = stride, kernel.shape[-1]
    if k == s:
        y = jnp.einsum("bnc,cos->bnso", x, kernel, preferred_element_type=_F32)  # [B, n, s, Cout]
    elif k == 2 * s:
        y = (jnp.einsum("bnc,cos->bnso", x[:, :-1], kernel[..., s:], preferred_element_type=_F32)
             + jnp.einsum("bnc,cos->bnso", x[:, 1:], kernel[..., :s], preferred_element_type=_F32))
    else:
        raise ValueError(f"transposed conv kernel {k} is neither the stride {s} nor twice it")
    return (y.reshape(B, -1, kernel.shape[1]) + bias.astype(_F32)).astype(x.dtype)


def _layer(x: jax.Array, p: Mapping[str, jax.Array], cache_k: jax.Array, cache_v: jax.Array, rot: jax.Array,
           allowed: jax.Array, config: Code2WavConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One pre-transformer layer on `[B, n, D]` after the cached window `cache_k/v [B, W - 1, kv_heads, hd]`.

    `rot [n, hd / 2]` are the new frames' RoPE angles; `allowed [n, W - 1 + n]` which keys each frame reads.
    Returns the output and the window's last W - 1 keys and values (rotated keys).
    """
    c, dt = config, config.jnp_dtype
    B, n, _ = x.shape
    H, G, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    a = rms_norm(x, p["input_norm"], c.rms_norm_eps)
    q = apply_rope(dense(a, p["q_proj"], p.get("q_bias"), dt).reshape(B, n, G, H // G, hd), rot[:, None])
    k = apply_rope(dense(a, p["k_proj"], p.get("k_bias"), dt).reshape(B, n, G, hd), rot)
    v = dense(a, p["v_proj"], p.get("v_bias"), dt).reshape(B, n, G, hd)
    keys = jnp.concatenate([cache_k, k], axis=1)  # [B, W - 1 + n, G, hd]
    values = jnp.concatenate([cache_v, v], axis=1)
    scores = jnp.einsum("bqgrd,bkgd->bgrqk", q, keys, preferred_element_type=_F32) * hd ** -0.5
    probs = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1).astype(dt)  # a frame always sees itself
    attn = jnp.einsum("bgrqk,bkgd->bqgrd", probs, values, preferred_element_type=_F32).astype(dt)
    x = x + p["attn_scale"] * dense(attn.reshape(B, n, H * hd), p["o_proj"], p.get("o_bias"), dt)
    m = rms_norm(x, p["post_norm"], c.rms_norm_eps)
    gate = dense(m, p["gate_proj"], None, dt)
    mlp = dense((jax.nn.silu(gate.astype(_F32)) * dense(m, p["up_proj"], None, _F32)).astype(dt), p["down_proj"],
                None, dt)
    W1 = cache_k.shape[1]
    return x + p["mlp_scale"] * mlp, keys[:, keys.shape[1] - W1:], values[:, values.shape[1] - W1:]


def decode_frames(params: Mapping[str, Any], config: Code2WavConfig, codes: jax.Array,
                  state: Code2WavState) -> tuple[jax.Array, Code2WavState]:
    """Decodes the next `n` frames after `state` (pure; jit it with `config` static).

    Args:
        params: the pure-dict parameter tree (`nnx.to_pure_dict(nnx.state(model))`).
        config: the model's config.
        codes: `[B, Q, n]` int32 codes, each in `[0, codebook_size)` (not checked here: `decode` checks).
        state: what the previous call returned, or `init_state`.

    Returns:
        `(wav, state)`: `wav [B, n * F]` float in [-1, 1] (`[B, n * F - lag]` on the first call), the samples that
        follow the previous calls' (their concatenation equals one call on all the frames), and the next state.
    """
    c, dt = config, config.jnp_dtype
    B, Q, n = codes.shape
    D, W = c.hidden_size, c.sliding_window
    offsets = (jnp.arange(Q, dtype=jnp.int32) * c.codebook_size)[None, :, None]
    h = jnp.take(params["embedding"], codes.astype(jnp.int32) + offsets, axis=0).mean(axis=1).astype(dt)  # [B, n, D]

    qpos = state.position + jnp.arange(n, dtype=jnp.int32)  # [n]
    kpos = state.position - (W - 1) + jnp.arange(W - 1 + n, dtype=jnp.int32)  # [W - 1 + n]
    allowed = (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - W) & (kpos[None] >= 0)
    rot = rope_angles(qpos[None], c.head_dim, c.rope_theta, None)  # [n, hd / 2]

    def layer(x, xs):
        p, ck, cv = xs
        x, k, v = _layer(x, p, ck, cv, rot, allowed, c)
        return x, (k, v)

    h, (keys, values) = jax.lax.scan(layer, h, (params["layers"], state.keys, state.values))
    h = rms_norm(h, params["norm"], c.rms_norm_eps)  # [B, n, D]

    old, new = state.carries, {}
    for j, s in enumerate(c.upsampling_ratios):
        p = params[f"up{j}"]
        h = _trans_conv(h, p["conv_kernel"], p["conv_bias"], s)  # [B, n * s, D]
        y, new[f"up{j}.dw"] = _causal_conv(h, p["dw_kernel"], p["dw_bias"], old[f"up{j}.dw"], groups=D)
        y = layer_norm(y, p["ln_scale"], p["ln_bias"], eps=1e-6)
        y = dense(jax.nn.gelu(dense(y, p["fc1"], p["fc1_bias"], _F32), approximate=False).astype(dt), p["fc2"],
                  p["fc2_bias"], dt)
        h = h + p["gamma"] * y

    h, new["conv_in"] = _causal_conv(h, params["conv_in_kernel"], params["conv_in_bias"], old["conv_in"])
    for b, r in enumerate(c.upsample_rates):
        p = params[f"block{b}"]
        h = _snake(h, p["alpha"], p["beta"])
        if state.started:  # the first output of this call reads the previous call's last input
            h = jnp.concatenate([old[f"block{b}.up"], h], axis=1)
        new[f"block{b}.up"] = h[:, h.shape[1] - 1:]
        h = _trans_conv(h, p["up_kernel"], p["up_bias"], r)  # [B, (m - 1) * r, C_b+1]
        for u, d in enumerate(DILATIONS):
            q, name = p[f"res{u}"], f"block{b}.res{u}"
            y, new[name] = _causal_conv(_snake(h, q["alpha1"], q["beta1"]), q["conv1_kernel"], q["conv1_bias"],
                                        old[name], dilation=d)
            h = h + dense(_snake(y, q["alpha2"], q["beta2"]), q["conv2_kernel"][:, :, 0].T, q["conv2_bias"], dt)
    h = _snake(h, params["out_alpha"], params["out_beta"])
    h, new["conv_out"] = _causal_conv(h, params["conv_out_kernel"], params["conv_out_bias"], old["conv_out"])
    wav = jnp.clip(h[..., 0], -1.0, 1.0)  # [B, samples]
    return wav, Code2WavState(position=state.position + n, keys=keys, values=values, carries=new, started=True)


@cached_jit(static_argnames=("config",))
def _decode_frames(params, codes, state, config):
    return decode_frames(params, config, codes, state)


def check_codes(config: Code2WavConfig, codes: Any) -> np.ndarray:
    """`codes` as an int32 `[B, Q, n]` array (a `[Q, n]` input gains the batch axis).

    Raises:
        ValueError: not integers, not 2D/3D, a codebook count other than the config's, no frame, or a code outside
            `[0, codebook_size)` (naming the first such code's position).
    """
    arr = np.asarray(codes)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"codes must be integers shaped [batch, num_quantizers, frames], got {arr.dtype} "
                         f"{np.shape(codes)}")
    if arr.shape[1] != config.num_quantizers:
        raise ValueError(f"codes have {arr.shape[1]} codebooks but the model has num_quantizers="
                         f"{config.num_quantizers}")
    if arr.shape[2] < 1:
        raise ValueError("codes hold no frame")
    bad = np.argwhere((arr < 0) | (arr >= config.codebook_size))
    if len(bad):
        b, q, t = bad[0]
        raise ValueError(f"code {int(arr[b, q, t])} at (batch {b}, codebook {q}, frame {t}) is outside "
                         f"[0, codebook_size={config.codebook_size})")
    return arr.astype(np.int32)


def model_params(model: Code2Wav) -> dict[str, Any]:
    """The model's pure-dict parameter tree, what `decode_frames` reads."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def decode(model: Code2Wav, codes: Any) -> jax.Array:
    """One-shot decode, what transformers' `Qwen3OmniMoeCode2Wav(codes)` returns (jitted; one compile per shape).

    Args:
        model: the decoder.
        codes: `[B, Q, T]` (or `[Q, T]`) integer codes.

    Returns:
        `[B, T * F - lag]` waveform in [-1, 1] at 24 kHz (`output_length(config, T)` samples).
    """
    arr = check_codes(model.config, codes)
    wav, _ = _decode_frames(model_params(model), jnp.asarray(arr), init_state(model.config, arr.shape[0]),
                            model.config)
    return wav




# ---------------------------------------------------------------------------------------------------- streaming


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class Code2WavStream:
    """Decodes one batch of utterances chunk by chunk, carrying `Code2WavState` between chunks.

    `push(codes)` returns exactly `n * F` new samples for n frames (the first push `n * F - lag`: the last `lag`
    samples of a prefix need the next frame), and the pushes concatenated equal `decode` on all the codes. Any
    chunk sizes work (no left context to choose: the state is the exact context); each distinct chunk size compiles
    once for the first push and once for later ones.
    """

    def __init__(self, model: Code2Wav, batch: int = 1):
        self.config: Code2WavConfig = model.config
        self._params = model_params(model)
        self.state: Code2WavState = init_state(self.config, _check_positive("batch", batch))
        self.batch = batch

    @property
    def frames(self) -> int:
        """Frames pushed so far."""
        return int(self.state.position)

    def push(self, codes: Any) -> jax.Array:
        """Decodes the next frames `[B, Q, n]` (or `[Q, n]` for a batch of one) -> `[B, samples]`.

        Raises:
            ValueError: bad codes (see `check_codes`) or another batch size than the stream's; the state is unchanged.
        """
        arr = check_codes(self.config, codes)
        if arr.shape[0] != self.batch:
            raise ValueError(f"codes have batch {arr.shape[0]} but the stream was opened for batch {self.batch}")
        wav, self.state = _decode_frames(self._params, jnp.asarray(arr), self.state, self.config)
        return wav


class FrameChunks:
    """Codec frames `[Q]` handed in one at a time (`add`), decoded by a batch-one `Code2WavStream` as soon as
    `first_chunk` frames are ready, then each further `chunk`; `flush` decodes what is left. The PCM returned,
    concatenated, equals `decode` on all the frames."""

    def __init__(self, model: Code2Wav, first_chunk: int, chunk: int):
        self.first_chunk, self.chunk = _check_positive("first_chunk", first_chunk), _check_positive("chunk", chunk)
        self.stream = Code2WavStream(model)
        self._ready: list[np.ndarray] = []

    def add(self, frame: np.ndarray) -> np.ndarray | None:
        """Queues one frame; returns a chunk's float32 PCM `[samples]` when a chunk is complete, else None."""
        self._ready.append(frame)
        return self.flush() if len(self._ready) == (self.first_chunk if self.stream.frames == 0 else self.chunk) \
            else None

    def flush(self) -> np.ndarray | None:
        """Decodes the queued frames (None when none are queued)."""
        if not self._ready:
            return None
        pcm = np.asarray(self.stream.push(np.stack(self._ready, axis=1)), np.float32)[0]
        self._ready = []
        return pcm


def _schedule(frames: int, first_chunk: int, chunk: int) -> list[tuple[int, int]]:
    """`(start, end)` frame ranges: `first_chunk` frames, then `chunk` at a time (the last may be shorter)."""
    bounds, start = [], 0
    while start < frames:
        end = min(start + (first_chunk if start == 0 else chunk), frames)
        bounds.append((start, end))
        start = end
    return bounds


def decode_streamed(model: Code2Wav, codes: Any, *, first_chunk: int = 4, chunk: int = 25) -> Iterator[jax.Array]:
    """`Code2WavStream` over `codes [B, Q, T]` in chunks of `first_chunk`, then `chunk` frames; yields each
    chunk's samples. Arguments are checked before the first chunk (at the call, not at the first `next`)."""
    first_chunk, chunk = _check_positive("first_chunk", first_chunk), _check_positive("chunk", chunk)
    arr = check_codes(model.config, codes)
    stream = Code2WavStream(model, arr.shape[0])
    return (stream.push(arr[..., a:b]) for a, b in _schedule(arr.shape[-1], first_chunk, chunk))


def earliest_frame(config: Code2WavConfig, sample: int) -> int:
    """The earliest frame of a decode's input that output sample `sample` depends on -- through full attention
    windows and without reaching the convs' zero padding -- walking the network backwards (negative: it reaches
    before the input's start, so it differs from a decode that had earlier frames)."""
    m = sample - (KERNEL - 1)  # conv_out
    for r in reversed(config.upsample_rates):
        m -= sum((KERNEL - 1) * d for d in DILATIONS)  # residual units (their k=1 convs reach nothing)
        m //= r  # transposed conv: output q * r + j reads inputs q and q + 1
    m -= KERNEL - 1  # conv_in
    for s in reversed(config.upsampling_ratios):
        m -= KERNEL - 1  # ConvNeXt depthwise conv
        m //= s
    return m - config.num_hidden_layers * (config.sliding_window - 1)  # each layer reads W - 1 earlier frames


def min_left_context(config: Code2WavConfig) -> int:
    """Smallest left context (frames) for which `decode_chunked`'s chunks equal the one-shot decode: its first kept
    sample, `left_context * F - lag` into the re-decoded window, must not depend on anything before the window."""
    F, lag = config.samples_per_frame, config.lag
    c = 0
    while earliest_frame(config, c * F - lag) < 0:
        c += 1
    return c


def decode_chunked(model: Code2Wav, codes: Any, *, first_chunk: int = 4, chunk: int = 25,
                   left_context: int | None = None) -> Iterator[jax.Array]:
    """Stateless chunked decode: each chunk is decoded from scratch with up to `left_context` frames before it, and
    its last `n * F` samples are kept (the first chunk: all `n * F - lag`). Equals `decode` sample for sample.

    Costs `(left_context + chunk) / chunk` times the streamed decode (`Code2WavStream` carries state instead).
    Compiles once per distinct window length (the windows grow until `left_context` frames precede the chunk).

    Args:
        model: the decoder.
        codes: `[B, Q, T]` (or `[Q, T]`) codes.
        first_chunk: frames of the first chunk.
        chunk: frames of each later chunk.
        left_context: frames re-decoded before each chunk; None: `min_left_context(config)`.

    Raises:
        ValueError: a chunk size below one frame, a left context below `min_left_context` (named), or bad codes --
            all at the call, before any chunk.
    """
    first_chunk, chunk = _check_positive("first_chunk", first_chunk), _check_positive("chunk", chunk)
    need = min_left_context(model.config)
    context = need if left_context is None else left_context
    if isinstance(context, bool) or not isinstance(context, (int, np.integer)) or context < need:
        raise ValueError(f"left_context={left_context!r} frames is below the Code2Wav receptive field: chunks equal "
                         f"the one-shot decode only with left_context >= {need} frames")
    arr = check_codes(model.config, codes)
    params, config, F = model_params(model), model.config, model.config.samples_per_frame

    def chunks():
        for start, end in _schedule(arr.shape[-1], first_chunk, chunk):
            ctx = min(start, context)
            window = jnp.asarray(arr[..., start - ctx:end])
            wav, _ = _decode_frames(params, window, init_state(config, arr.shape[0]), config)
            yield wav if start == 0 else wav[:, wav.shape[1] - (end - start) * F:]

    return chunks()
