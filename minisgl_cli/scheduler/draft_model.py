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

from typing import TYPE_CHECKING

from minisgl_cli.scheduler.cache import CacheManager
from minisgl_cli.scheduler.request import Req

DRAFT_LINEAR = ("--speculative-algorithm draft: the draft model has linear-attention layers (Qwen3-Next, Qwen3.5), "
                "whose state the draft's own steps cannot roll back (not built; the target may be one)")

if TYPE_CHECKING:
    import torch

    from minisgl_cli.engine.engine import Engine


class DraftModelProposer:
    """The `draft` proposer (see the module docstring). The draft engine's KV is a CacheManager's (no prefix reuse):
    each request has a shadow `Req` there whose kv_len is how many of its tokens the draft pool holds."""

    name = "draft"
    free = False

    def __init__(self, target: Engine, model: str):
        self.engine = target.draft_engine(model)
        if self.engine.spec.num_state_slots:
            raise ValueError(DRAFT_LINEAR)
        self.vocab = min(self.engine.spec.vocab_size, target.spec.vocab_size)
        _check_tokenizers(target, self.engine, model)
        self.cache = CacheManager(self.engine, "naive")
        self.drafts: dict[str, Req] = {}  # rid -> its shadow in the draft engine (input_ids: the tokens in its KV)

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        ready: list[tuple[int, Req, list[int]]] = []  # (index, shadow, the request's tokens) of those that draft
        for i, req in enumerate(reqs):
            shadow = self._cut_back(req)
            if shadow is not None:
                ready.append((i, shadow, req.all_ids))
        if not ready:
            return out
        self._extend([(s, ids[: min(len(reqs[i].input_ids), len(ids) - 1)]) for i, s, ids in ready])
        # The rest (at least each request's last token) as decode rows: the last row of each gives its first draft.
        firsts = self._decode([(s, ids[s.kv_len:]) for _, s, ids in ready])
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

    def _cut_back(self, req: Req) -> Req | None:
        """The request's shadow with its KV cut back to the tokens it shares with the request, the last one excepted
        (its row gives the first draft); None: no draft for it now (no page-table row free, or a token the draft
        model does not know)."""
        ids = req.all_ids
        shadow = self.drafts.get(req.rid)
        if shadow is None:
            shadow = Req(req.rid, [], req.params)
            if not self.cache.attach(shadow):
                return None
            self.drafts[req.rid] = shadow
        keep = 0
        for a, b in zip(shadow.input_ids, ids):
            if a != b:
                break
            keep += 1
        shadow.kv_len = min(keep, len(ids) - 1)
        if not self.cache.can_rewind(shadow, shadow.kv_len):  # its KV there went behind a window: start over
            shadow.kv_len = 0
        self.cache.rewind(shadow)
        del shadow.input_ids[shadow.kv_len:]
        return None if max(ids) >= self.engine.spec.vocab_size else shadow

    def _extend(self, work: list[tuple[Req, list[int]]]) -> None:
        """One extend writing the KV of the prompt tokens each shadow lacks (`work`: the shadow and its prompt)."""
        ids: list[int] = []
        rows: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        locs: list[int] = []
        for shadow, prompt in work:
            start, new = shadow.kv_len, prompt[shadow.kv_len:]
            if not new or (slots := take_slots(self.cache, shadow, new)) is None:
                continue
            assert shadow.req_row is not None  # attached
            ids += new
            rows.append(shadow.req_row)
            starts.append(start)
            lens.append(len(new))
            locs += slots
        if ids:
            batch = self.engine.build_batch("prefill", ids, rows, starts, lens, locs)
            self.cache.write_rows(batch, locs)
            self.engine.forward(batch)

    def _decode(self, work: list[tuple[Req, list[int]]]) -> list[int | None]:
        """Decode rows for each shadow's `ids` (at its next positions); the greedy token after each one's last row
        (None for a shadow the pool had no room for)."""
        ids: list[int] = []
        rows: list[int] = []
        starts: list[int] = []
        locs: list[int] = []
        last: list[int | None] = []  # each shadow's last row
        for shadow, new in work:
            start = shadow.kv_len
            if (slots := take_slots(self.cache, shadow, new)) is None:
                last.append(None)
                continue
            assert shadow.req_row is not None  # attached
            ids += new
            rows += [shadow.req_row] * len(new)
            starts += range(start, start + len(new))
            locs += slots
            last.append(len(ids) - 1)
        if not ids:
            return [None] * len(work)
        batch = self.engine.build_batch("decode", ids, rows, starts, [1] * len(ids), locs)
        self.cache.write_rows(batch, locs)
        tokens = self.engine.forward(batch).argmax(dim=-1).tolist()
        return [None if r is None else tokens[r] for r in last]

    def observe(self, req: Req, start: int, hidden: torch.Tensor) -> None:
        pass  # proposes from tokens alone

    def release(self, req: Req) -> None:
        shadow = self.drafts.pop(req.rid, None)
        if shadow is not None:
            self.cache.release(shadow, cache=False)

    def close(self) -> None:
        for rid in list(self.drafts):
            self.cache.release(self.drafts.pop(rid), cache=False)


def take_slots(cache: CacheManager, shadow: Req, ids: list[int]) -> list[int] | None:
    """KV slots in a draft engine's `cache` for `ids` after the shadow request's tokens (it then holds them), or None
    when the pool is short."""
    start = shadow.kv_len
    if not cache.reserve(shadow, len(ids)):
        return None
    shadow.kv_len += len(ids)
    shadow.input_ids += ids
    return cache.slots(shadow, start, shadow.kv_len)


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
