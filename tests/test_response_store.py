"""The bounded store behind previous_response_id: entries, bytes and age each capped, the oldest going first."""

from __future__ import annotations

from minisgl_cli.server.response_store import ResponseStore


def test_entries_cap_drops_the_oldest():
    store = ResponseStore(max_entries=2)
    for i in range(3):
        store.put(f"r{i}", {"id": f"r{i}"}, [])
    assert store.get("r0") is None and store.get("r1") is not None and len(store) == 2


def test_bytes_cap_drops_the_oldest_and_never_keeps_one_too_big():
    store = ResponseStore(max_bytes=200)
    store.put("a", {"text": "x" * 120}, [])
    store.put("b", {"text": "y" * 120}, [])
    assert store.get("a") is None and store.get("b") is not None and store.bytes <= 200
    store.put("huge", {"text": "z" * 500}, [])
    assert store.get("huge") is None and store.get("b") is not None


def test_age_cap_and_delete():
    store = ResponseStore(max_age_s=0.0)
    store.put("old", {"id": "old"}, [])
    assert store.get("old") is None and store.bytes == 0
    store = ResponseStore()
    store.put("r", {"id": "r"}, [{"role": "user", "content": "hi"}])
    assert store.get("r").history == [{"role": "user", "content": "hi"}]
    assert store.delete("r") and not store.delete("r") and store.get("r") is None
