"""Logical retention policies: frozen dataclasses of static hyperparameters with pure, vectorised plans that run
inside the streaming scan (see `omnijax.retention.base`)."""

from omnijax.retention.base import (REGISTRY, NoSlide, RetentionPolicy, SequenceView, apply, get_policy, register,
                                    sequence_view, trim)

__all__ = ["REGISTRY", "NoSlide", "RetentionPolicy", "SequenceView", "apply", "get_policy", "register",
           "sequence_view", "trim"]
