"""The tiny Qwen2.5-Omni speech release the server, CLI and speech-pool tests build alike: transformers' seeded tiny
full model (`tests.models.qwen2_5_omni.test_talker.seeded_full_model`) saved with its voices (`spk_dict.pt`) and,
optionally, the tiny ChatML tokenizer, converted. Needs torch and transformers (the test extra)."""

from __future__ import annotations

from pathlib import Path

from omnijax.convert import convert_checkpoint


def spoken_release25(root: Path, *, tokenizer: bool = True) -> Path:
    """Writes the release under `root / "hf"` (with `tokenizer`: the tiny ChatML tokenizer whose specials are
    `test_speech.SPECIALS`), converts it to `root / "out"` and returns that directory."""
    import torch

    from omnijax.models.tokenizer import CHATML_TEMPLATE, write_tiny_tokenizer
    from tests.models.qwen2_5_omni import test_speech as TS
    from tests.models.qwen2_5_omni import test_talker as T

    full = T.seeded_full_model()
    full.save_pretrained(root / "hf", safe_serialization=True)
    torch.save(TS._voices(full), root / "hf" / "spk_dict.pt")
    if tokenizer:
        write_tiny_tokenizer(root / "hf", vocab_size=300, special_tokens=TS.SPECIALS, chat_template=CHATML_TEMPLATE)
    return convert_checkpoint(root / "hf", root / "out", progress=False, log=lambda _: None)
