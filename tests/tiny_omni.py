"""The tiny converted Qwen2.5-Omni checkpoint several test modules share: one layer of hidden 32, the release's
special-token ids in a 151,700-token vocabulary, both encoders, optionally the demo's tiny tokenizer."""

from pathlib import Path

from convert import convert_checkpoint
from omnijax import demo

TEXT_CONFIG = dict(demo.TINY_TEXT_CONFIG, vocab_size=151_700, hidden_size=32, intermediate_size=64,
                   num_hidden_layers=1, layer_types=["full_attention"], tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]})


def checkpoint(root: Path, *, tokenizer: bool = False) -> Path:
    """Writes the Hugging Face checkpoint under `root / "hf"` (with `tokenizer`: the demo's tiny tokenizer) and
    converts it to `root / "omnijax"`; returns the converted directory."""
    src = demo.write_tiny_hf_checkpoint(root / "hf", text_config=TEXT_CONFIG)
    if tokenizer:
        demo.write_tiny_tokenizer(src, TEXT_CONFIG["vocab_size"])
    return convert_checkpoint(src, root / "omnijax", progress=False, log=lambda _: None)
