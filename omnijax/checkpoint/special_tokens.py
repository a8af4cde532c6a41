"""Special-token ids a Hugging Face checkpoint's tokenizer files declare (its added tokens), read without loading a
tokenizer library.

Sources, later ones overriding earlier ones for the same token text: `tokenizer.json` (`added_tokens`: a list of
`{"id": int, "content": str, ...}`), `tokenizer_config.json` (`added_tokens_decoder`: `{"<id>": {"content": str}}`)
and `added_tokens.json` (`{content: id}`). A missing file contributes nothing; a file that is not the JSON it
should be raises `ConfigError` (a checkpoint whose tokenizer cannot be read must not silently fall back to the
release's ids).
"""

from __future__ import annotations

import json
from pathlib import Path

from omnijax.errors import ConfigError

__all__ = ["read_special_tokens"]


def _load(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: cannot parse: {e}") from e


def _entry(path: Path, content, token_id) -> tuple[str, int]:
    if not isinstance(content, str) or isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
        raise ConfigError(f"{path}: added token {content!r} has id {token_id!r}; want a string and an id >= 0")
    return content, token_id


def read_special_tokens(directory: str | Path) -> dict[str, int]:
    """`{token text: id}` of the added tokens in `directory`'s tokenizer files (empty when it has none)."""
    directory = Path(directory)
    out: dict[str, int] = {}
    path = directory / "tokenizer.json"
    if path.is_file():
        data = _load(path)
        added = data.get("added_tokens", []) if isinstance(data, dict) else None
        if not isinstance(added, list):
            raise ConfigError(f"{path}: added_tokens must be a list")
        for item in added:
            if not isinstance(item, dict):
                raise ConfigError(f"{path}: added_tokens entries must be objects, got {item!r}")
            out.update([_entry(path, item.get("content"), item.get("id"))])
    path = directory / "tokenizer_config.json"
    if path.is_file():
        data = _load(path)
        decoder = data.get("added_tokens_decoder", {}) if isinstance(data, dict) else None
        if not isinstance(decoder, dict):
            raise ConfigError(f"{path}: added_tokens_decoder must be an object")
        for key, item in decoder.items():
            try:
                token_id = int(key)
            except ValueError:
                raise ConfigError(f"{path}: added_tokens_decoder key {key!r} is not an id") from None
            out.update([_entry(path, item.get("content") if isinstance(item, dict) else None, token_id)])
    path = directory / "added_tokens.json"
    if path.is_file():
        data = _load(path)
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: want an object of token text -> id")
        out.update(_entry(path, content, token_id) for content, token_id in data.items())
    return out
