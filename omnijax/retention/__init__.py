"""Logical retention policies: frozen dataclasses of static hyperparameters with pure, vectorised plans that run
inside the streaming scan (see `omnijax.retention.base`)."""

from omnijax.retention.base import (
                                    REGISTRY,
                                    NoSlide,
                                    RetentionPolicy,
                                    SequenceView,
                                    SlotFeatures,
                                    apply,
                                    get_policy,
                                    register,
                                    sequence_view,
                                    slot_features,
                                    trim,
)
from omnijax.retention.baselines import H2O, SinkWindow, StreamingLLM, TokenSliding
from omnijax.retention.kv_aware import InfiniPotV, StreamMem
from omnijax.retention.modality import OmniMemBudgets, StreamingVLM
from omnijax.retention.omnipick import OmniPick
from omnijax.retention.token_drop import DifferentialTokenDrop, differential_token_drop
from omnijax.retention.units import OfficialUnitWindow, UnitFIFO

__all__ = ["H2O", "REGISTRY", "DifferentialTokenDrop", "InfiniPotV", "NoSlide", "OfficialUnitWindow", "OmniMemBudgets",
           "OmniPick", "SinkWindow", "SlotFeatures", "StreamMem", "StreamingLLM", "StreamingVLM", "TokenSliding",
           "UnitFIFO", "RetentionPolicy", "SequenceView", "apply", "differential_token_drop", "get_policy", "register",
           "sequence_view", "slot_features", "trim"]
