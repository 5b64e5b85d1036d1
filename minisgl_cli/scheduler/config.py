"""SchedulerConfig: the knobs of one scheduler (prefill budget, policy, prefix cache, overlap, speculative decoding).

Fields that are also command-line options carry their flags in `metadata`, as on EngineConfig
(engine/config.py says how); commands/common.py builds the options from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, get_args

Policy = Literal["prefill-first", "decode-first"]
# Speculative decoding (scheduler/speculative.py): none, prompt lookup, a smaller draft model, or the model's own
# multi-token-prediction layer (DeepSeek-V3's, Qwen3-Next's and Qwen3.5's MTP).
SpeculativeAlgorithm = Literal["none", "ngram", "draft", "mtp"]
SPECULATIVE_ALGORITHMS: tuple[str, ...] = get_args(SpeculativeAlgorithm)


@dataclass
class SchedulerConfig:
    max_prefill_tokens: int = field(default=2048, metadata=dict(  # also the chunk size of long prompts
        flags=("--max-prefill-tokens",), min=1, help="Token budget of one prefill step (chunk size)."))
    max_queued_requests: int = field(default=4096, metadata=dict(  # a backstop: `serve` caps requests in flight first
        flags=("--max-queued-requests",), env="MAX_QUEUED_REQUESTS", min=0,
        help="Requests waiting in a scheduler at most; past it one is refused as overloaded (0 = no bound)."))
    cache: str = field(default="radix", metadata=dict(
        flags=("--cache",), help="Prefix cache: radix or naive (no reuse)."))
    policy: Policy = field(default="prefill-first", metadata=dict(
        flags=("--policy",), env="SCHEDULE_POLICY", help="prefill-first or decode-first."))
    disable_overlap: bool = field(default=False, metadata=dict(
        flags=("--disable-overlap",), env="MINISGL_DISABLE_OVERLAP_SCHEDULING",
        help="CUDA: read each step's tokens before launching the next (no overlap scheduling)."))
    speculative_algorithm: SpeculativeAlgorithm = field(default="none", metadata=dict(
        flags=("--speculative-algorithm",), env="MINISGL_SPECULATIVE_ALGORITHM",
        help="Speculative decoding: none, ngram (prompt lookup), draft (a draft model) or mtp (the model's own "
             "MTP layer: DeepSeek-V3, Qwen3-Next, Qwen3.5)."))
    num_speculative_tokens: int = field(default=3, metadata=dict(  # k = 5 wins only where answers copy at length
        flags=("--num-speculative-tokens",), min=1, max=16,
        help="Draft tokens a request proposes per step at most (its verify step runs k + 1 rows)."))
    prompt_lookup_min: int = field(default=1, metadata=dict(
        flags=("--prompt-lookup-min",), min=1,
        help="ngram: the fewest last tokens of a request matched in its earlier tokens."))
    prompt_lookup_max: int = field(default=12, metadata=dict(
        flags=("--prompt-lookup-max",), min=1,
        help="ngram: the most last tokens matched (the longest match proposes)."))
    speculative_draft_model: str | None = field(default=None, metadata=dict(
        flags=("--speculative-draft-model",),
        help="draft: a smaller model with the same tokenizer (HF dir, .gguf or alias)."))
    overlap_on_cpu: bool = False  # overlap is a CUDA feature; tests force it on the CPU to check the logic

    def __post_init__(self) -> None:
        algo = self.speculative_algorithm
        if algo not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}, "
                             f"not {algo!r}")
        if (algo == "draft") != (self.speculative_draft_model is not None):
            raise ValueError("--speculative-algorithm draft takes --speculative-draft-model PATH (and only it does)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("--prompt-lookup-min is above --prompt-lookup-max")
        # A flag that would change nothing is refused (issue 27's rule): each speculative knob needs its algorithm.
        unused = [(flag, needs) for flag, name, needs in _SPEC_KNOBS
                  if algo not in needs and getattr(self, name) != _DEFAULTS[name]]
        if unused:
            flags = ", ".join(flag for flag, _ in unused)
            users = [a for a in SPECULATIVE_ALGORITHMS if all(a in needs for _, needs in unused)]
            why = "speculative decoding is off" if algo == "none" else f"{algo} does not use them"
            raise ValueError(f"drop {flags} or use --speculative-algorithm {' or '.join(users)} ({why})")


# (flag, field, the algorithms it configures): the others would ignore it.
_SPEC_KNOBS = (("--num-speculative-tokens", "num_speculative_tokens", ("ngram", "draft", "mtp")),
               ("--prompt-lookup-min", "prompt_lookup_min", ("ngram",)),
               ("--prompt-lookup-max", "prompt_lookup_max", ("ngram",)))
_DEFAULTS = {f.name: f.default for f in fields(SchedulerConfig)}
