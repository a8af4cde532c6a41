"""`tokenizer.json` + `tokenizer_config.json` from a GGUF file's tokenizer metadata (`tokenizer.ggml.*`,
`tokenizer.chat_template`), built with the `tokenizers` library so that `omnijax.models.tokenizer.Tokenizer` (and
transformers' `AutoTokenizer` on the converted directory) encode as transformers 5.2.0 does on the GGUF file itself
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, `encode(..., add_special_tokens=False)`).

The backends follow transformers' GGUF converters (`transformers.integrations.ggml`):

- `tokenizer.ggml.model` "gpt2" under the `llama` architecture (SmolLM2, Llama 3): byte-level BPE on the GGUF's
  merges, byte fallback, GPT-2 split pattern; the tokens of type 3 (control) are special added tokens.
- "gpt2" under `qwen2` / `qwen3` / `qwen3moe`: byte-level BPE with the Qwen2 split pattern and NFC normalisation;
  `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` are the special added tokens.
- "llama" (SentencePiece BPE: Llama 2, Mistral): BPE on the scores (merges rebuilt from them when the file has
  none), byte fallback, spaces as U+2581 with a prefix space unless `tokenizer.ggml.add_space_prefix` is false; the
  control tokens are special.

Where transformers departs from the GGUF's own metadata, the metadata wins (neither changes `encode` without
special tokens): `eos_token` is the token of `tokenizer.ggml.eos_token_id` (transformers 5.2.0 names the BOS token as
both BOS and EOS of a llama-architecture GGUF, and `<|endoftext|>` as the EOS of a Qwen one), and `encode(text)` with
special tokens adds a BOS only when `tokenizer.ggml.add_bos_token` says so (transformers always adds one under
llama). As in transformers, a Qwen architecture's tokenizer names no `bos_token` (templates render it as nothing).
Like transformers, the pre-tokenizer does not follow `tokenizer.ggml.pre` (llama.cpp does).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from omnijax.errors import ConfigError, UnsupportedConfigError

__all__ = ["build", "save"]

CONTROL = 3  # llama.cpp's token type of control tokens
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
_QWEN_ARCHES = ("qwen2", "qwen3", "qwen3moe")


def _merges(meta: Mapping[str, Any], tokens: list[str], scores: list[float] | None) -> list[tuple[str, str]]:
    """The BPE merges: the GGUF's, or (SentencePiece files carry none) every split of a token into two tokens,
    ranked by the token's score as transformers' GGUF converter ranks them."""
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        out = []
        for i, merge in enumerate(merges):
            parts = merge.split(" ")
            if len(parts) != 2:
                raise ConfigError(f"tokenizer.ggml.merges[{i}] = {merge!r} is not two tokens separated by a space")
            out.append((parts[0], parts[1]))
        return out
    if scores is None:
        raise ConfigError("tokenizer.ggml.model 'llama' without merges needs tokenizer.ggml.scores")
    score = {t: scores[i] for i, t in enumerate(tokens)}
    ranked = []
    for token, s in score.items():
        local = [(token[:k], token[k:], s) for k in range(1, len(token)) if token[:k] in score and token[k:] in score]
        local.sort(key=lambda m: (score[m[0]], score[m[1]]), reverse=True)
        ranked.extend(local)
    ranked.sort(key=lambda m: m[2], reverse=True)
    return [(a, b) for a, b, _ in ranked]


def _token(tokens: list[str], meta: Mapping[str, Any], key: str) -> str | None:
    index = meta.get(f"tokenizer.ggml.{key}")
    if index is None:
        return None
    if not 0 <= int(index) < len(tokens):
        raise ConfigError(f"tokenizer.ggml.{key} = {index} is outside the {len(tokens)} tokens")
    return tokens[int(index)]


def build(meta: Mapping[str, Any], architecture: str) -> tuple[Tokenizer, dict[str, Any]]:
    """`(backend tokenizer, tokenizer_config.json contents)` from GGUF metadata (see the module docstring).

    Raises:
        UnsupportedConfigError: a `tokenizer.ggml.model` other than "gpt2" / "llama" (or "llama" under a Qwen
            architecture).
        ConfigError: inconsistent tokenizer metadata (named).
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = meta.get("tokenizer.ggml.token_type")
    scores = meta.get("tokenizer.ggml.scores")
    if kind not in ("gpt2", "llama") or (kind == "llama" and architecture in _QWEN_ARCHES):
        raise UnsupportedConfigError("tokenizer.ggml.model", kind, f"no tokenizer of this kind is built for the "
                                     f"{architecture} architecture (read: 'gpt2', and 'llama' under llama)")
    if types is not None and len(types) != len(tokens):
        raise ConfigError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ConfigError("tokenizer.ggml.tokens lists a token twice")
    merges = _merges(meta, tokens, scores)
    unk = _token(tokens, meta, "unknown_token_id")
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", kind == "llama"))
    if architecture in _QWEN_ARCHES:
        backend = Tokenizer(BPE(vocab, merges, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                                fuse_unk=False, byte_fallback=False))
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
                                     use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        specials = [t for t in QWEN_SPECIALS if t in vocab]
    else:
        backend = Tokenizer(BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
        if kind == "gpt2":
            backend.normalizer = normalizers.Sequence([])
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                             use_regex=True)
            backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("▁", " "),
                                                 decoders.ByteLevel()])
        else:
            backend.normalizer = normalizers.Sequence(
                ([normalizers.Prepend("▁")] if prefix_space else []) + [normalizers.Replace(" ", "▁")])
            backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Replace("▁", " ")]
                                                + ([decoders.Strip(" ", 1, 0)] if prefix_space else []))
        if types is None:
            specials = [t for t in (unk, _token(tokens, meta, "bos_token_id"), _token(tokens, meta, "eos_token_id"))
                        if t is not None]
        else:
            specials = [tokens[i] for i, kind_of in enumerate(types) if kind_of == CONTROL]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    bos, eos = _token(tokens, meta, "bos_token_id"), _token(tokens, meta, "eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        pieces = ([bos] if add_bos else []) + ["$A"] + ([eos] if add_eos else [])
        pair = pieces + [p if p != "$A" else "$B:1" for p in pieces]
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(pieces), pair=" ".join(pair),
            special_tokens=[(t, vocab[t]) for t in dict.fromkeys(p for p in pieces if p != "$A")])
    elif architecture in _QWEN_ARCHES:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos,
                              "add_eos_token": add_eos, "clean_up_tokenization_spaces": False}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                      ("pad_token", "padding_token_id")):
        if name == "bos_token" and architecture in _QWEN_ARCHES:
            continue  # Qwen tokenizers name no BOS (transformers' Qwen2Tokenizer, and the releases' configs)
        token = _token(tokens, meta, key)
        if token is not None:
            config[name] = token
    context = meta.get(f"{architecture}.context_length")
    if context is not None:
        config["model_max_length"] = int(context)
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return backend, config


def save(backend: Tokenizer, config: Mapping[str, Any], directory: Path) -> None:
    """Writes `build`'s result into `directory` as `tokenizer.json` and `tokenizer_config.json`."""
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                     encoding="utf-8")
