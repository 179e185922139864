"""Workload presets: who arrives when, with what prompt, so that ``minipaged watch`` has something to show.

A workload is a list of arrivals (the engine step before which a request is added, its prompt, its
SamplingParams) plus the engine options that make its lesson visible: a pool small enough to fill, a token
budget small enough that long prompts are chunked. Suggested options apply only where the user set nothing.

Each preset teaches one thing:

* ``shared-system-prompt`` (default): every request starts with the same long system prompt, so after the
  first one its blocks are shared (ref count > 1) and later prompts are mostly prefix-cache hits.
* ``chat``: short independent questions arriving one by one: continuous batching in its plainest form.
* ``long-prompts``: long documents under a small token budget: chunked prefill, decodes mixed with chunks.
* ``burst``: many requests at once into a pool that holds a few: the waiting queue, admission control, and
  preemption as the admitted ones grow.
* ``oversubscribed``: requests that keep growing in a pool too small for all of them: preemption.

Everything is deterministic for a given seed, so a workshop room sees the same run on every laptop.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .request import SamplingParams

DEFAULT_WORKLOAD = "shared-system-prompt"
# The `watch` flags that shape a workload (a lesson and a replay bring their own workload, so they refuse these).
WORKLOAD_ARG_NAMES = ("workload", "prompts", "num_requests", "rate", "max_tokens")

SYSTEM_PROMPT = (
    "You are a patient teaching assistant at a workshop about how large language models are served. "
    "Answer in plain English, in two or three short sentences, without lists or code. If a question is "
    "ambiguous, pick the most common meaning and say so. Prefer concrete examples over definitions, keep "
    "numbers approximate, and never invent references. The audience knows Python but not machine learning, "
    "so explain any jargon you use in a few words."
)

QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "How does a bicycle stay upright?",
    "What does a compiler do?",
    "Why do cats purr?",
    "How do vaccines work?",
    "What is a black hole?",
    "Why does bread rise?",
    "How does a refrigerator keep food cold?",
    "What causes the seasons on Earth?",
    "How do bees make honey?",
    "What is the difference between weather and climate?",
    "Why is the ocean salty?",
    "How does a battery store energy?",
    "What is photosynthesis?",
    "Why do we dream?",
    "How does GPS know where I am?",
    "What is inflation in economics?",
    "How do airplanes fly?",
    "Why do leaves change colour in autumn?",
    "What is a prime number?",
    "How does the internet route a message?",
    "Why does ice float on water?",
    "What makes a rainbow?",
    "How do noise-cancelling headphones work?",
    "What is the tallest mountain in the world?",
    "Why do we have leap years?",
    "How does a microwave oven heat food?",
    "What is a hash table?",
    "Why do onions make people cry?",
    "How do tides work?",
    "What is the speed of light?",
)

SENTENCES = (
    "The committee met on a rainy Tuesday to review the quarterly report.",
    "Sales in the northern region rose slightly while the southern stores held steady.",
    "A new warehouse opened near the river, which shortened delivery times by a day.",
    "Several customers asked for longer opening hours during the holiday season.",
    "The finance team noted that shipping costs had doubled since the spring.",
    "Engineers replaced the old ticketing system with a simpler web form.",
    "Staff training on the new tools took two weeks and went mostly smoothly.",
    "One supplier was late three times, so the contract is under review.",
    "The marketing budget was moved from print adverts to local radio.",
    "Energy use in the main office fell after the lighting was replaced.",
    "A customer survey rated friendliness highly but waiting times poorly.",
    "The board asked for a plan to reduce returns of damaged goods.",
    "Two senior managers will retire next year and successors are being trained.",
    "The pilot of a loyalty card doubled repeat visits in the test town.",
    "Rent for the city-centre shop will rise by a tenth in January.",
    "Volunteers from the staff cleaned up the park beside the head office.",
)


# Speculative decoding's two workloads (bench/spec_decode.py, the tuning walkthrough): answers that quote
# their prompt (a passage to repeat or correct: n-gram drafts find it) and open questions (they find little).
PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He polished the great lens, "
    "trimmed the wick and wrote the weather in a leather book. Ships passed far out at sea, and none of "
    "them knew his name, but every one of them saw his light.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into "
    "sugar and oxygen. It takes place in the chloroplasts, which contain a green pigment called chlorophyll. "
    "Almost all life on Earth depends on it.",
    "To make a simple tomato sauce, warm olive oil in a pan, add a chopped onion and cook it slowly until it "
    "is soft. Add two cloves of garlic, a tin of tomatoes and a pinch of salt, then let it simmer for twenty "
    "minutes, stirring now and then.",
    "The city library opens at nine in the morning and closes at eight in the evening. Members may borrow up "
    "to ten books at a time for three weeks. Late returns cost ten cents a day, and lost books must be "
    "replaced or paid for.",
    "Mount Everest is the highest mountain above sea level, on the border between Nepal and China. Its summit "
    "is 8,849 metres high. The first confirmed ascent was made in 1953 by Edmund Hillary and Tenzing Norgay.",
    "Dear team, the quarterly review will take place on Thursday at ten o'clock in the large meeting room. "
    "Please bring your project updates and a list of open questions. Coffee and sandwiches will be provided.",
    "A binary search finds an item in a sorted list by comparing it with the middle element. If the item is "
    "smaller, the search continues in the left half; if it is larger, in the right half. Each step halves "
    "the remaining list.",
    "The river rises in the hills, flows through green valleys and small villages, and reaches the sea after "
    "two hundred kilometres. In spring the melting snow makes it wide and fast; in late summer it is slow "
    "and shallow.",
]
INSTRUCTIONS = ["Repeat the following passage exactly, word for word:\n\n{}",
                "Rewrite the following passage, keeping every sentence but fixing any mistakes:\n\n{}"]
OPEN_ENDED = [
    "Write a short story about a robot who learns to paint.", "Explain why the sky is blue.",
    "Give me three ideas for a birthday party.", "What are the benefits of learning a second language?",
    "Describe your perfect weekend.", "How do airplanes stay in the air?", "Write a poem about the ocean.",
    "What should I pack for a hiking trip?", "Explain what a computer virus is.", "Tell me about the moon.",
    "Why do cats purr?", "How can I sleep better?", "Write a letter to a friend about a holiday.",
    "What is the water cycle?", "Suggest a plan for learning to cook.", "Why is exercise good for you?",
]


@dataclass(frozen=True)
class Arrival:
    """One request of a workload: added to the engine just before engine step ``step`` (1 = the first)."""

    step: int
    prompt: str                       # the user's text
    params: SamplingParams
    system: Optional[str] = None      # a system prompt, sent through the chat template when the model has one


@dataclass(frozen=True)
class Workload:
    name: str
    description: str                  # what to look at while it runs (shown in the TUI)
    arrivals: tuple[Arrival, ...]
    engine_options: dict[str, Any] = field(default_factory=dict)   # suggestions; the user's flags win


@dataclass(frozen=True)
class _Preset:
    description: str
    num_requests: int
    rate: float                       # arrivals per engine step
    max_tokens: int
    engine_options: dict[str, Any]
    system: Optional[str] = None
    kind: str = "questions"           # where prompts come from: "questions" or "documents"
    ignore_eos: bool = False


PRESETS: dict[str, _Preset] = {
    "shared-system-prompt": _Preset(
        "Every request starts with the same long system prompt: watch its blocks become shared (x2, x3 ...) "
        "and later prompts hit the prefix cache.",
        num_requests=24, rate=1 / 3, max_tokens=64, system=SYSTEM_PROMPT,
        engine_options={"num_blocks": 96, "max_num_batched_tokens": 256}),
    "chat": _Preset(
        "Short independent questions arriving one by one: continuous batching admits each as soon as it comes.",
        num_requests=16, rate=0.5, max_tokens=64,
        engine_options={"num_blocks": 128, "max_num_batched_tokens": 512}),
    "long-prompts": _Preset(
        "Long documents under a small token budget: prompts are prefilled in chunks, mixed with other "
        "requests' decodes.",
        num_requests=6, rate=0.25, max_tokens=32, kind="documents",
        engine_options={"num_blocks": 256, "max_num_batched_tokens": 128}),
    "burst": _Preset(
        "Many requests at once into a small pool: only a few fit, most wait in the queue for blocks, and "
        "running ones that outgrow the pool are preempted.",
        num_requests=24, rate=24.0, max_tokens=32,
        # 16 blocks of 16 tokens hold about 5 of these prompts; 64 blocks held all 24 (issue 16, defect 5).
        engine_options={"num_blocks": 16, "max_num_batched_tokens": 512}),
    "oversubscribed": _Preset(
        "Requests keep growing in a pool too small for all of them: the newest running request is preempted "
        "(try --preemption-mode swap).",
        num_requests=12, rate=1.0, max_tokens=128, ignore_eos=True,
        engine_options={"num_blocks": 48, "max_num_batched_tokens": 256, "num_cpu_blocks": 64}),
}


def arrival_steps(num_requests: int, rate: float) -> list[int]:
    """Request i arrives before step 1 + floor(i / rate): ``rate`` arrivals per step, evenly spread."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 arrivals per step, got {rate}.")
    return [1 + int(i / rate + 1e-9) for i in range(num_requests)]


def _document(rng: random.Random, num_sentences: int) -> str:
    return " ".join(rng.choice(SENTENCES) for _ in range(num_sentences))


def make_workload(name: str = DEFAULT_WORKLOAD, *, num_requests: Optional[int] = None,
                  rate: Optional[float] = None, max_tokens: Optional[int] = None, seed: int = 0,
                  prompts: Optional[Sequence[str]] = None) -> Workload:
    """Build a preset. ``prompts`` (e.g. from ``--prompts FILE``) replace the preset's own user texts.

    The same arguments always give the same workload: prompts are picked with ``random.Random(seed)`` and
    each request samples with its own seed (temperature 0.7), so outputs do not depend on the batch.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown workload {name!r}; choose one of: {', '.join(PRESETS)}.")
    preset = PRESETS[name]
    n = preset.num_requests if num_requests is None else num_requests
    if n < 1:
        raise ValueError(f"num_requests must be >= 1, got {n}.")
    rng = random.Random(seed)
    if prompts is not None:
        prompts = [p for p in prompts if p.strip()]
        if not prompts:
            raise ValueError("the prompts file has no non-empty line.")
        texts = [prompts[i % len(prompts)] for i in range(n)]
    elif preset.kind == "documents":
        texts = [f"Summarise this report in one sentence.\n\n{_document(rng, rng.randint(18, 30))}" for _ in range(n)]
    else:
        order = list(QUESTIONS)
        rng.shuffle(order)
        texts = [order[i % len(order)] for i in range(n)]
    steps = arrival_steps(n, preset.rate if rate is None else rate)
    tokens = preset.max_tokens if max_tokens is None else max_tokens
    arrivals = tuple(
        Arrival(step, text, SamplingParams(temperature=0.7, top_p=0.95, seed=seed * 1000 + i, max_tokens=tokens,
                                           ignore_eos=preset.ignore_eos), system=preset.system)
        for i, (step, text) in enumerate(zip(steps, texts)))
    return Workload(name, preset.description, arrivals, dict(preset.engine_options))


def read_prompts_file(path: str) -> list[str]:
    """One prompt per line; blank lines are skipped. A literal ``\\n`` in a line stands for a newline."""
    with open(path, encoding="utf-8") as fp:
        return [line.rstrip("\n").replace("\\n", "\n") for line in fp if line.strip()]


def format_prompt(tokenizer: Any, arrival: Arrival) -> str:
    """The text sent to the engine: through the model's chat template when it has one, as an instruct model
    expects (that template's fixed header is itself a shared prefix the cache will notice)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": arrival.system}] if arrival.system else []) + \
                   [{"role": "user", "content": arrival.prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return f"{arrival.system}\n\n{arrival.prompt}" if arrival.system else arrival.prompt
