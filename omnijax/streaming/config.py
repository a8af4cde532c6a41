"""`StreamConfig`: the static settings of a streamed session (retention policy, paging, attention, page size, pool,
decoding), one frozen object with one validation."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from omnijax._checks import check_power_of_two
from omnijax.decoding import Greedy, check_decoding
from omnijax.kv.attention import check_impl
from omnijax.kv.quant_kv import check_kv_dtype
from omnijax.paging import as_paging
from omnijax.retention.base import NoSlide, check_policy, get_policy
from omnijax.retention.recall import Recall


def _default_policy() -> NoSlide:
    return NoSlide()


def _default_decoding() -> Greedy:
    return Greedy()


@dataclasses.dataclass(frozen=True)
class StreamConfig:
    """The static settings of a streamed session, taken by `stream`, `Session`, `EvalConfig` and `EngineConfig`.

    One object, one validation: every field is checked when the config is built, so a bad setting is refused
    before anything compiles. It is hashable and part of the compiled program (a changed field compiles anew).

    Attributes:
        policy: retention policy object (`omnijax.retention`); resolve a name with `omnijax.retention.get_policy`.
        paging: physical layout after eviction: a mode of `omnijax.paging.PAGING_MODES` or a `Paging`.
        impl: attention implementation: "xla" (the default: exact, visits active pages only, many pages per step),
            "pallas" or "reference" (dense over every page-table entry: the oracle, and what H2O's attention mass
            needs; its cost follows the table's width, not what it holds).
        page_size: slots per KV page (a power of two).
        num_pages: pages of the KV pool; None sizes it to hold the whole session without eviction (`stream`,
            `evaluate`) or takes `DEFAULT_SESSION_PAGES` (`Session`). An engine's shared pool needs a number.
        subblock: subblock size of the active-subblock statistic and of `tile_skip` (a power of two).
        max_answer_tokens: tau, the most tokens any chunk may ask its answer for (0: no answers).
        decoding: decoding strategy of answers (`omnijax.decoding`, e.g. `Greedy()`).
        recall: question-time recall of evicted units from a host tier (`omnijax.retention.recall.Recall`); None
            (the default) runs exactly as without it. Carried by `Session`, `Chat`, `evaluate` and the engine, under
            every paging mode and with either `kv_dtype` (`stream` refuses it rather than ignore it).
        kv_dtype: storage of the KV pool: "float" (the default: the model's dtype, as always) or "int8" (int8
            codes with a float32 scale per token and KV head, dequantised on read by every impl: `omnijax.kv.quant_kv`;
            with recall the host tier holds what it evicts dequantised, `omnijax.kv.host_tier`).
    """

    policy: Any = dataclasses.field(default_factory=_default_policy)
    paging: Any = "native"
    impl: str = "xla"
    page_size: int = 64
    num_pages: int | None = None
    subblock: int = 32
    max_answer_tokens: int = 0
    decoding: Any = dataclasses.field(default_factory=_default_decoding)
    recall: Recall | None = None
    kv_dtype: str = "float"

    def __post_init__(self):
        check_policy(self.policy)
        object.__setattr__(self, "paging", as_paging(self.paging))
        check_impl(self.impl)
        if getattr(self.policy, "needs_scores", False) and self.impl != "reference":
            raise ValueError(f"{type(self.policy).__name__} ranks tokens by the attention mass they receive, which "
                             f"only impl='reference' computes; give StreamConfig(impl='reference', ...) "
                             f"(impl is {self.impl!r})")
        check_power_of_two("page_size", self.page_size)
        check_power_of_two("subblock", self.subblock)
        if self.num_pages is not None and (isinstance(self.num_pages, bool) or not isinstance(
                self.num_pages, numbers.Integral) or self.num_pages < 1):
            raise ValueError(f"num_pages must be a positive int or None, got {self.num_pages!r}")
        if (isinstance(self.max_answer_tokens, bool) or not isinstance(self.max_answer_tokens, numbers.Integral)
                or self.max_answer_tokens < 0):
            raise ValueError(f"max_answer_tokens must be an int >= 0, got {self.max_answer_tokens!r}")
        check_decoding(self.decoding)
        check_kv_dtype(self.kv_dtype)
        if self.recall is not None:
            if not isinstance(self.recall, Recall):
                raise TypeError(f"recall must be an omnijax.retention.recall.Recall or None, got "
                                f"{type(self.recall).__name__}: {self.recall!r}")
            if self.num_pages is not None:
                self.recall.check_pool(self.num_pages * self.page_size)

    def replace(self, **changes: Any) -> "StreamConfig":
        """A copy with `changes` applied (validated like a new config)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, config: "StreamConfig | None" = None, **fields: Any) -> "StreamConfig":
        """`config` (default `StreamConfig()`) with the keyword `fields` applied: how `stream`, `Session` and
        `EvalConfig` accept the fields as keywords. Refuses a name that is not a field, listing the fields."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(fields) - set(names))
        if unknown:
            raise TypeError(f"unknown StreamConfig field(s) {unknown}; the fields are {names}")
        if config is None:
            return cls(**fields)
        if not isinstance(config, cls):
            raise TypeError(f"config must be an omnijax.StreamConfig, got {type(config).__name__}: {config!r}")
        return config.replace(**fields) if fields else config

    @classmethod
    def parse(cls, spec: str, **fields: Any) -> "StreamConfig":
        """`policy[:key=value,...][+paging]` -> a config (the command lines' form), e.g.
        `"omnipick:high_watermark=600,low_watermark=400+tile_skip"`; the policy part resolves through
        `omnijax.retention.get_policy` (`full` is NoSlide)."""
        head, _, paging = spec.partition("+")
        return cls.of(policy=get_policy(head), paging=paging or "native", **fields)

    def for_model(self, whole_source_image: bool) -> "StreamConfig":
        """The config as it runs for a model whose family does (or does not) keep a unit's source image whole
        (`Family.whole_source_image`; False for a bare decoder): settings a policy leaves to the model family
        (OmniPick's `source_image_whole=None`) are filled in. A policy that takes such a hint has a
        `for_model(whole_source_image)` method (`omnijax.retention.RetentionPolicy`)."""
        bind = getattr(self.policy, "for_model", None)
        policy = bind(whole_source_image) if bind is not None else self.policy
        return self if policy == self.policy else self.replace(policy=policy)


# `Session`'s pool when `StreamConfig.num_pages` is None (it cannot size itself to a session it has not seen).
DEFAULT_SESSION_PAGES = 64
