"""A long conversation through a bounded cache, on a real model: does the cache keep a fact stated in turn 1?

Turn 1 states a five-digit pass key; small-talk exchanges follow (their assistant turns are scripted, added with
`Chat.add` as though the model had said them, so every run feeds the same text); the last turn asks for the key,
and the model answers it greedily. The same conversation runs through three `omnijax.Chat` sessions whose caches
differ only in the retention policy: full context (NoSlide), OmniPick and a sink-anchored sliding window
(SinkWindow) with the same cell budget. OmniPick keeps the system prompt, the newest turns whole and the oldest text
up to its text budget, so turn 1 survives its trims; the window keeps the newest cells, so turn 1 falls out.

Every message fits a 32-token chunk (`Chat` pads chunks to power-of-two buckets), so each session compiles two
step programs (buckets 16 and 32) and a short chat with the same config reuses them.
"""

from __future__ import annotations

import dataclasses
import re
import time

import numpy as np

from omnijax.chat import Chat
from omnijax.models.family import OmniModel
from omnijax.plot import SessionTrace
from omnijax.retention import NoSlide, OmniPick, SinkWindow
from omnijax.streaming.config import StreamConfig

SYSTEM = "You are a helpful assistant. Answer briefly."
KEY_TURN = "Please remember this: the pass key is {key}. I will ask you for it later."
KEY_REPLY = "Sure, I will remember the pass key."
QUESTION = "What is the pass key I gave you at the start? Answer with the number only."
# Small talk between the key and the question: (user, scripted assistant reply), each message within 32 tokens.
EXCHANGES = (
    ("How do I keep basil fresh?", "Stand the stems in a glass of water on the counter, away from direct sun, and "
                                   "change the water every day."),
    ("What is a good stretch after running?", "Lean on a wall with one leg back and the heel down, hold for "
                                              "thirty seconds, then switch legs."),
    ("Why is the sky blue?", "Air scatters blue light from the sun much more than red light, so blue reaches your "
                             "eyes from every direction."),
    ("Can you suggest a name for a grey cat?", "Smoke, Pebble, Ash or Misty. Short names are easiest for a cat to "
                                               "learn."),
    ("How long should I boil an egg?", "About six minutes for a soft yolk and ten for a firm one, then cool it in "
                                       "cold water."),
    ("What is the difference between weather and climate?", "Weather is the air on a given day; climate is the "
                                                             "pattern of weather over many years."),
    ("Give me a tip for learning a language.", "Practise a little every day: short daily sessions help new words "
                                               "stay in your memory."),
    ("How do plants drink water?", "Roots take water from the soil, and it rises through thin tubes in the stem up "
                                   "to the leaves."),
    ("What should I pack for a day hike?", "Water, a snack, a map, sunscreen, a light jacket and sturdy shoes."),
    ("Why do leaves change colour in autumn?", "Trees stop making green chlorophyll, so the yellow and orange "
                                               "pigments underneath show."),
    ("How can I sleep better?", "Keep a regular bedtime, avoid screens before bed, and keep the bedroom cool and "
                                "dark."),
    ("What makes bread rise?", "Yeast turns sugar into carbon dioxide, and the gas trapped in the dough makes it "
                               "expand."),
    ("How do bees make honey?", "They bring nectar to the hive and fan it with their wings until it thickens into "
                                "honey."),
    ("How do I start journaling?", "Write three sentences each evening about your day. Keeping it short makes the "
                                   "habit easy."),
    ("Why does ice float?", "Water expands when it freezes, so ice is less dense than the liquid around it."),
)


@dataclasses.dataclass(frozen=True)
class Run:
    """One policy's run of the conversation."""

    name: str
    answer: str
    correct: bool
    retained: int  # cells held at the end
    peak: int  # most cells held after any step
    key_turn_kept: int  # tokens of turn 1 (the pass key) still in the cache at the end
    key_turn_fed: int
    seconds: float
    trace: SessionTrace


def pass_key(seed: int) -> int:
    """The five-digit key of a seed."""
    return int(np.random.default_rng(seed).integers(10_000, 100_000))


def configs(budget: int, page_size: int = 16) -> dict[str, StreamConfig]:
    """Full context, OmniPick and SinkWindow, the bounded two holding at most about `budget` cells.

    OmniPick trims above `budget` cells down to about three quarters of it, keeping the oldest text of older turns
    up to a quarter of the budget (`text_budget`: what it keeps beyond the system prompt and the two newest turns
    must fit under the low watermark, or whole turns are dropped oldest first); SinkWindow keeps 4 sink cells and
    the newest `budget - 4`. NoSlide's pool (64 pages of 16 cells) holds the whole conversation.
    """
    bounded = -(-2 * budget // page_size) + 4
    common = dict(page_size=page_size, max_answer_tokens=16)
    pick = OmniPick(high_watermark=budget, low_watermark=3 * budget // 4, text_budget=budget // 4)
    return {"NoSlide": StreamConfig(policy=NoSlide(), num_pages=64, **common),
            "OmniPick": StreamConfig(policy=pick, num_pages=bounded, **common),
            "SinkWindow": StreamConfig(policy=SinkWindow(sink=4, window=budget - 4), num_pages=bounded, **common)}


def converse(model: OmniModel, config: StreamConfig, *, key: int, exchanges: int) -> Chat:
    """The conversation up to (not including) the question, fed into a new `Chat`."""
    chat = Chat(model, config)
    chat.system(SYSTEM)
    chat.user(KEY_TURN.format(key=key))
    chat.add({"role": "assistant", "content": KEY_REPLY})
    for question, reply in EXCHANGES[:exchanges]:
        chat.user(question)
        chat.add({"role": "assistant", "content": reply})
    return chat


def run(model: OmniModel, name: str, config: StreamConfig, *, key: int, exchanges: int) -> Run:
    """One policy's run: the conversation, the question, and what the cache held."""
    started = time.perf_counter()
    chat = converse(model, config, key=key, exchanges=exchanges)
    answer = "".join(chat.ask(QUESTION, max_tokens=16)).strip()
    seconds = time.perf_counter() - started
    key_rows = [r for r in chat.kept() if r.unit == _key_unit(chat)]
    return Run(name=name, answer=answer, correct=answers_key(answer, key), retained=chat.steps[-1].retained,
               peak=max(s.retained for s in chat.steps), key_turn_kept=sum(r.kept for r in key_rows),
               key_turn_fed=sum(r.fed for r in key_rows), seconds=seconds, trace=chat.trace())


def _key_unit(chat: Chat) -> int:
    return next(r.unit for r in chat.units if r.kind == "user")  # the first user turn states the key


def answers_key(answer: str, key: int) -> bool:
    """Whether the answer states the key (its digits, as one number)."""
    return str(key) in re.findall(r"\d+", answer.replace(",", ""))


def conversation_tokens(model: OmniModel, exchanges: int, key: int) -> int:
    """Tokens of the conversation as fed (template included), question and generation prompt included."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": KEY_TURN.format(key=key)},
                {"role": "assistant", "content": KEY_REPLY}]
    for question, reply in EXCHANGES[:exchanges]:
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": QUESTION})
    return len(model.tokenizer.encode(model.tokenizer.render(messages, add_generation_prompt=True)))


def table(runs: list[Run], key: int) -> str:
    """The side-by-side table of the runs."""
    lines = [f"{'policy':>10}  {'cells held':>10}  {'peak':>4}  {'turn 1 kept':>11}  {'s':>5}  answer (key {key})"]
    for r in runs:
        verdict = "right" if r.correct else "wrong"
        lines.append(f"{r.name:>10}  {r.retained:>10}  {r.peak:>4}  {f'{r.key_turn_kept}/{r.key_turn_fed}':>11}  "
                     f"{r.seconds:>5.1f}  {r.answer!r} ({verdict})")
    return "\n".join(lines)


__all__ = ["EXCHANGES", "Run", "answers_key", "configs", "conversation_tokens", "converse", "pass_key",
           "run", "table"]
