"""Declarative conversion tables (`Rule`, `Component`, `plan_conversion`, `fill`, `convert_in_memory`, ...): the
table language of `omnijax.checkpoint.name_tables`, re-exported.

It lives in omnijax because the model modules hold the tables of their own parameter trees (and load Hugging Face
tensors in memory with them), and the models never import the converter; the converter's per-family modules
(`omnijax.models.qwen2_5_omni.convert`, `omnijax.models.minicpmo.convert`) assemble the tables into a whole checkpoint's plan.
"""

from omnijax.checkpoint.name_tables import (
    TRANSFORMS, Component, Plan, Rule, allocate, convert_in_memory, fill, leaf, param_shapes, plan_conversion)

__all__ = ["Component", "Plan", "Rule", "TRANSFORMS", "allocate", "convert_in_memory", "fill", "leaf",
           "param_shapes", "plan_conversion"]
