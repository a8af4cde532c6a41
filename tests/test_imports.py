"""Every public module imports on its own in a fresh interpreter, and `load` works before anything else is imported
(the encoders and the converter import each other's tables; import order must not matter)."""

import subprocess
import sys

import pytest

from convert import convert_checkpoint
from omnijax import demo

MODULES = ["omnijax", "convert", "convert.__main__", "omnijax.models.qwen2_5_omni.audio",
           "omnijax.models.qwen2_5_omni.vision", "omnijax.models.qwen2_5_omni.frontend",
           "omnijax.models.qwen2_5_omni.thinker", "omnijax.adapters.qwen2_5_omni", "omnijax.adapters.minicpmo",
           "pallas_kernels"]


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_alone(module):
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True, capture_output=True)


def test_load_in_a_fresh_interpreter(tmp_path):
    src = demo.write_tiny_hf_checkpoint(tmp_path / "hf", encoders=True)
    dst = convert_checkpoint(src, tmp_path / "out", progress=False)
    code = "import sys, omnijax; m = omnijax.load(sys.argv[1]); assert m.audio is not None and m.vision is not None"
    subprocess.run([sys.executable, "-c", code, str(dst)], check=True, capture_output=True)
