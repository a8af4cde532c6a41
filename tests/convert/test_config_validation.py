"""Config values are checked by the converter and the loader, and a symlinked destination is refused (issue 35 item 7).

The sources are tiny checkpoints written here with numpy: a Llama decoder (top-level settings) and a Qwen2.5-Omni
thinker (settings under `thinker_config.text_config`, RoPE in `rope_parameters`); for the families' special ids also
a Qwen3-Omni thinker and the golden MiniCPM-o 4.5 checkpoint with tokenizer ids. Each bad value is refused as a
`ConfigError` naming the attribute, the value and the allowed range, before any tensor is read (the tensor reader is
replaced by one that fails the test), and the destination is not created, or left as it was with `--force`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import omnijax
import omnijax.convert as convert_pkg
from omnijax.checkpoint import format as checkpoint
from omnijax.convert import convert_checkpoint, converter_for
from omnijax.convert.__main__ import main
from omnijax.errors import ConfigError, ConfigValueError, DestinationError
from omnijax.models import registry
from omnijax.models.config import PRESETS, DecoderConfig, validate_config
from omnijax.models.llama import convert as llama
from omnijax.models.qwen2_5_omni import convert as qwen
from omnijax.models.qwen3_omni import convert as qwen3_omni
from omnijax.testing import checkpoints as demo
from tests._support import DATA
from tests._support import ROOT as REPO

pytestmark = [pytest.mark.fast,  # the quick tier (`make test-fast`): the config checks, no compile
              pytest.mark.filterwarnings("ignore:.*has no tokenizer files:UserWarning")]
QUIET = dict(progress=False, log=lambda message: None)
VOCAB = 256
LLAMA = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "hidden_act": "silu",
         "tie_word_embeddings": False}
QWEN_TEXT = dict(demo.TINY_TEXT_CONFIG, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, layer_types=["full_attention"], bos_token_id=1,
                 eos_token_id=2, pad_token_id=0,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]})


def _write_source(directory: Path, component, config: dict) -> Path:
    """A random checkpoint (config.json + model.safetensors) holding every tensor of a decoder's conversion table."""
    rng = np.random.default_rng(0)
    tensors = {}
    for rule in component.active_rules():
        for i in (component.layers_of(rule) if rule.layered else (None,)):
            for e in (range(component.num_experts) if rule.experted else (None,)):
                tensors[rule.name_of(i, e)] = rng.standard_normal(rule.source_shape(component.dims)).astype(np.float32)
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _write_llama(directory: Path) -> Path:
    """A random Llama checkpoint of `LLAMA`."""
    return _write_source(directory, qwen.decoder_component(llama.config_from_hf(LLAMA)), LLAMA)


def _text(family: str, config: dict) -> dict:
    """The section of a parsed config.json that holds the decoder's settings."""
    return config if family == "llama" else config["thinker_config"]["text_config"]


def _rope_theta(family: str, config: dict, value) -> None:
    if family == "llama":
        config["rope_theta"] = value
    else:
        _text(family, config)["rope_parameters"]["rope_theta"] = value


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """family -> (valid source directory, its converted checkpoint)."""
    root = tmp_path_factory.mktemp("sources")
    out = {"llama": _write_llama(root / "llama"),
           "qwen2_5_omni": demo.write_tiny_hf_checkpoint(root / "qwen2_5_omni", text_config=QWEN_TEXT, encoders=False)}
    return {family: (src, convert_checkpoint(src, root / f"{family}_out", **QUIET)) for family, src in out.items()}


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Makes reading the source's tensors fail the test: refusals must come first."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the converter opened the safetensors files before refusing the config")
    monkeypatch.setattr(convert_pkg, "SafetensorsCheckpoint", forbidden)


def _source_with(src: Path, tmp_path: Path, family: str, edit) -> Path:
    """A copy of `src` (its tensors linked) with `edit(family, config, text_section)` applied to its config.json."""
    config = json.loads((src / "config.json").read_text())
    edit(family, config, _text(family, config))
    bad = tmp_path / "bad_src"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))  # NaN and Infinity are written as JSON's NaN / Infinity
    os.symlink(src / "model.safetensors", bad / "model.safetensors")
    return bad


# (edit(family, config, text), the attribute the message names, the value as the message writes it, the allowed range)
BAD_VALUES = {
    "heads_zero": (lambda f, c, t: t.update(num_attention_heads=0), "num_attention_heads", "0", "integer >= 1"),
    "heads_negative": (lambda f, c, t: t.update(num_attention_heads=-4), "num_attention_heads", "-4", "integer >= 1"),
    "heads_fractional": (lambda f, c, t: t.update(num_attention_heads=4.5), "num_attention_heads", "4.5", "integer"),
    "kv_heads_zero": (lambda f, c, t: t.update(num_key_value_heads=0), "num_key_value_heads", "0", "integer >= 1"),
    "kv_heads_not_dividing": (lambda f, c, t: t.update(num_key_value_heads=3), "num_key_value_heads", "3",
                              "a divisor of num_heads"),
    "head_dim_zero": (lambda f, c, t: t.update(head_dim=0), "head_dim", "0", "integer >= 2"),
    "head_dim_odd": (lambda f, c, t: t.update(head_dim=7), "head_dim", "7", "even"),
    "hidden_zero": (lambda f, c, t: t.update(hidden_size=0), "hidden_size", "0", "integer >= 1"),
    "layers_zero": (lambda f, c, t: t.update(num_hidden_layers=0), "num_hidden_layers", "0", "integer >= 1"),
    "layers_text": (lambda f, c, t: t.update(num_hidden_layers="2"), "num_hidden_layers", "'2'", "integer >= 1"),
    "vocab_zero": (lambda f, c, t: t.update(vocab_size=0), "vocab_size", "0", "integer >= 1"),
    "intermediate_zero": (lambda f, c, t: t.update(intermediate_size=0), "intermediate_size", "0", ">= 1"),
    "intermediate_negative": (lambda f, c, t: t.update(intermediate_size=-64), "intermediate_size", "-64", ">= 0"),
    "theta_nan": (lambda f, c, t: _rope_theta(f, c, math.nan), "rope_theta", "nan", "finite number > 0"),
    "theta_inf": (lambda f, c, t: _rope_theta(f, c, math.inf), "rope_theta", "inf", "finite number > 0"),
    "theta_zero": (lambda f, c, t: _rope_theta(f, c, 0.0), "rope_theta", "0.0", "finite number > 0"),
    "eps_negative": (lambda f, c, t: t.update(rms_norm_eps=-1e-6), "rms_norm_eps", "-1e-06", "finite number > 0"),
    "eps_nan": (lambda f, c, t: t.update(rms_norm_eps=math.nan), "rms_norm_eps", "nan", "finite number > 0"),
    "bos_past_vocab": (lambda f, c, t: t.update(bos_token_id=VOCAB), "bos_token_id", str(VOCAB),
                       f"[0, vocab_size = {VOCAB})"),
    "pad_negative": (lambda f, c, t: t.update(pad_token_id=-1), "pad_token_id", "-1", f"[0, vocab_size = {VOCAB})"),
    "eos_past_vocab": (lambda f, c, t: t.update(eos_token_id=VOCAB + 5), "eos_token_id", str(VOCAB + 5),
                       f"[0, vocab_size = {VOCAB})"),
    "eos_list_past_vocab": (lambda f, c, t: t.update(eos_token_id=[2, 100_000]), "eos_token_id", "[2, 100000]",
                            f"[0, vocab_size = {VOCAB})"),
}


@pytest.mark.parametrize("family", ["llama", "qwen2_5_omni"])
@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_bad_values_are_refused_by_name_before_tensors(sources, tmp_path, no_tensor_reads, family, case):
    edit, attribute, shown, allowed = BAD_VALUES[case]
    bad = _source_with(sources[family][0], tmp_path, family, edit)
    fresh = tmp_path / "fresh"
    with pytest.raises(ConfigError) as info:
        convert_checkpoint(bad, fresh, **QUIET)
    message = str(info.value)
    assert attribute in message and f"={shown}" in message and allowed in message, message
    assert not fresh.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad_src"]
    kept = tmp_path / "kept"  # --force on an existing DST: untouched
    kept.mkdir()
    (kept / "mine.txt").write_text("mine")
    with pytest.raises(ConfigError, match=attribute):
        convert_checkpoint(bad, kept, force=True, **QUIET)
    assert [p.name for p in kept.iterdir()] == ["mine.txt"] and (kept / "mine.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad_src", "kept"]  # no temporary directory left


def test_cli_reports_a_bad_value_in_one_line(sources, tmp_path, capsys):
    bad = _source_with(sources["llama"][0], tmp_path, "llama", lambda f, c, t: t.update(num_attention_heads=0))
    assert main([str(bad), str(tmp_path / "out"), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "num_attention_heads" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("edit, attribute", [
    (lambda r: r.update(factor=math.nan), "rope_scaling.factor=nan"),
    (lambda r: r.update(low_freq_factor=-1.0), "rope_scaling.low_freq_factor=-1.0"),
    (lambda r: r.update(original_max_position_embeddings=math.inf), "rope_scaling.original_max_position_embeddings"),
])
def test_llama3_rope_scaling_must_be_finite_and_positive(edit, attribute):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}
    assert llama.config_from_hf(dict(LLAMA, rope_parameters=rope)).rope_scaling == (8.0, 1.0, 4.0, 32.0)
    edit(rope)
    with pytest.raises(ConfigError, match=attribute.replace(".", r"\.")):
        llama.config_from_hf(dict(LLAMA, rope_parameters=rope))


def _qwen3_omni(**text):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]})
    return {"model_type": "qwen3_omni_moe_thinker", "text_config": dict(base, **text)}


@pytest.mark.parametrize("text, needle", [
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5 is out of range: it must be in [1, num_experts = 4]"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok=0"),
    (dict(num_experts=-2), "num_experts=-2"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size=0"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
    (dict(mlp_only_layers=[5]), "mlp_only_layers=[5]"),
    (dict(pad_token_id=VOCAB), f"pad_token_id={VOCAB}"),
])
def test_moe_counts_are_checked(text, needle):
    assert qwen3_omni.config_from_hf(_qwen3_omni()).num_experts == 4
    with pytest.raises(ConfigError) as info:
        qwen3_omni.config_from_hf(_qwen3_omni(**text))
    assert needle in str(info.value) and "text_config" in str(info.value)


# ------------------------------------------------------------------------------------------------ the loader


def _with_manifest(converted: Path, tmp_path: Path, edit) -> Path:
    """A copy of a converted checkpoint (its parameters linked) with `edit(manifest)` applied to its manifest."""
    manifest = checkpoint.read_manifest_dict(converted)
    edit(manifest)
    edited = tmp_path / "edited"
    edited.mkdir()
    for entry in converted.iterdir():  # the parameters of the shared conversion, linked
        if entry.name != checkpoint.MANIFEST:
            os.symlink(entry, edited / entry.name)
    (edited / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    return edited


def _forbidden(*args, **kwargs):
    raise AssertionError("parameters were read before the config was checked")


@pytest.mark.parametrize("family", ["llama", "qwen2_5_omni"])
@pytest.mark.parametrize("field, value, needle", [
    ("num_heads", 0, "num_heads (num_attention_heads)=0"),
    ("num_kv_heads", 3, "num_kv_heads (num_key_value_heads)=3"),
    ("rope_theta", math.nan, "rope_theta=nan"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps=-1e-06"),
    ("vocab_size", 0, "vocab_size=0"),
    ("eos_token_ids", [VOCAB], f"eos_token_ids (eos_token_id)=[{VOCAB}]"),
    ("head_dim", "8", "head_dim='8'"),
])
def test_loader_refuses_an_edited_manifest_before_reading_parameters(sources, tmp_path, monkeypatch, family, field,
                                                                    value, needle):
    edited = _with_manifest(sources[family][1], tmp_path, lambda manifest: manifest["decoder"].update({field: value}))
    monkeypatch.setattr(registry, "restore_module", _forbidden)
    with pytest.raises(checkpoint.CheckpointFormatError) as info:
        omnijax.load(edited)
    assert needle in str(info.value) and "invalid decoder config" in str(info.value)
    with pytest.raises(checkpoint.CheckpointFormatError, match=field):
        registry.read_manifest(edited)


def test_generation_config_eos_outside_the_vocabulary_is_refused(sources, tmp_path, no_tensor_reads):
    bad = _source_with(sources["llama"][0], tmp_path, "llama", lambda f, c, t: None)
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, VOCAB]}))
    with pytest.raises(ConfigError) as info:
        convert_checkpoint(bad, tmp_path / "out", **QUIET)
    assert "generation_config.json" in str(info.value) and f"eos_token_id=[2, {VOCAB}]" in str(info.value)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ family special ids

# The Qwen3-Omni source's ids: the top of its vocabulary, chat markers included (it ships no tokenizer files).
QWEN3_IDS = dict(audio_token_id=VOCAB - 10, image_token_id=VOCAB - 9, video_token_id=VOCAB - 8,
                 audio_start_token_id=VOCAB - 7, audio_end_token_id=VOCAB - 6, vision_start_token_id=VOCAB - 5,
                 vision_end_token_id=VOCAB - 4, im_start_token_id=VOCAB - 2, im_end_token_id=VOCAB - 1)
MINICPMO = DATA / "minicpmo45"
MINICPMO_VOCAB = 2048  # the golden checkpoint's


@pytest.fixture(scope="module")
def omni_sources(sources, tmp_path_factory):
    """family -> (valid source, its converted checkpoint, vocabulary size) for the families with special ids."""
    root = tmp_path_factory.mktemp("omni_sources")
    qwen3 = dict(_qwen3_omni(), **QWEN3_IDS)
    qwen3_src = _write_source(root / "qwen3_omni", qwen3_omni.decoder_component(qwen3_omni.config_from_hf(qwen3)),
                              qwen3)
    minicpmo_src = root / "minicpmo"  # the golden checkpoint with its tokenizer's ids (added_tokens.json)
    minicpmo_src.mkdir()
    shutil.copy(MINICPMO / "checkpoint" / "config.json", minicpmo_src / "config.json")
    os.symlink(MINICPMO / "checkpoint" / "model.safetensors", minicpmo_src / "model.safetensors")
    tiny = json.loads((MINICPMO / "info.json").read_text())["special_token_ids_tiny"]
    (minicpmo_src / "added_tokens.json").write_text(json.dumps(tiny))
    out = {"qwen2_5_omni": (*sources["qwen2_5_omni"], VOCAB)}
    for family, src, vocab in (("qwen3_omni", qwen3_src, VOCAB), ("minicpmo", minicpmo_src, MINICPMO_VOCAB)):
        out[family] = (src, convert_checkpoint(src, root / f"{family}_out", **QUIET), vocab)
    return out


def _copy_source(src: Path, tmp_path: Path) -> Path:
    """A copy of a source directory: its JSON files copied (to be edited), its tensors linked."""
    bad = tmp_path / "bad_src"
    bad.mkdir()
    for entry in src.iterdir():
        if entry.suffix == ".json":
            shutil.copy(entry, bad / entry.name)
        else:
            os.symlink(entry.resolve(), bad / entry.name)
    return bad


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _set_thinker(key, value):
    return lambda config: (config.get("thinker_config") or config).update({key: value})


# (family, the file edited, edit, the field the message names, the bad value)
BAD_SOURCE_IDS = {
    "qwen2_5_omni_image": ("qwen2_5_omni", "config.json", _set_thinker("image_token_index", VOCAB),
                           "omni.image_token_id (image_token_index)", VOCAB),
    "qwen2_5_omni_audio_negative": ("qwen2_5_omni", "config.json", _set_thinker("audio_token_index", -1),
                                    "omni.audio_token_id (audio_token_index)", -1),
    # the chat markers come from the tokenizer files
    "qwen2_5_omni_im_end_tokenizer": ("qwen2_5_omni", "added_tokens.json",
                                      lambda added: added.update({"<|im_end|>": VOCAB + 3}),
                                      "omni.im_end_token_id", VOCAB + 3),
    "qwen3_omni_audio": ("qwen3_omni", "config.json", _set_thinker("audio_token_id", VOCAB + 7),
                         "qwen3_omni.audio_token_id", VOCAB + 7),
    "qwen3_omni_image": ("qwen3_omni", "config.json", _set_thinker("image_token_id", 151655),
                         "qwen3_omni.image_token_id", 151655),
    # `<unk>` is MiniCPM-o's image and audio placeholder
    "minicpmo_placeholder": ("minicpmo", "added_tokens.json",
                             lambda added: added.update({"<unk>": MINICPMO_VOCAB}), "special_tokens['<unk>']",
                             MINICPMO_VOCAB),
}


@pytest.mark.parametrize("case", sorted(BAD_SOURCE_IDS))
def test_converter_refuses_a_special_id_outside_the_vocabulary(omni_sources, tmp_path, no_tensor_reads, case):
    family, name, edit, field, value = BAD_SOURCE_IDS[case]
    src, _, vocab = omni_sources[family]
    bad = _copy_source(src, tmp_path)
    _edit_json(bad / name, edit)
    with pytest.raises(ConfigValueError) as info:
        convert_checkpoint(bad, tmp_path / "fresh", **QUIET)
    error = info.value
    assert field in error.attribute and error.value == value and f"vocab_size = {vocab}" in error.allowed
    assert f"{field}={value}" in str(error) and f"[0, vocab_size = {vocab})" in str(error), str(error)
    assert not (tmp_path / "fresh").exists()
    kept = tmp_path / "kept"  # --force on an existing DST: untouched
    kept.mkdir()
    (kept / "mine.txt").write_text("mine")
    with pytest.raises(ConfigValueError, match=re.escape(field)):
        convert_checkpoint(bad, kept, force=True, **QUIET)
    assert [p.name for p in kept.iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad_src", "kept"]  # no temporary directory left


@pytest.mark.parametrize("value", [7.5, "5", True])
def test_converter_refuses_a_special_id_that_is_not_an_integer(omni_sources, tmp_path, no_tensor_reads, value):
    """A float id is not truncated, nor a string or a bool read as a number: refused by its config key."""
    bad = _copy_source(omni_sources["qwen2_5_omni"][0], tmp_path)
    _edit_json(bad / "config.json", _set_thinker("image_token_index", value))
    with pytest.raises(ConfigValueError) as info:
        convert_checkpoint(bad, tmp_path / "fresh", **QUIET)
    assert info.value.attribute.endswith("image_token_index") and info.value.value == value
    assert f"image_token_index={value!r} is out of range: it must be an integer token id" in str(info.value)
    assert not (tmp_path / "fresh").exists()


# (family, edit of the manifest, the field the message names, the bad value)
BAD_MANIFEST_IDS = {
    "qwen2_5_omni": (lambda m: m["omni"].update(image_token_id=VOCAB), "omni.image_token_id (image_token_index)",
                     VOCAB),
    "qwen3_omni": (lambda m: m["qwen3_omni"].update(audio_token_id=VOCAB + 7), "qwen3_omni.audio_token_id",
                   VOCAB + 7),
    "minicpmo": (lambda m: m["special_tokens"].update({"<unk>": MINICPMO_VOCAB + 1}), "special_tokens['<unk>']",
                 MINICPMO_VOCAB + 1),
}


@pytest.mark.parametrize("family", sorted(BAD_MANIFEST_IDS))
def test_loader_refuses_a_special_id_outside_the_vocabulary(omni_sources, tmp_path, monkeypatch, family):
    edit, field, value = BAD_MANIFEST_IDS[family]
    _, converted, vocab = omni_sources[family]
    assert omnijax.load(converted).family.name == family  # the unedited checkpoint loads
    edited = _with_manifest(converted, tmp_path, edit)
    monkeypatch.setattr(registry, "restore_module", _forbidden)
    with pytest.raises(checkpoint.CheckpointFormatError) as info:
        omnijax.load(edited)
    message = str(info.value)
    assert "invalid special token ids" in message and f"{field}={value}" in message, message
    assert f"[0, vocab_size = {vocab})" in message
    cause = info.value.__cause__
    assert isinstance(cause, ConfigValueError) and field in cause.attribute and cause.value == value
    with pytest.raises(checkpoint.CheckpointFormatError, match=re.escape(field)):
        registry.read_manifest(edited)


def test_converted_special_ids_are_the_sources(omni_sources):
    """No false refusal: each family's valid source converts and loads with the ids it declared."""
    qwen = omnijax.load(omni_sources["qwen2_5_omni"][1])
    assert qwen.omni == demo.tiny_token_ids(VOCAB) and qwen.config.eos_token_ids == (VOCAB - 1,)
    qwen3 = omnijax.load(omni_sources["qwen3_omni"][1])
    assert {k: getattr(qwen3.omni, k) for k in QWEN3_IDS} == QWEN3_IDS
    minicpmo = omnijax.load(omni_sources["minicpmo"][1])
    assert minicpmo.tokens.image_placeholder == minicpmo.special_tokens["<unk>"] < MINICPMO_VOCAB



# ------------------------------------------------------------------------------------------------ no false refusals


def _repo_configs() -> list[Path]:
    return sorted(p for top in ("tests", "omnijax") for p in (REPO / top).rglob("config.json")
                  if "num_attention_heads" in p.read_text(encoding="utf-8"))


def test_released_and_fixture_configs_still_pass():
    configs = _repo_configs()
    assert configs, "no config.json with num_attention_heads found under tests/ or omnijax/"
    for path in configs:
        hf = json.loads(path.read_text(encoding="utf-8"))
        validate_config(converter_for(hf, path).config_from_hf(hf))
    for name, preset in PRESETS.items():
        assert validate_config(preset) is preset, name
    for text_config in (demo.TINY_TEXT_CONFIG, demo.TINY_OMNI_TEXT_CONFIG, QWEN_TEXT):  # the demo's and ours
        hf = {"model_type": "qwen2_5_omni", "thinker_config": {"model_type": "qwen2_5_omni_thinker",
                                                              "text_config": text_config}}
        assert qwen.config_from_hf(hf).vocab_size == text_config["vocab_size"]
    assert llama.config_from_hf(LLAMA).eos_token_ids == (2,)


def test_both_families_convert_and_load(sources):
    """The sources the refusals start from are valid: each converts (fixture) and loads."""
    for family, (_, converted) in sources.items():
        model = omnijax.load(converted)
        assert model.config.vocab_size == VOCAB and model.family.name == family


def test_decoder_config_refuses_bad_values_when_built():
    """The check runs whenever a `DecoderConfig` is built, not only in the converter: a `ValueError` and a
    `ConfigError` at once."""
    base = DecoderConfig(vocab_size=8, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=4)
    for change, needle in ((dict(num_heads=0), "num_heads"), (dict(rope_theta=math.nan), "rope_theta"),
                           (dict(rms_norm_eps=0.0), "rms_norm_eps"), (dict(mrope_section=(-1, 1, 2)), "mrope_section"),
                           (dict(eos_token_ids=(1.5,)), "eos_token_ids")):
        with pytest.raises(ConfigValueError, match=needle) as info:
            base.replace(**change)
        assert isinstance(info.value, ValueError) and isinstance(info.value, ConfigError)
    with pytest.raises(ConfigValueError, match=r"eos_token_ids \(eos_token_id\)=\[8\]"):
        validate_config(base.replace(eos_token_ids=(8,)))
    assert validate_config(base.replace(eos_token_ids=(7,))).eos_token_ids == (7,)


# ------------------------------------------------------------------------------------------------ symlinked DST


def _target_with_marker(tmp_path: Path) -> Path:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious.txt").write_text("keep me")
    return target


def _assert_untouched(link: Path, target: Path, before: str) -> None:
    assert link.is_symlink() and os.readlink(link) == before
    assert [p.name for p in target.iterdir()] == ["precious.txt"] and (target / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("force", [False, True])
def test_symlinked_destination_is_refused_and_its_target_untouched(sources, tmp_path, force):
    target = _target_with_marker(tmp_path)
    link = tmp_path / "out"
    os.symlink(target, link, target_is_directory=True)
    with pytest.raises(DestinationError, match="symbolic link") as info:
        convert_checkpoint(sources["llama"][0], link, force=force, **QUIET)
    assert "pass the link's target" in str(info.value)
    _assert_untouched(link, target, str(target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "out"]  # no temporary directory left


def test_symlink_to_an_empty_directory_and_a_dangling_link_are_refused(sources, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    link = tmp_path / "out"
    os.symlink(empty, link, target_is_directory=True)
    with pytest.raises(DestinationError, match="symbolic link"):
        convert_checkpoint(sources["llama"][0], link, **QUIET)
    assert link.is_symlink() and not any(empty.iterdir())
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    assert main([str(sources["llama"][0]), str(dangling), "--force", "--no-progress"]) == 1
    assert "symbolic link" in capsys.readouterr().err
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()


def test_a_link_among_the_parent_directories_is_followed(sources, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "via", target_is_directory=True)
    out = convert_checkpoint(sources["llama"][0], tmp_path / "via" / "out", **QUIET)
    assert out == real / "out" and (real / "out" / checkpoint.MANIFEST).is_file()
    # and --force replaces a real directory reached through the link, as before
    assert convert_checkpoint(sources["llama"][0], tmp_path / "via" / "out", force=True, **QUIET) == real / "out"
