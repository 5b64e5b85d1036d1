"""SchedulerConfig: the knobs of one scheduler (prefill budget, policy, prefix cache, overlap).

Fields that are also command-line options carry their flags in `metadata`, as on EngineConfig
(engine/config.py says how); commands/common.py builds the options from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Policy = Literal["prefill-first", "decode-first"]


@dataclass
class SchedulerConfig:
    max_prefill_tokens: int = field(default=2048, metadata=dict(  # also the chunk size of long prompts
        flags=("--max-prefill-tokens",), min=1, help="Token budget of one prefill step (chunk size)."))
    cache: str = field(default="radix", metadata=dict(
        flags=("--cache",), help="Prefix cache: radix or naive (no reuse)."))
    policy: Policy = field(default="prefill-first", metadata=dict(
        flags=("--policy",), env="SCHEDULE_POLICY", help="prefill-first or decode-first."))
    disable_overlap: bool = field(default=False, metadata=dict(
        flags=("--disable-overlap",), env="MINISGL_DISABLE_OVERLAP_SCHEDULING",
        help="CUDA: read each step's tokens before launching the next (no overlap scheduling)."))
    overlap_on_cpu: bool = False  # overlap is a CUDA feature; tests force it on the CPU to check the logic
