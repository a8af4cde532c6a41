"""The voices of a Qwen2.5-Omni release: `spk_dict.pt` (speaker name -> `cond`, `ref_mel`, `bos_token`), read without
torch, and stored in an omnijax checkpoint as the "speech" component (JSON: each voice's start token and shapes; a
tree of float32 arrays: each voice's conditioning vector and reference mel).

transformers loads `spk_dict.pt` with `torch.load(weights_only=True)`. The file is torch's zip serialisation: a pickle
(`*/data.pkl`) whose tensors are `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` calls over
persistent storages `("storage", torch.<Type>Storage, key, location, numel)` stored raw (little-endian) as
`*/data/<key>`. `read_speaker_dict` reads exactly that with a restricted unpickler (dicts, strings, numbers and those
two callables; anything else is refused), so conversion needs no torch.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import jax
import numpy as np

from omnijax.errors import ConvertError, MissingTensorError

__all__ = ["SPEAKER_FILE", "Voice", "VoiceFileError", "read_release_voices", "read_speaker_dict", "voices_abstract",
           "voices_from_tree", "voices_to_component"]

SPEAKER_FILE = "spk_dict.pt"

# torch storage types -> numpy dtype (bfloat16: the raw 16 bits, widened to float32 below)
_STORAGES = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
             "BFloat16Storage": "bfloat16", "LongStorage": np.int64, "IntStorage": np.int32}


class VoiceFileError(ConvertError):
    """A speaker file omnijax cannot read (not torch's zip format, or objects other than tensors and numbers)."""


@dataclasses.dataclass(frozen=True)
class Voice:
    """One speaker of the release.

    Attributes:
        name: as `spk_dict.pt` spells it (transformers matches it exactly: "Chelsie", "Ethan").
        conditioning: `[E]` float32, the DiT's speaker vector (`cond`).
        reference_mel: `[T_ref, M]` float32, the speaker's reference mel (`ref_mel`).
        bos_token: the thinker-vocabulary id that opens the talker's answer rows for this voice.
    """

    name: str
    conditioning: np.ndarray
    reference_mel: np.ndarray
    bos_token: int


class _Storage:
    def __init__(self, dtype: Any, key: str):
        self.dtype, self.key = dtype, key


def _rebuild_tensor(storage: Any, offset: int, size: tuple, stride: tuple, *_: Any) -> np.ndarray:
    flat = storage  # the decoded 1-D array (persistent_load)
    itemsize = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[offset:], shape=tuple(size),
                                           strides=tuple(s * itemsize for s in stride)).copy()


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, root: str):
        super().__init__(io.BytesIO(data))
        self.archive, self.root = archive, root

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGES:
            return name
        raise VoiceFileError(f"{SPEAKER_FILE}: refusing to load {module}.{name} (only tensors, dicts and numbers "
                             "are read)")

    def persistent_load(self, pid: Any) -> np.ndarray:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in _STORAGES):
            raise VoiceFileError(f"{SPEAKER_FILE}: unsupported storage reference {pid!r}")
        _, kind, key, _, numel = pid
        raw = self.archive.read(f"{self.root}/data/{key}")
        dtype = _STORAGES[kind]
        if dtype == "bfloat16":
            bits = np.frombuffer(raw, "<u2", count=numel).astype(np.uint32) << 16
            return bits.view(np.float32)
        return np.frombuffer(raw, np.dtype(dtype).newbyteorder("<"), count=numel)


def read_speaker_dict(path: str | Path) -> dict[str, Voice]:
    """The voices of a release's `spk_dict.pt`.

    Raises:
        VoiceFileError: not torch's zip format, a big-endian file, objects other than tensors / numbers, or a voice
            without `cond`, `ref_mel` or `bos_token` (each message names the file and what is wrong).
    """
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise VoiceFileError(f"{path}: not torch's zip serialisation ({e})") from e
    with archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl")]
        if len(pickles) != 1:
            raise VoiceFileError(f"{path}: expected one */data.pkl entry, found {pickles}")
        root = pickles[0].rsplit("/", 1)[0]
        order = f"{root}/byteorder"
        if order in archive.namelist() and archive.read(order).strip() != b"little":
            raise VoiceFileError(f"{path}: big-endian tensors are not supported")
        try:
            data = _Unpickler(archive.read(pickles[0]), archive, root).load()
        except VoiceFileError:
            raise
        except Exception as e:  # a malformed pickle
            raise VoiceFileError(f"{path}: unreadable speaker dict ({e})") from e
    if not isinstance(data, dict) or not data:
        raise VoiceFileError(f"{path}: expected a non-empty dict of speakers, got {type(data).__name__}")
    voices = {}
    for name, entry in data.items():
        missing = [k for k in ("cond", "ref_mel", "bos_token") if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise VoiceFileError(f"{path}: speaker {name!r} lacks {missing}")
        cond = np.asarray(entry["cond"], np.float32)
        ref = np.asarray(entry["ref_mel"], np.float32)
        cond = cond[0] if cond.ndim == 2 and cond.shape[0] == 1 else cond
        ref = ref[0] if ref.ndim == 3 and ref.shape[0] == 1 else ref
        bos = entry["bos_token"]
        bos = int(bos.reshape(-1)[0]) if isinstance(bos, np.ndarray) and bos.size == 1 else bos
        if cond.ndim != 1 or ref.ndim != 2 or isinstance(bos, bool) or not isinstance(bos, (int, np.integer)):
            raise VoiceFileError(f"{path}: speaker {name!r} has cond {cond.shape}, ref_mel {ref.shape}, bos_token "
                                 f"{bos!r}; expected [E] (or [1, E]), [T, M] (or [1, T, M]) and an integer")
        voices[str(name)] = Voice(str(name), cond, ref, int(bos))
    return voices


def read_release_voices(directory: str | Path) -> dict[str, Voice]:
    """The voices of a release directory (its `spk_dict.pt`, `read_speaker_dict`).

    Raises:
        MissingTensorError: the directory has no `spk_dict.pt` (transformers refuses such a release too).
        VoiceFileError: the file cannot be read.
    """
    path = Path(directory) / SPEAKER_FILE
    if not path.is_file():
        raise MissingTensorError(f"{path} not found: a Qwen2.5-Omni release with audio output ships its voices in "
                                 f"{SPEAKER_FILE} (a release without speech output sets enable_audio_output false)")
    return read_speaker_dict(path)


def voices_to_component(voices: dict[str, Voice]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The "speech" component of a checkpoint: (JSON entry: each voice's start token and array shapes, tree of
    float32 arrays)."""
    entry = {"voices": {v.name: {"bos_token": v.bos_token, "conditioning": list(v.conditioning.shape),
                                 "reference_mel": list(v.reference_mel.shape)} for v in voices.values()}}
    tree = {v.name: {"conditioning": v.conditioning, "reference_mel": v.reference_mel} for v in voices.values()}
    return entry, tree


def voices_abstract(entry: dict[str, Any]) -> dict[str, Any]:
    """The tree of `jax.ShapeDtypeStruct`s the "speech" component's arrays restore into."""
    return {name: {k: jax.ShapeDtypeStruct(tuple(meta[k]), np.float32) for k in ("conditioning", "reference_mel")}
            for name, meta in entry["voices"].items()}


def voices_from_tree(entry: dict[str, Any], tree: dict[str, Any]) -> dict[str, Voice]:
    """The voices of a checkpoint's "speech" component (`voices_to_component`'s output read back)."""
    return {name: Voice(name, np.asarray(tree[name]["conditioning"], np.float32),
                        np.asarray(tree[name]["reference_mel"], np.float32), int(meta["bos_token"]))
            for name, meta in entry["voices"].items()}
