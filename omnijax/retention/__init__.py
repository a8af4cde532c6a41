"""Logical retention policies: frozen dataclasses of static hyperparameters with pure, jittable trimming."""

from omnijax.retention.base import REGISTRY, NoSlide, RetentionPolicy, get_policy, register

__all__ = ["REGISTRY", "NoSlide", "RetentionPolicy", "get_policy", "register"]
