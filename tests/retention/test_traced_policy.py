"""`tests/_support/traced_policy.plan_traced`: a policy's plan with numeric settings traced equals the policy's own
plan, one compiled program serves every value of the traced settings, and a setting the policy lacks is refused."""

import numpy as np
import pytest

from omnijax.retention import InfiniPotV, SequenceView, SlotFeatures
from tests._support import traced_policy


def _case(seed, S=16, d=4):
    rng = np.random.default_rng(seed)
    live = rng.random((1, S)) < 0.9
    view = SequenceView(live=live, pos=np.zeros((1, 1, S), np.int32), unit=rng.integers(0, 4, (1, S)).astype(np.int32),
                        span=rng.choice([2, 3, 6], (1, S)).astype(np.int32),
                        offset=rng.integers(0, 4, (1, S)).astype(np.int32),
                        order=rng.permutation(S)[None].astype(np.int32), score=np.zeros((1, S), np.float32),
                        retained=live.sum(axis=1).astype(np.int32))
    features = SlotFeatures(key=rng.standard_normal((1, S, d)).astype(np.float32),
                            value_norm=rng.random((1, S)).astype(np.float32))
    return view, features


def test_traced_settings_share_one_program_and_equal_the_plan():
    traced = ("budget", "recent_units", "tar_fraction")
    before = traced_policy._plan._cache_size()
    for seed, policy in enumerate([InfiniPotV(budget=5, recent_units=1, tar_fraction=0.0),
                                   InfiniPotV(budget=9, recent_units=2, tar_fraction=0.5),
                                   InfiniPotV(budget=12, recent_units=1, tar_fraction=1.0)]):
        view, features = _case(seed)
        got = np.asarray(traced_policy.plan_traced(policy, view, features, traced))
        np.testing.assert_array_equal(got, np.asarray(policy.plan(view, features)))
    assert traced_policy._plan._cache_size() == before + 1
    with pytest.raises(ValueError, match="no setting \\['window'\\]"):
        traced_policy.plan_traced(InfiniPotV(), *_case(0), ("window",))
