"""NgramProposer: prompt lookup -- a request's next tokens guessed from what followed an earlier occurrence of its last
tokens, over its own prompt and output (vLLM's `ngram`, SGLang's NGRAM without the cross-request trie).

Each request has an `NgramIndex`, extended by the tokens it gained since its last step (no rebuild): every position
chained to the previous one ending with the same `min_n` tokens. A lookup walks that chain from the latest earlier
occurrence of the request's last `min_n` tokens, extends each candidate's match backwards up to `max_n` tokens, and
proposes what followed the longest match (the latest of equally long ones).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from minisgl_cli.scheduler.request import Req

MAX_CANDIDATES = 64  # earlier occurrences of the last min_n tokens a lookup tries (the latest first)


class NgramIndex:
    """One request's tokens and, per position, the previous position ending with the same `min_n` tokens."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.prev: list[int] = []  # the previous position whose last min_n tokens equal this one's (-1: none)
        self.latest: dict[tuple[int, ...], int] = {}  # min_n tokens -> the latest position they end at

    def extend(self, ids: list[int]) -> None:
        toks, n = self.tokens, self.min_n
        for t in ids:
            toks.append(t)
            end = len(toks)
            if end < n:
                self.prev.append(-1)
                continue
            key = tuple(toks[end - n : end])
            self.prev.append(self.latest.get(key, -1))
            self.latest[key] = end - 1

    def propose(self, k: int) -> list[int]:
        """Up to k tokens after the longest earlier match of the sequence's end ([] without one). A continuation that
        runs into the end itself repeats its period (the sequence is periodic there)."""
        toks = self.tokens
        last = len(toks) - 1
        if last < self.min_n:
            return []
        best, best_len = -1, 0
        at, tries = self.prev[last], 0
        while at >= 0 and tries < MAX_CANDIDATES:
            m = self.min_n
            while m < self.max_n and m <= at and toks[at - m] == toks[last - m]:
                m += 1
            if m > best_len:
                best, best_len = at, m
                if m == self.max_n:
                    break
            at, tries = self.prev[at], tries + 1
        if best < 0:
            return []
        out: list[int] = []
        for i in range(k):
            j = best + 1 + i
            out.append(toks[j] if j <= last else out[j - last - 1])
        return out


class NgramProposer:
    """The `ngram` proposer: an index per running request, by request id."""

    name = "ngram"
    free = True

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, budgets):
            index = self.indexes.get(req.rid)
            if index is None:
                index = self.indexes[req.rid] = NgramIndex(self.min_n, self.max_n)
            have, prompt = len(index.tokens), len(req.input_ids)
            if have < prompt:
                index.extend(req.input_ids[have:])
            index.extend(req.output_ids[max(have - prompt, 0) :])
            out.append(index.propose(k))
        return out

    def observe(self, req: Req, start: int, hidden: torch.Tensor) -> None:
        pass  # proposes from tokens alone

    def release(self, req: Req) -> None:
        self.indexes.pop(req.rid, None)

    def close(self) -> None:
        self.indexes.clear()
