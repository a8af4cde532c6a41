"""Conversion of Hugging Face Qwen2.5-Omni safetensors checkpoints (tiny random models built offline)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

import omnijax
from omnijax.checkpoint import format as checkpoint
from omnijax.checkpoint.name_tables import param_shapes as param_shapes_tree
from omnijax.checkpoint.safetensors import SafetensorsCheckpoint
from omnijax.convert import convert_checkpoint
from omnijax.convert.__main__ import main
from omnijax.errors import (
    CheckpointError,
    ConfigError,
    DestinationError,
    MissingTensorError,
    ShapeMismatchError,
    TensorError,
    UnexpectedTensorError,
    UnsupportedConfigError,
    UnsupportedModelError,
)
from omnijax.models.config import DecoderConfig
from omnijax.models.qwen2_5_omni import convert as qwen2_5_omni
from omnijax.models.qwen2_5_omni.convert import config_from_hf, param_shapes
from omnijax.models.registry import read_manifest
from omnijax.testing.checkpoints import tiny_token_ids
from tests._support import ROOT as REPO
from tests._support import hf_models
from tests._support.memory import AnonymousPeak

# Decoder path -> (HF name below the thinker with {i} for the layer, transposed).
LAYOUT = {
    "embed": ("model.embed_tokens.weight", False), "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
    "layers/input_norm": ("model.layers.{i}.input_layernorm.weight", False),
    "layers/post_norm": ("model.layers.{i}.post_attention_layernorm.weight", False),
    **{f"layers/{p}_proj": (f"model.layers.{{i}}.self_attn.{p}_proj.weight", True) for p in "qkvo"},
    **{f"layers/{p}_bias": (f"model.layers.{{i}}.self_attn.{p}_proj.bias", False) for p in "qkv"},
    **{f"layers/{p}_proj": (f"model.layers.{{i}}.mlp.{p}_proj.weight", True) for p in ("gate", "up", "down")},
}
QUIET = dict(progress=False, log=lambda message: None)
TINY_IDS = tiny_token_ids(hf_models.TEXT["vocab_size"])  # the tiny thinker's special ids, inside its vocabulary


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Saved tiny checkpoints sharing one set of thinker weights, and those weights as float32 torch tensors."""
    root = tmp_path_factory.mktemp("hf")
    thinker = hf_models.build_thinker(seed=0)
    thinker.save_pretrained(root / "thinker", safe_serialization=True)
    hf_models.save_full(thinker, root / "full")
    hf_models.save_full(thinker, root / "full_sharded", max_shard_size="50KB")
    (root / "full" / "tokenizer.json").write_text('{"version": "1.0"}')
    weights = {k: v.detach().clone() for k, v in thinker.state_dict().items()}
    return root, weights


def copy_src(hf, name, tmp_path) -> Path:
    dst = tmp_path / f"src_{name}"
    shutil.copytree(hf[0] / name, dst)
    return dst


def edit_tensors(src: Path, edit) -> None:
    """Rewrites the single `model.safetensors` of `src` through `edit(dict of numpy arrays)`."""
    tensors = safetensors.numpy.load_file(src / "model.safetensors")
    edit(tensors)
    safetensors.numpy.save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})


def edit_config(src: Path, edit) -> None:
    config = json.loads((src / "config.json").read_text())
    edit(config)
    (src / "config.json").write_text(json.dumps(config))


def abstract(config: DecoderConfig):
    def to_sds(tree):
        return {k: to_sds(v) if isinstance(v, dict) else jax.ShapeDtypeStruct(v, config.jnp_dtype)
                for k, v in tree.items()}
    return to_sds(param_shapes(config))


def expected_leaf(weights, path: str, num_layers: int) -> torch.Tensor:
    name, transpose = LAYOUT[path]
    fix = (lambda t: t.T) if transpose else (lambda t: t)
    if "{i}" in name:
        return torch.stack([fix(weights[name.format(i=i)]) for i in range(num_layers)])
    return fix(weights[name])


def check_params(ckpt_dir: Path, weights, dtype: str) -> DecoderConfig:
    model_type, config = read_manifest(ckpt_dir)
    assert model_type == "qwen2_5_omni" and config.dtype == dtype
    params = checkpoint.load_params(ckpt_dir, abstract(config))
    flat = {"/".join(k.key for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    assert set(flat) == set(LAYOUT) - ({"lm_head"} if config.tie_embeddings else set())
    for path, leaf in flat.items():
        assert isinstance(leaf, jax.Array)
        want = expected_leaf(weights, path, config.num_layers)
        got = np.asarray(leaf)
        if dtype == "float32":
            np.testing.assert_array_equal(got, want.numpy(), err_msg=path)
        else:  # bit-exact against torch's own bfloat16 cast
            np.testing.assert_array_equal(got.view(np.uint16), want.to(torch.bfloat16).view(torch.int16).numpy()
                                          .view(np.uint16), err_msg=path)
    return config


def assert_fails_cleanly(src, dst: Path, error, *needles, force=False):
    """The conversion raises `error` mentioning every needle and leaves the output's parent as it was."""
    before = sorted(os.listdir(dst.parent))
    with pytest.raises(error) as info:
        convert_checkpoint(src, dst, force=force, **QUIET)
    for needle in needles:
        assert needle in str(info.value)
    assert sorted(os.listdir(dst.parent)) == before
    return info.value


# ------------------------------------------------------------------------------------------------ conversions


@pytest.mark.parametrize("source", ["thinker", "full", "full_sharded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_convert_round_trip(hf, tmp_path, source, dtype):
    out = convert_checkpoint(hf[0] / source, tmp_path / "out", dtype=dtype, **QUIET)
    assert out == (tmp_path / "out").resolve()
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary directory left
    config = check_params(out, hf[1], dtype)
    assert config == DecoderConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                                   num_kv_heads=2, head_dim=16, rope_theta=1e6, mrope_section=(2, 3, 3),
                                   tie_embeddings=False, dtype=dtype, eos_token_ids=(TINY_IDS.im_end_token_id,))
    manifest = checkpoint.read_manifest_dict(out)
    prefix = "thinker." if source != "thinker" else ""
    assert manifest["source"]["skipped"] == {prefix + "audio_tower.audio_bos_eos_token.weight": 1}
    assert manifest["source"]["encoders_converted"] == ["audio", "vision"]
    assert manifest["omni"] == TINY_IDS.to_json()  # the thinker config's ids, its chat markers included
    # The audio tower is a component of its own, restored bit-exactly in the requested dtype.
    from omnijax.models.encoders import whisper as audio
    audio_config = audio.AudioConfig.from_json(manifest["audio"])
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, audio_config.jnp_dtype),
                            param_shapes_tree(audio.audio_component(audio_config)),
                            is_leaf=lambda x: isinstance(x, tuple))
    restored = checkpoint.load_params(out, abstract, "audio")
    want = hf[1]["audio_tower.conv1.weight"].float().numpy().transpose(2, 1, 0)
    np.testing.assert_array_equal(np.asarray(restored["conv1_kernel"], np.float32),
                                  want.astype(ml_dtypes.bfloat16).astype(np.float32) if dtype == "bfloat16" else want)


def test_param_layout_matches_decoder():
    from flax import nnx

    from omnijax.models.decoder import Decoder
    config = DecoderConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=16, mrope_section=(2, 3, 3), dtype="bfloat16")
    for variant in (config, config.replace(tie_embeddings=True), config.replace(qkv_bias=False, qk_norm=True)):
        want = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Decoder(variant))))
        assert jax.tree.map(lambda x: (x.shape, x.dtype), want) == jax.tree.map(
            lambda x: (x.shape, x.dtype), abstract(variant))


def test_skips_speech_output_tensors_with_one_summary(hf, tmp_path):
    src = copy_src(hf, "full", tmp_path)
    extra = {"talker.model.a.weight": 2, "talker.model.b.weight": 2, "token2wav.c.weight": 1}
    edit_tensors(src, lambda t: t.update({k: np.zeros((n,), np.float32) for k, n in extra.items()}))
    messages = []
    convert_checkpoint(src, tmp_path / "out", progress=False, log=messages.append)
    assert messages[0] == "skipped 3 speech-output tensors (talker.: 2, token2wav.: 1): not used by omnijax"
    assert messages[1] == ("skipped 1 tensor(s) the model never reads: "
                           "thinker.audio_tower.audio_bos_eos_token.weight") and len(messages) == 2
    assert tmp_path.joinpath("out", "tokenizer.json").is_file()


def test_tied_head_when_lm_head_absent(hf, tmp_path):
    src = copy_src(hf, "thinker", tmp_path)
    edit_tensors(src, lambda t: t.pop("lm_head.weight"))
    assert_fails_cleanly(src, tmp_path / "out", MissingTensorError, "'lm_head.weight'")
    edit_config(src, lambda c: c.update(tie_word_embeddings=True))
    config = check_params(convert_checkpoint(src, tmp_path / "out", **QUIET), hf[1], "float32")
    assert config.tie_embeddings
    flagged = copy_src(hf, "full", tmp_path)  # flag says tied, but lm_head.weight is present: it is kept
    edit_config(flagged, lambda c: c["thinker_config"].update(tie_word_embeddings=True))
    config = check_params(convert_checkpoint(flagged, tmp_path / "out2", **QUIET), hf[1], "float32")
    assert not config.tie_embeddings


def test_cli_main_and_force(hf, tmp_path, capsys):
    dst = tmp_path / "out"
    assert main([str(hf[0] / "full"), str(dst), "--dtype", "bfloat16", "--no-progress"]) == 0
    assert {"omnijax.json", "params", "tokenizer.json", "generation_config.json"} <= set(os.listdir(dst))
    check_params(dst, hf[1], "bfloat16")
    capsys.readouterr()
    assert main([str(hf[0] / "thinker"), str(dst), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "not empty" in err and "--force" in err and "\n" not in err
    assert main([str(hf[0] / "thinker"), str(dst), "--force", "--no-progress"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["out"] and not (dst / "tokenizer.json").exists()
    check_params(dst, hf[1], "float32")
    capsys.readouterr()
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "o2")]) == 1
    assert capsys.readouterr().err == f"error: source {tmp_path / 'nowhere'} is not a directory\n"


def test_cli_subprocess(hf, tmp_path):
    run = subprocess.run([sys.executable, "-m", "omnijax.convert", str(hf[0] / "full_sharded"), str(tmp_path / "out")],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "converting" in run.stderr and "100%" in run.stderr  # the progress bar
    check_params(tmp_path / "out", hf[1], "float32")


def synthetic_checkpoint(directory: Path, layers=8, hidden=256, inter=2048, vocab=1024) -> Path:
    """A random thinker-only checkpoint written with numpy (no torch model): 2 heads of 128, 1 kv head."""
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.q_proj.bias": (hidden,),
                       p + "self_attn.k_proj.weight": (128, hidden), p + "self_attn.k_proj.bias": (128,),
                       p + "self_attn.v_proj.weight": (128, hidden), p + "self_attn.v_proj.bias": (128,),
                       p + "self_attn.o_proj.weight": (hidden, hidden), p + "mlp.gate_proj.weight": (inter, hidden),
                       p + "mlp.up_proj.weight": (inter, hidden), p + "mlp.down_proj.weight": (hidden, inter)})
    directory.mkdir()
    safetensors.numpy.save_file({k: rng.standard_normal(v, np.float32) for k, v in shapes.items()},
                                directory / "model.safetensors")
    text = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=hidden // 128, num_key_value_heads=1,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni_thinker", "text_config": text}))
    return directory


def test_memory_stays_near_one_tensor(tmp_path):
    src = synthetic_checkpoint(tmp_path / "src", inter=4096)
    ckpt = SafetensorsCheckpoint(src)
    sizes = [ckpt.info(n).nbytes for n in ckpt.names()]
    hf_config = json.loads((src / "config.json").read_text())
    # a first conversion pays TensorStore's one-time set-up (thread pool, context: ~10 MiB), then the measured one
    qwen2_5_omni.convert_params(ckpt, hf_config, dtype="float32", staging_dir=tmp_path / "warm", progress=False)
    with AnonymousPeak() as peak:  # heap and buffers, not the memory-mapped source
        _, params, _, _ = qwen2_5_omni.convert_params(ckpt, hf_config, dtype="float32", staging_dir=tmp_path / "stage",
                                                   progress=False)
    # measured 2-3x the largest tensor (it, the block in flight, allocator slack); a staged tree would be ~26x
    assert peak.growth < 5 * max(sizes) < sum(sizes) / 5, (peak.growth / max(sizes), sum(sizes) / max(sizes))
    leaves = jax.tree.leaves(params)
    # written straight into their storage as the tensors were read (no staging copy of the tree)
    from omnijax.checkpoint.staged import StagedArray
    assert all(isinstance(a, StagedArray) and a.written == np.prod(a.shape) * 4 for a in leaves)
    # Saving writes chunked, non-OCDBT arrays (OCDBT holds every compressed chunk in memory until the commit).
    checkpoint.save_params(tmp_path / "out", "qwen2_5_omni", qwen2_5_omni.config_from_hf(hf_config), params)
    assert not (tmp_path / "out" / "params" / "manifest.ocdbt").exists()
    import orbax.checkpoint as ocp
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata((tmp_path / "out" / "params").resolve()).item_metadata.tree
    gate = stored["layers"]["gate_proj"]
    assert gate.shape == (8, 256, 4096)
    assert np.prod(gate.storage.chunk_shape) * 4 <= checkpoint.SAVE_CHUNK_BYTES < np.prod(gate.shape) * 4


# ------------------------------------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize("edit, error, needles", [
    (lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"), MissingTensorError,
     ["'model.layers.1.self_attn.k_proj.bias'"]),
    (lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}), UnexpectedTensorError,
     ["'model.layers.0.self_attn.o_proj.bias'"]),
    (lambda t: t.update({"model.layers.2.input_layernorm.weight": np.ones(64, np.float32)}), UnexpectedTensorError,
     ["'model.layers.2.input_layernorm.weight'", "layer 2"]),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": np.zeros((60, 64), np.float32)}),
     ShapeMismatchError, ["'model.layers.0.self_attn.q_proj.weight'", "(60, 64)", "(64, 64)"]),
    (lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}), TensorError,
     ["'model.norm.weight'", "dtype I32"]),
])
def test_bad_tensors(hf, tmp_path, edit, error, needles):
    src = copy_src(hf, "thinker", tmp_path)
    edit_tensors(src, edit)
    assert_fails_cleanly(src, tmp_path / "out", error, *needles)


def test_corrupt_files(hf, tmp_path):
    src = copy_src(hf, "thinker", tmp_path)
    path = src / "model.safetensors"
    good = path.read_bytes()
    path.write_bytes(good[:-100])
    e = assert_fails_cleanly(src, tmp_path / "out", CheckpointError, str(path), "truncated")
    assert e.tensor is not None and e.tensor in str(e)
    path.write_bytes(good + b"\0" * 3)
    assert_fails_cleanly(src, tmp_path / "out", CheckpointError, "3 unexpected bytes after the last tensor")
    path.write_bytes(struct.pack("<Q", 9) + b"{garbage!" + b"\0" * 64)
    assert_fails_cleanly(src, tmp_path / "out", CheckpointError, str(path), "not valid UTF-8 JSON")
    path.write_bytes(b"\1\2\3")
    assert_fails_cleanly(src, tmp_path / "out", CheckpointError, str(path), "too short")
    path.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    assert_fails_cleanly(src, tmp_path / "out", CheckpointError, str(path), "header length")


def test_missing_shard(hf, tmp_path):
    src = copy_src(hf, "full_sharded", tmp_path)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[3]
    (src / shard).unlink()
    assert_fails_cleanly(src, tmp_path / "out", CheckpointError, "model.safetensors.index.json", shard)


@pytest.mark.parametrize("key, value, needle", [
    ("use_sliding_window", True, "thinker_config.text_config.use_sliding_window=True"),
    ("layer_types", ["full_attention", "sliding_attention"], "layer_types[1]='sliding_attention'"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "mrope_section": [2, 3, 3]},
     "rope_parameters.rope_type='yarn'"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3], "factor": 2.0},
     "rope_parameters.factor=2.0"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3], "beta_fast": 32},
     "rope_parameters.beta_fast=32"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
    ("mlp_bias", True, "mlp_bias=True"),
    ("attention_bias", False, "attention_bias=False"),
])
def test_unsupported_config(hf, key, value, needle):
    config = json.loads((hf[0] / "full" / "config.json").read_text())
    config["thinker_config"]["text_config"][key] = value
    with pytest.raises(UnsupportedConfigError) as info:
        config_from_hf(config)
    assert needle in str(info.value)


def test_unsupported_config_end_to_end(hf, tmp_path):
    src = copy_src(hf, "full", tmp_path)
    edit_config(src, lambda c: c["thinker_config"]["text_config"].update(use_sliding_window=True))
    assert_fails_cleanly(src, tmp_path / "out", UnsupportedConfigError, "use_sliding_window")
    edit_config(src, lambda c: c.update(model_type="gemma"))
    assert_fails_cleanly(src, tmp_path / "out", UnsupportedModelError, "'gemma'", "qwen2_5_omni_thinker")
    # A Qwen config relabelled as MiniCPM-o reaches the MiniCPM-o converter, which finds no LLM settings at the top.
    edit_config(src, lambda c: c.update(model_type="minicpmo"))
    assert_fails_cleanly(src, tmp_path / "out", ConfigError, "rope_theta")


def test_config_spellings(hf):
    full = json.loads((hf[0] / "full" / "config.json").read_text())
    thinker = json.loads((hf[0] / "thinker" / "config.json").read_text())
    base = config_from_hf(full)
    assert config_from_hf(thinker) == base
    text = thinker["text_config"]
    text.pop("rope_parameters")
    text.update(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rope_theta=1e6)
    assert config_from_hf(thinker) == base
    text.update(vocab_size=152064, head_dim=32, rope_scaling={"rope_type": "default", "mrope_section": [4, 6, 6]})
    legacy = config_from_hf(thinker, dtype="bfloat16")
    assert legacy.eos_token_ids == (151645,) and legacy.head_dim == 32 and legacy.dtype == "bfloat16"


def test_destination_rules(hf, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    assert_fails_cleanly(hf[0] / "thinker", dst, DestinationError, "not empty")
    broken = copy_src(hf, "thinker", tmp_path)
    edit_tensors(broken, lambda t: t.pop("model.norm.weight"))
    assert_fails_cleanly(broken, dst, MissingTensorError, "'model.norm.weight'", force=True)
    assert (dst / "keep.txt").read_text() == "mine"
    assert_fails_cleanly(hf[0] / "thinker", hf[0] / "thinker" / "out", DestinationError, "overlaps")
    nested = tmp_path / "a" / "b" / "out"
    with pytest.raises(MissingTensorError):
        convert_checkpoint(broken, nested, **QUIET)
    assert not (tmp_path / "a").exists()  # parents created for the output are removed again


# ------------------------------------------------------------------------------------------------ readers


def test_manifest_and_load_errors(hf, tmp_path):
    with pytest.raises(checkpoint.CheckpointFormatError, match="not an omnijax checkpoint"):
        read_manifest(tmp_path)
    (tmp_path / "omnijax.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(checkpoint.CheckpointFormatError, match="'other'"):
        read_manifest(tmp_path)
    out = convert_checkpoint(hf[0] / "thinker", tmp_path / "out", dtype="bfloat16", **QUIET)
    _, config = read_manifest(out)
    with pytest.raises(checkpoint.CheckpointFormatError, match="expected .* float32"):
        checkpoint.load_params(out, abstract(config.replace(dtype="float32")))
    params = checkpoint.load_params(out, abstract(config))  # jax arrays save and restore too
    checkpoint.save_params(tmp_path / "again", "qwen2_5_omni", config, params, {"note": "resaved"})
    again = checkpoint.load_params(tmp_path / "again", abstract(config))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a.view(np.uint16) == b.view(np.uint16)).all()),
                                     params, again))
    assert checkpoint.read_manifest_dict(tmp_path / "again")["source"] == {"note": "resaved"}


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m.update(model_type="gemma"), "model_type 'gemma' is not one omnijax reads"),
    (lambda m: m.update(visoin=m["vision"]), r"unknown manifest keys \['visoin'\] for a qwen2_5_omni"),
    (lambda m: m.update(vpm={}), r"unknown manifest keys \['vpm'\]"),  # a MiniCPM-o component
])
def test_manifest_refuses_what_it_does_not_read(hf, tmp_path, edit, needle):
    out = convert_checkpoint(hf[0] / "thinker", tmp_path / "out", **QUIET)
    manifest = checkpoint.read_manifest_dict(out)
    assert {"audio", "vision", "omni"} <= set(manifest)
    edit(manifest)
    (out / "omnijax.json").write_text(json.dumps(manifest))
    with pytest.raises(checkpoint.CheckpointFormatError, match=needle):
        omnijax.load(out)


_LOAD_AND_REPORT = """
import sys, omnijax
from tests._support import ROOT
try:
    omnijax.load(sys.argv[1])
except omnijax.checkpoint.format.CheckpointFormatError as e:
    print(e)
"""


def test_damaged_parameter_files_are_named(hf, tmp_path):
    out = convert_checkpoint(hf[0] / "thinker", tmp_path / "out", **QUIET)
    _, config = read_manifest(out)
    chunk = sorted((out / "params" / "embed").glob("*.0"))[0]
    # In a subprocess: when one array read fails, orbax leaves its other reads unawaited and Python reports each at
    # exit, pages of noise that belong to that process's output, not this one's.
    for damage, needle in ((lambda: chunk.write_bytes(b"not zstd"), f"Error reading local file \"{chunk}\""),
                           (chunk.unlink, f"{chunk}\" is missing")):
        damage()
        run = subprocess.run([sys.executable, "-c", _LOAD_AND_REPORT, str(out)], capture_output=True, text=True,
                             timeout=300)
        assert f"{out / 'params'}: cannot read the stored arrays" in run.stdout and needle in run.stdout, run.stdout
    (out / "params" / "_METADATA").write_text("{")
    with pytest.raises(checkpoint.CheckpointFormatError, match="cannot read the parameter metadata"):
        checkpoint.load_params(out, abstract(config))


def test_generation_config_sets_answer_end_tokens(tmp_path):
    from omnijax.models.registry import read_manifest
    from omnijax.testing import checkpoints as demo

    src = demo.write_tiny_hf_checkpoint(tmp_path / "hf")
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 151645, 3]}))
    # An id outside the 512-token vocabulary is refused by name (it used to be dropped silently).
    with pytest.raises(ConfigError, match=r"generation_config.json: eos_token_id=\[7, 151645, 3\] is out of range"):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 3]}))
    _, config = read_manifest(convert_checkpoint(src, tmp_path / "out", progress=False))
    assert config.eos_token_ids == (7, 3)
    assert (tmp_path / "out" / "generation_config.json").is_file()
    (src / "generation_config.json").write_text('{"eos_token_id": "x"}')
    with pytest.raises(ConfigError, match="eos_token_id"):
        convert_checkpoint(src, tmp_path / "bad", progress=False)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("key, attribute, value, error", [
    ("audio_config", "activation_function", "relu", UnsupportedConfigError),
    ("audio_config", "encoder_attention_heads", 5, ConfigError),  # d_model 32 does not split into 5 heads
    ("vision_config", "hidden_act", "gelu", UnsupportedConfigError),
    ("vision_config", "window_size", 100, ConfigError),  # not a multiple of 28
])
def test_encoder_config_errors_name_the_attribute(hf, tmp_path, key, attribute, value, error):
    src = copy_src(hf, "full", tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["thinker_config"][key][attribute] = value
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(error, match=attribute if error is UnsupportedConfigError or key == "vision_config" else key):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
