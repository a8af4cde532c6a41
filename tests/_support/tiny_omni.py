"""The tiny checkpoints several test modules share: the converted Qwen2.5-Omni (one layer of hidden 32, the release's
special-token ids in a 151,700-token vocabulary, both encoders, optionally the demo's tiny tokenizer), and the
MiniCPM-o 4.5 golden checkpoint with a tiny tokenizer (`minicpmo_source`)."""

from pathlib import Path

from omnijax.convert import convert_checkpoint
from omnijax.testing import checkpoints as demo
from tests._support import DATA

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


MINICPMO_SPECIALS = {"<|endoftext|>": 1920, "<|im_start|>": 1921, "<|im_end|>": 1922, "<unit>": 1930, "</unit>": 1931,
                     "<image>": 1932, "</image>": 1933, "<slice>": 1934, "</slice>": 1935, "<unk>": 1936,
                     "<|audio_start|>": 1937, "<|audio_end|>": 1938, "<|listen|>": 1939, "<|speak|>": 1940,
                     "<|chunk_eos|>": 1941}


def minicpmo_source(root: Path) -> Path:
    """The tiny MiniCPM-o 4.5 golden checkpoint copied to `root / "hf"` with a tiny tokenizer (the 4.5 chat template;
    its markers at `MINICPMO_SPECIALS`); returns that Hugging Face directory."""
    import shutil

    from omnijax.models.tokenizer import MINICPMO_4_5_TEMPLATE, write_tiny_tokenizer

    src = root / "hf"
    shutil.copytree(DATA / "minicpmo45" / "checkpoint", src)
    write_tiny_tokenizer(src, vocab_size=2048, special_tokens=MINICPMO_SPECIALS, chat_template=MINICPMO_4_5_TEMPLATE)
    return src
