"""ResponseStore: the responses kept for `previous_response_id` and GET / DELETE /v1/responses/{id}, bounded.

Each stored response keeps its JSON (what GET answers) and the conversation up to it as chat messages (what a
next response that names it continues). The store is capped three ways: entries, bytes of JSON, and age; the
oldest go first when a cap is reached, and an expired one is gone (an unknown id is a 404).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_ENTRIES = 1024
MAX_BYTES = 64 * 1024 * 1024
MAX_AGE_S = 3600.0


@dataclass
class Stored:
    response: dict[str, Any]  # the response object, as GET answers it
    history: list[dict[str, Any]]  # the chat messages up to and with its output (its instructions left out)
    size: int
    at: float


class ResponseStore:
    def __init__(self, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES, max_age_s: float = MAX_AGE_S):
        self.max_entries, self.max_bytes, self.max_age_s = max_entries, max_bytes, max_age_s
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def put(self, rid: str, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        size = len(json.dumps(response)) + len(json.dumps(history))
        if size > self.max_bytes:
            return  # never kept: a later reference to it is a 404, as for an expired one
        self._items[rid] = Stored(response, history, size, time.monotonic())
        self.bytes += size
        while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))

    def get(self, rid: str) -> Stored | None:
        self._expire()
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        self._expire()
        if rid not in self._items:
            return False
        self._drop(rid)
        return True

    def __len__(self) -> int:
        return len(self._items)

    def _drop(self, rid: str) -> None:
        self.bytes -= self._items.pop(rid).size

    def _expire(self) -> None:
        cutoff = time.monotonic() - self.max_age_s
        while self._items and next(iter(self._items.values())).at < cutoff:
            self._drop(next(iter(self._items)))
