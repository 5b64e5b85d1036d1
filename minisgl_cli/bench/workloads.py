"""Benchmark workloads: the reference suite (short/medium/long, mixed prompts), random, shared-prefix, nano-vllm,
and three chat prompts (rewrite, code-edit, open-chat: speculative decoding's best, middling and worst case).

Every request carries exact token ids, so the engine, the HF baselines and llama.cpp see the same prompt;
`prompt` (text) is kept only where a tokenizer made it, for HTTP servers that want text.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from minisgl_cli.types import SamplingParams

_PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more then a hundred years. Every night it's lamp turned "
    "slowly, sending a beam of light accross the dark water so that ships could find there way home. The keeper, a "
    "quiet man named Thomas, climbed the ninety-nine steps each evening to light the lamp and wind the clockwork. He "
    "wrote the weather in his log book, watched the horizon for storms, and recieved letters from his sister only "
    "twice a year, when the supply boat came. Many people thought his life was lonely, but Thomas said he had never "
    "felt more at peace then when the sea was calm and the light was burning bright."
)
_CODE = '''import json


def load_prices(path):
    with open(path) as f:
        return json.load(f)


def compute_total(prices, tax_rate):
    total = 0.0
    for item, price in prices.items():
        total += price
    return total * (1 + tax_rate)


def cheapest(prices):
    best_item, best_price = None, None
    for item, price in prices.items():
        if best_price is None or price < best_price:
            best_item, best_price = item, price
    return best_item


def report(path, tax_rate=0.2):
    prices = load_prices(path)
    print("items:", len(prices))
    print("total:", compute_total(prices, tax_rate))
    print("cheapest:", cheapest(prices))
'''
# One user message each: an answer that copies its prompt (speculative decoding's best case), one that copies it
# with edits, and one with nothing to copy.
CHAT_PROMPTS = {
    "rewrite": "Fix the spelling mistakes in this paragraph and write out the whole corrected paragraph:\n\n"
               + _PARAGRAPH,
    "code-edit": "Rename the function compute_total to sum_prices everywhere in this Python module and write out the "
                 "whole module:\n\n```python\n" + _CODE + "```",
    "open-chat": "Write a short story about a dragon who learns to bake bread.",
}
CHAT_NEW_TOKENS = 256  # a chat prompt's default --max-new-tokens: the rewrite's whole answer (~170 tokens)

DATASETS = ("reference", "random", "shared-prefix", *CHAT_PROMPTS)
PRESETS = ("nano-vllm",)

# A plain English filler: tokenizes to roughly one token per word in every BPE vocab we ship.
_FILLER = (
    "The quick brown fox jumps over the lazy dog while the river flows past the old mill and "
    "children play in the green fields under a bright summer sky. "
)
_SYSTEM = (
    "You are a careful assistant for a small library. Answer questions about opening hours, loans, "
    "fines, events and the catalogue politely and briefly, and never invent facts you do not know. "
)


@dataclass(frozen=True)
class ReferenceCase:
    """One case of the reference stack's suite: prompt length and decode budget (GPU and CPU)."""

    name: str
    prompt_tokens: int
    max_new_tokens_gpu: int
    max_new_tokens_cpu: int


# The reference stack decodes 256/512/1024 tokens; a CPU run uses 32/64/128 so the suite stays minutes long.
REFERENCE_CASES = (
    ReferenceCase("short", 16, 256, 32),
    ReferenceCase("medium", 64, 512, 64),
    ReferenceCase("long", 256, 1024, 128),
)


@dataclass(frozen=True)
class Sampling:
    """How a bench's requests draw their tokens (--temperature, --top-p, --top-k, --min-p): greedy by default."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0

    def __post_init__(self) -> None:
        self.params(1, False)  # the engine's own checks: a bad value fails before anything loads

    def params(self, max_new_tokens: int, ignore_eos: bool) -> SamplingParams:
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, ignore_eos=ignore_eos)

    def wire(self) -> dict[str, Any]:
        """The OpenAI body's fields (top_k and min_p are sglang / vLLM extensions: sent only when set)."""
        out: dict[str, Any] = {"temperature": self.temperature}
        if self.top_p < 1.0:
            out["top_p"] = self.top_p
        if self.top_k > 0:
            out["top_k"] = self.top_k
        if self.min_p > 0:
            out["min_p"] = self.min_p
        return out

    @property
    def label(self) -> str:
        if self.temperature == 0.0:
            return "greedy"
        parts = [f"t={self.temperature:g}"] + [f"{k}={v:g}" for k, v, off in (
            ("top_p", self.top_p, 1.0), ("top_k", self.top_k, -1), ("min_p", self.min_p, 0.0)) if v != off]
        return " ".join(parts)


@dataclass
class BenchRequest:
    input_ids: list[int]
    max_new_tokens: int
    ignore_eos: bool = False
    prompt: str | None = None  # the same prompt as text, when a tokenizer made it
    sampling: Sampling = field(default_factory=Sampling)

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class Case:
    """A named list of requests, benchmarked as one run per engine and concurrency."""

    name: str
    requests: list[BenchRequest]
    params: dict[str, Any] = field(default_factory=dict)  # how it was built, echoed in the JSON report
    prime: list[BenchRequest] = field(default_factory=list)  # sent untimed before each timed run


def _text_ids(tokenizer: Any, text: str, n: int) -> list[int]:
    """Exactly n token ids of `text` repeated (no special tokens), so every engine sees n tokens."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer.encode(text, add_special_tokens=False)
    return ids[:n]


def _special_ids(tokenizer: Any) -> set[int]:
    return set(getattr(tokenizer, "all_special_ids", []) or [])


def _random_ids(rng: random.Random, n: int, vocab_size: int, avoid: set[int]) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        t = rng.randrange(vocab_size)
        if t not in avoid:
            out.append(t)
    return out


def _decode(tokenizer: Any, ids: list[int]) -> str | None:
    return tokenizer.decode(ids) if tokenizer is not None else None


def reference_cases(
    tokenizer: Any, vocab_size: int, *, num_prompts: int, repeat: int, mixed_prompts: bool, on_gpu: bool,
    max_new_tokens: int | None = None, names: list[str] | None = None, seed: int = 0, level: int = 0,
) -> list[Case]:
    """The reference suite: per case `num_prompts` distinct-ish prompts, each sent `repeat` times (runs).

    Every run starts cold: its prompts open with a word of their own (`_run_leads`), so no run, of any case or
    concurrency `level`, finds its prompts in a prefix cache an earlier one filled. Within a run, with mixed prompts,
    every other prompt gets a random suffix, so half the requests share their whole prompt with others (full prefix
    reuse) and half only a prefix (partial reuse), as in the reference stack; what a cache serves of that is counted.
    EOS is ignored: every request decodes exactly its case's tokens on every stack, so stacks are compared on the
    same output lengths.
    """
    rng = random.Random(seed)
    specs = [spec for spec in REFERENCE_CASES if not names or spec.name in names]
    if names and not specs:
        raise ValueError(f"no reference case named {', '.join(names)}; choose from short, medium, long")
    runs = len(specs) * repeat
    leads: Iterator[str | int] = iter(_run_leads(tokenizer, vocab_size, (level + 1) * runs)[level * runs:])
    cases = []
    for spec in specs:
        new = max_new_tokens or (spec.max_new_tokens_gpu if on_gpu else spec.max_new_tokens_cpu)
        reqs = []
        for _ in range(repeat):
            lead = next(leads)
            if isinstance(lead, str):
                base = _text_ids(tokenizer, f"{lead} {_FILLER}", spec.prompt_tokens)
            else:  # dummy weights: no tokenizer, any fixed ids do
                base = [lead, *_random_ids(random.Random(spec.prompt_tokens), spec.prompt_tokens - 1, vocab_size,
                                           set())]
            for i in range(num_prompts):
                ids = list(base)
                if mixed_prompts and i % 2 == 1:
                    suffix = f" #{rng.randint(0, 9999)}"
                    ids += (tokenizer.encode(suffix, add_special_tokens=False) if tokenizer is not None
                            else _random_ids(rng, 3, vocab_size, set()))
                reqs.append(BenchRequest(ids, new, True, _decode(tokenizer, ids)))
        params = dict(dataset="reference", prompt_tokens=spec.prompt_tokens, max_new_tokens=new,
                      num_prompts=num_prompts, repeat=repeat, mixed_prompts=mixed_prompts, ignore_eos=True)
        cases.append(Case(spec.name, reqs, params))
    return cases


def _run_leads(tokenizer: Any, vocab_size: int, count: int) -> list[str] | list[int]:
    """`count` openings whose first tokens all differ, and differ from the filler's: words from the vocab, or token
    ids where there is no tokenizer. The same list whatever `count` (a longer one extends it), so concurrency level
    k takes the runs after level k-1's."""
    rng = random.Random(0)
    order = rng.sample(range(vocab_size), vocab_size)
    if tokenizer is None:
        return order[:count]
    seen = {_text_ids(tokenizer, _FILLER, 1)[0]}
    words: list[str] = []
    for token in order:
        if len(words) == count:
            break
        word = tokenizer.decode([token]).strip().capitalize()
        if len(word) < 3 or not (word.isascii() and word.isalpha()):
            continue
        first = _text_ids(tokenizer, f"{word} {_FILLER}", 1)[0]  # the first token of a prompt it opens
        if first not in seen:
            seen.add(first)
            words.append(word)
    if len(words) < count:
        raise ValueError(f"the tokenizer has too few words to open {count} cold runs: lower --repeat")
    return words


def random_case(
    tokenizer: Any, vocab_size: int, *, num_prompts: int, input_len: int, output_len: int, range_ratio: float,
    seed: int = 0, name: str = "random",
) -> Case:
    """Random token ids from the vocab; lengths uniform in [len * range_ratio, len]; EOS ignored.

    Ids are sent as ids (never decoded and re-encoded), so the input lengths are exact.
    """
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError("--range-ratio must be in [0, 1]")
    rng = random.Random(seed)
    avoid = _special_ids(tokenizer) if tokenizer is not None else set()
    reqs = []
    for _ in range(num_prompts):
        n_in = rng.randint(max(1, int(input_len * range_ratio)), input_len)
        n_out = rng.randint(max(1, int(output_len * range_ratio)), output_len)
        reqs.append(BenchRequest(_random_ids(rng, n_in, vocab_size, avoid), n_out, True))
    params = dict(dataset="random", num_prompts=num_prompts, input_len=input_len, output_len=output_len,
                  range_ratio=range_ratio, seed=seed)
    return Case(name, reqs, params)


def nano_vllm_case(vocab_size: int, num_prompts: int = 256, seed: int = 0) -> Case:
    """nano-vllm's / mini-sglang's offline workload: 256 requests, input and output lengths uniform in
    100..1024, random ids below 10000, EOS ignored, seed 0."""
    rng = random.Random(seed)
    top = min(10_000, vocab_size)
    reqs = []
    for _ in range(num_prompts):
        ids = [rng.randint(0, top - 1) for _ in range(rng.randint(100, 1024))]
        reqs.append(BenchRequest(ids, rng.randint(100, 1024), True))
    return Case("nano-vllm", reqs, dict(preset="nano-vllm", num_prompts=num_prompts, seed=seed,
                                        input_len="100..1024", output_len="100..1024"))


def shared_prefix_case(
    tokenizer: Any, vocab_size: int, *, num_prompts: int, prefix_len: int, question_len: int = 16,
    output_len: int = 16, seed: int = 0,
) -> Case:
    """N requests = one long shared system prompt (prefix_len tokens) + a short distinct question each.

    A prefix cache turns all but the first prefill into a `question_len`-token prefill: compare TTFT p50
    with `--cache radix` and `--cache naive`.
    """
    rng = random.Random(seed)
    if tokenizer is not None:
        prefix = _text_ids(tokenizer, _SYSTEM, prefix_len)
        questions = [_text_ids(tokenizer, f" Question {i}: is book number {i * 37 % 1000} on loan today? ",
                               question_len) for i in range(num_prompts)]
    else:
        prefix = _random_ids(rng, prefix_len, vocab_size, set())
        questions = [_random_ids(rng, question_len, vocab_size, set()) for _ in range(num_prompts)]
    reqs = [BenchRequest(prefix + q, output_len, True, _decode(tokenizer, prefix + q)) for q in questions]
    params = dict(dataset="shared-prefix", num_prompts=num_prompts, prefix_len=prefix_len,
                  question_len=question_len, output_len=output_len, seed=seed)
    # The system prompt is sent once, untimed, first: a long-lived server has it cached already, and a cache
    # that fills only when a request finishes would otherwise see no reuse among requests sent together.
    return Case("shared-prefix", reqs, params, prime=[BenchRequest(list(prefix), 1, True)])


def chat_case(tokenizer: Any, name: str, *, num_prompts: int, max_new_tokens: int) -> Case:
    """CHAT_PROMPTS[name] in the model's chat template, sent `num_prompts` times (one after another at
    --concurrency 1), up to `max_new_tokens` tokens, stopping at EOS.

    The templated text goes out as the prompt (over HTTP through /v1/completions), so every server decodes from the
    same tokens whatever chat template it would have applied itself."""
    if tokenizer is None:
        raise ValueError(f"--dataset {name} needs the model's tokenizer (its chat template)")
    text = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPTS[name]}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    reqs = [BenchRequest(list(ids), max_new_tokens, False, text) for _ in range(num_prompts)]
    return Case(name, reqs, dict(dataset=name, num_prompts=num_prompts, max_new_tokens=max_new_tokens))


def warmup_requests(vocab_size: int, n: int) -> list[BenchRequest]:
    """Small requests that trigger lazy init (kernels, CUDA graphs, allocator) before measuring."""
    rng = random.Random(1234)
    return [BenchRequest(_random_ids(rng, 8, min(vocab_size, 10_000), set()), 8, True) for _ in range(n)]
