"""Speculative decoding, the scheduler's side: who proposes draft tokens (a `Proposer`), how many each request asks
for (`DraftBudget`, from its recent acceptance), and what a verify step accepted.

A request with drafts d1..dk runs them in its decode step as k + 1 rows [x, d1, .., dk] (x: its last token) at
consecutive positions of its page-table row: a verify step is a decode step whose rows share a request, each row
attending over the keys up to its own position, so it computes exactly what k + 1 decode steps would (the decode
kernels, the decode attention: a greedy answer cannot change). Every row samples as decode would at its position
(same penalties -- counting the drafts before it --, bias, grammar mask, seed); the request keeps the longest run of
drafts equal to what their rows drew, plus the token drawn after it. For a deterministic proposal (q = 1 on its draft,
as every proposer here makes) this is the speculative-sampling rule: draft d is accepted with probability p(d), and
on rejection the token drawn is distributed as p with d removed, renormalised -- the output distribution is exactly
the non-speculative one, and a seeded request draws the very same tokens. The KV of rejected drafts is given back
(their pages freed; the page table past the kept length is never read), so the prefix cache sees accepted tokens only.

Verify steps run non-overlapped: proposals need every earlier token on the host, so the scheduler reads the step in
flight before proposing and reads a verify step before launching the next (steps without drafts still overlap).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from minisgl_cli.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    import torch

    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.scheduler.request import Req

log = logging.getLogger("minisgl.speculative")

DRAFT_TP = ("--speculative-algorithm {} runs at --tp 1 (the ranks would have to share the draft's tokens: not "
            "built)")
DRAFT_IMAGES = ("--speculative-algorithm draft: the model takes images, which a draft model would not see (not built); "
                "--speculative-algorithm ngram speculates on image requests too")

class Proposer(Protocol):
    """What proposes draft tokens: the n-gram lookup, a draft model, the model's own MTP layer. It proposes
    deterministically (the verify rule treats each draft as certain, q = 1) and the same on every TP rank."""

    name: str
    free: bool  # proposing runs no forward pass: a rejected draft costs only its verify row

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        """Up to budgets[i] tokens likely to follow reqs[i]'s tokens (every one known on the host); [] for none."""
        ...

    def observe(self, req: Req, start: int, hidden: torch.Tensor) -> None:
        """A step computed `req`'s rows at positions start.. and kept them: their hidden states (only where the engine
        keeps them, which an MTP proposer asks for)."""
        ...

    def release(self, req: Req) -> None:
        """`req` finished: drop what is kept for it."""
        ...

    def close(self) -> None:
        """The scheduler stops: give back what the proposer holds."""
        ...


def accepted_run(drafts: list[int], drawn: list[int]) -> int:
    """How many leading drafts a verify step accepted: drawn[j] is what row j drew, drafts[j] what row j + 1 fed."""
    n = 0
    while n < len(drafts) and drawn[n] == drafts[n]:
        n += 1
    return n


def create_proposer(cfg: SchedulerConfig, engine: Engine) -> Proposer | None:
    """The proposer `cfg` asks for (None without speculation)."""
    if cfg.speculative_algorithm == "ngram":
        from minisgl_cli.scheduler.ngram import NgramProposer

        return NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
    if cfg.speculative_algorithm == "draft":
        from minisgl_cli.scheduler.draft_model import DraftModelProposer

        assert cfg.speculative_draft_model is not None  # SchedulerConfig checks it
        if engine.tp.size > 1:  # each rank would run its own draft model, whose tokens the ranks must share
            raise ValueError(DRAFT_TP.format("draft"))
        if engine.vision is not None:  # the draft's KV would hold the placeholders' embeddings, not the images'
            raise ValueError(DRAFT_IMAGES)
        return DraftModelProposer(engine, cfg.speculative_draft_model)
    if cfg.speculative_algorithm == "mtp":
        from minisgl_cli.scheduler.mtp import MtpProposer

        if engine.tp.size > 1:
            raise ValueError(DRAFT_TP.format("mtp"))
        return MtpProposer(engine)
    return None
