"""Record transformers' `Qwen2VLVideoProcessor` outputs for the cases of `tests/_support/video_golden.py`.

The processor runs its resize through torchvision, which cannot be installed beside the project's CPU torch (the
package index's torchvision wheels are CUDA builds that break it), so this script runs once in a second virtual
environment, from the repository root:

    python3.11 -m venv /tmp/tv-venv
    /tmp/tv-venv/bin/pip install torch==2.14.1 torchvision==0.29.1 transformers==5.2.0 numpy pillow
    /tmp/tv-venv/bin/python tests/_support/data/video_processor/make.py

(the torch and torchvision wheels are large CUDA builds; the processor runs on the CPU). It writes, beside itself,
`golden.npz` (per case `NAME/pixel_values_videos` float32 and `NAME/video_grid_thw` int64, compressed) and
`golden.json` (the package versions, each family's processor construction kwargs and settings, and per case its
recipe, the sha256 of its input frames and the `size` it was called with). It needs numpy, torch, torchvision and
transformers only: the inputs come from `video_golden.Case.video` (numpy), not from omnijax.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from tests._support import video_golden as G  # noqa: E402

MAX_BYTES = 2_000_000
# The Qwen3-Omni release's preprocessor_config.json vision settings (Qwen/Qwen3-Omni-30B-A3B-Instruct), as the
# frontend test builds its image processor.
QWEN3_RELEASE_VISION = dict(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5, 0.5, 0.5],
                            image_std=[0.5, 0.5, 0.5], min_pixels=3136, max_pixels=12845056)


def _jsonable(value):
    """Processor settings as JSON (enums by value, tuples as lists)."""
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "value") and not isinstance(value, (int, float, str, bool)):
        return _jsonable(value.value)
    return value


def processors():
    """Per family: the processor, its construction kwargs, and the `size` its HF processor calls it with."""
    import transformers
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessorKwargs

    q25 = transformers.Qwen2VLVideoProcessor()
    q3 = transformers.Qwen2VLVideoProcessor(**QWEN3_RELEASE_VISION)
    q3_size = dict(Qwen3OmniMoeProcessorKwargs._defaults["videos_kwargs"]["size"])
    return {"qwen2_5_omni": (q25, {}, dict(q25.size)), "qwen3_omni": (q3, QWEN3_RELEASE_VISION, q3_size)}


def main() -> None:
    import torch
    import torchvision
    import transformers

    families = processors()
    arrays, cases = {}, []
    for case in G.CASES:
        processor, _, default_size = families[case.family]
        size = {"shortest_edge": case.min_pixels or default_size["shortest_edge"],
                "longest_edge": case.max_pixels or default_size["longest_edge"]}
        video = case.video()
        out = processor(videos=[video], size=size, return_tensors="pt")  # the fast processor returns torch only
        rows = out["pixel_values_videos"].numpy()
        grid = out["video_grid_thw"].numpy().astype(np.int64)
        assert rows.dtype == np.float32 and rows.shape[0] == int(grid.prod()), (case.name, rows.shape, grid)
        arrays[f"{case.name}/pixel_values_videos"] = rows
        arrays[f"{case.name}/video_grid_thw"] = grid
        cases.append({"name": case.name, "recipe": G._recipe(case), "input_shape": list(video.shape),
                      "input_sha256": G.sha256(video), "size": size, "video_grid_thw": grid.tolist(),
                      "pixel_values_videos_shape": list(rows.shape)})
        print(f"{case.name}: {video.shape} -> grid {grid.tolist()}, rows {rows.shape}")
    npz = G.FOLDER / "golden.npz"
    np.savez_compressed(npz, **arrays)
    info = {
        "oracle": "transformers.Qwen2VLVideoProcessor (the video processor of Qwen2_5OmniProcessor and "
                  "Qwen3OmniMoeProcessor), called per case as processor(videos=[frames], size=size, "
                  "return_tensors='pt')",
        "versions": {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
                     "torchvision": torchvision.__version__, "transformers": transformers.__version__},
        "processors": {family: {"init_kwargs": init, "default_size": size, "settings": _jsonable(p.to_dict())}
                       for family, (p, init, size) in families.items()},
        "cases": cases,
    }
    (G.FOLDER / "golden.json").write_text(json.dumps(info, indent=1) + "\n")
    total = npz.stat().st_size
    print(f"{npz}: {total:,} bytes")
    if total > MAX_BYTES:
        raise SystemExit(f"golden.npz is {total:,} bytes, over the {MAX_BYTES:,} budget: shrink the cases")


if __name__ == "__main__":
    main()
