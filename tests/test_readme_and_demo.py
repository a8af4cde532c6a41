"""The README quick start runs as written (paths swapped for a tiny checkpoint) and the demo completes."""

import re
import subprocess
import sys
from pathlib import Path

from omnijax import demo

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs(tmp_path, capsys):
    assert demo.main(["--out", str(tmp_path / "demo"), "--chunks", "4"]) == 0
    printed = capsys.readouterr().out
    assert "retained" in printed and "max |logit difference|" in printed


def test_readme_quick_start(tmp_path):
    readme = (ROOT / "README.md").read_text()
    (command,) = re.findall(r"^\.venv/bin/omnijax-convert .*$", readme, flags=re.M)
    python_blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert len(python_blocks) == 1
    # A tiny model whose vocabulary holds the real special-token ids the quick start uses.
    text_config = dict(demo.TINY_TEXT_CONFIG, vocab_size=151_700, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=1, layer_types=["full_attention"],
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]})
    src = demo.write_tiny_hf_checkpoint(tmp_path / "Qwen2.5-Omni-7B", text_config=text_config)
    dst = tmp_path / "omni7b-jax"
    args = command.split()[1:]
    args = [str(src) if a == "/path/to/Qwen2.5-Omni-7B" else str(dst) if a == "/path/to/omni7b-jax" else a
            for a in args]
    script = Path(sys.executable).parent / "omnijax-convert"
    subprocess.run([str(script), *args], check=True)
    code = python_blocks[0].replace("/path/to/omni7b-jax", str(dst))
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)
    result, out = namespace["result"], namespace["out"]
    assert namespace["answer"].shape == (1, 8)
    assert int(namespace["compressed"].cache.layers[0].length[0, 0]) == 64
    assert result.tokens.shape == (2, 1, 16) and (result.tokens[-1, 0] >= 0).all()
    assert out.tokens.shape == (1, 16) and int((out.tokens[0] >= 0).sum()) == 8
