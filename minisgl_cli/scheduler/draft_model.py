"""DraftModelProposer: speculative decoding with a smaller model of the same tokenizer, run by our engine beside the
target on its own KV pool (`--speculative-algorithm draft --speculative-draft-model PATH`).

Each step it brings every asking request's draft KV up to the request's tokens and proposes greedily: the KV of tokens
it has not seen (a request's prompt the first time, then the tokens verify steps accepted) is written by one extend
over the prompt part and one decode-form step over the rest (rows at consecutive positions, as a verify step runs
them), whose last row gives the first draft; k - 1 decode steps give the others. Its KV past the tokens a verify step
kept is given back before the next proposal. The rows mirror the target's own arithmetic (a prompt by extend, every
later token by decode rows), so a draft model equal to the target proposes exactly the target's greedy tokens in the
batch-invariant modes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.scheduler.request import Req

log = logging.getLogger("minisgl.speculative")


@dataclass
class _Draft:
    """One request's state in the draft engine: its page-table row, and the tokens whose KV the pool holds, by
    position, with their slots (page size 1)."""

    row: int
    ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


class DraftModelProposer:
    """The `draft` proposer (see the module docstring)."""

    name = "draft"

    def __init__(self, target: Engine, model: str):
        self.engine = target.draft_engine(model)
        self.vocab = min(self.engine.spec.vocab_size, target.spec.vocab_size)
        _check_tokenizers(target, self.engine, model)
        self.drafts: dict[str, _Draft] = {}

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        ready: list[tuple[int, _Draft, list[int]]] = []  # (index, state, its tokens) of the requests that draft
        for i, req in enumerate(reqs):
            state = self._catch_up_plan(req)
            if state is not None:
                ready.append((i, state, req.all_ids))
        if not ready:
            return out
        prompt_rows = [(s, ids, min(len(reqs[i].input_ids), len(ids) - 1)) for i, s, ids in ready]
        self._extend([(s, ids[: n]) for s, ids, n in prompt_rows if len(s.ids) < n])
        # The rest (at least each request's last token) as decode rows: the last row of each gives its first draft.
        firsts = self._decode([(s, ids[len(s.ids):]) for _, s, ids in ready])
        chains = {i: [tok] for (i, _, _), tok in zip(ready, firsts) if tok is not None}
        live = [(i, s) for i, s, _ in ready if i in chains and budgets[i] > 1]
        while live:
            nexts = self._decode([(s, [chains[i][-1]]) for i, s in live])
            for (i, _), tok in zip(live, nexts):
                if tok is not None:
                    chains[i].append(tok)
            live = [(i, s) for (i, s), tok in zip(live, nexts) if tok is not None and len(chains[i]) < budgets[i]]
        for i, chain in chains.items():
            n = 0
            while n < len(chain) and chain[n] < self.vocab:  # a padding id past the model's vocabulary ends it
                n += 1
            out[i] = chain[:n]
        return out

    def _catch_up_plan(self, req: Req) -> _Draft | None:
        """The request's draft state with its KV cut back to the tokens it shares with the request (None: no draft
        for it now -- no page-table row free, or a token the draft model does not know)."""
        ids = req.all_ids
        state = self.drafts.get(req.rid)
        if state is None:
            row = self.engine.alloc_req_slot()
            if row is None:
                return None
            state = self.drafts[req.rid] = _Draft(row)
        keep = 0
        for a, b in zip(state.ids, ids):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # the last token runs again: its row gives the first draft
        self.engine.free_pages(state.slots[keep:])
        del state.ids[keep:], state.slots[keep:]
        if max(ids) >= self.engine.spec.vocab_size:
            return None
        return state

    def _take(self, state: _Draft, ids: list[int]) -> list[int] | None:
        """Slots for `ids` after the state's tokens (the state then holds them), or None when the pool is short."""
        slots = self.engine.alloc_pages(len(ids))  # page size 1: a page is a slot
        if slots is None:
            return None
        state.ids += ids
        state.slots += slots
        return slots

    def _extend(self, work: list[tuple[_Draft, list[int]]]) -> None:
        """Write the KV of each state's prompt tokens it lacks (`work`: the state and its prompt) in one extend."""
        eng = self.engine
        ids: list[int] = []
        rows: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        locs: list[int] = []
        for state, prompt in work:
            start, new = len(state.ids), prompt[len(state.ids):]
            slots = self._take(state, new)
            if slots is None:
                continue
            ids += new
            rows.append(state.row)
            starts.append(start)
            lens.append(len(new))
            locs += slots
        if ids:
            batch = eng.build_batch("extend", ids, rows, starts, lens, locs)
            row_of = torch.repeat_interleave(batch.req_slots, batch.extend_lens, output_size=batch.num_tokens)
            eng.write_page_table(row_of, batch.positions, batch.out_cache_loc.to(torch.int32))
            eng.forward(batch)

    def _decode(self, work: list[tuple[_Draft, list[int]]]) -> list[int | None]:
        """Decode rows for each state's `ids` (at its next positions); the greedy token after each state's last row
        (None for a state the pool had no room for)."""
        eng = self.engine
        ids: list[int] = []
        rows: list[int] = []
        starts: list[int] = []
        locs: list[int] = []
        last: list[int | None] = []  # each state's last row
        for state, new in work:
            start = len(state.ids)
            slots = self._take(state, new)
            if slots is None:
                last.append(None)
                continue
            ids += new
            rows += [state.row] * len(new)
            starts += range(start, start + len(new))
            locs += slots
            last.append(len(ids) - 1)
        if not ids:
            return [None] * len(work)
        batch = eng.build_batch("decode", ids, rows, starts, [1] * len(ids), locs)
        eng.write_page_table(batch.req_slots, batch.positions, batch.out_cache_loc.to(torch.int32))
        tokens = eng.forward(batch).argmax(dim=-1).tolist()
        return [None if r is None else tokens[r] for r in last]

    def release(self, req: Req) -> None:
        state = self.drafts.pop(req.rid, None)
        if state is not None:
            self.engine.free_pages(state.slots)
            self.engine.free_req_slot(state.row)

    def close(self) -> None:
        for rid in list(self.drafts):
            state = self.drafts.pop(rid)
            self.engine.free_pages(state.slots)
            self.engine.free_req_slot(state.row)


def _check_tokenizers(target: Engine, draft: Engine, model: str) -> None:
    """ValueError (one line) unless the draft model reads and writes the target's token ids."""
    t_dir, d_dir = target.spec.model_dir, draft.spec.model_dir
    if t_dir is None or d_dir is None:  # dummy weights: no tokenizer to compare, only the vocabulary's size
        if draft.spec.vocab_size != target.spec.vocab_size:
            raise ValueError(f"--speculative-draft-model {model}: vocabulary of {draft.spec.vocab_size} tokens, the "
                             f"model's has {target.spec.vocab_size}")
        return
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(str(t_dir)).get_vocab() != AutoTokenizer.from_pretrained(str(d_dir)).get_vocab():
        raise ValueError(f"--speculative-draft-model {model} has another tokenizer than the model; a draft model "
                         "must share it")
