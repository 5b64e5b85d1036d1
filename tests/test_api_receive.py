"""The API process's receive path survives what one message can do to it: a message it cannot read, a reply to a
query its caller gave up on; and the detokenizer keeps no outputs of a request it never hears of.

A real `RemoteClient` on its real sockets, with this test in the place of its workers: it reads what the client sends
(the detokenizer's socket, which takes requests with `--num-tokenizer 0`) and pushes messages to the API's socket,
exactly as the detokenizer does. The detokenizer is a real worker on the default model's tokenizer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import zmq

from minisgl_cli.messages import (
    AddRequest,
    DecodedPiece,
    DetokOutput,
    StepOutput,
    TokenizeQuery,
    TokenizeReply,
    TokenOutput,
)
from minisgl_cli.runtime import tokenizer_proc
from minisgl_cli.runtime.ipc import Endpoints, pull, push, recv, send
from minisgl_cli.runtime.remote import RemoteClient
from minisgl_cli.runtime.supervisor import Runtime
from minisgl_cli.runtime.tokenizer_proc import WorkerJob
from minisgl_cli.types import GenerateRequest, ModelInfo, SamplingParams

INFO = ModelInfo(name="t", source="t", device="cpu", dtype="float32", attention_backend="torch", model_dir=None,
                 vocab_size=1000, page_size=1, max_running=4, max_context_len=256, kv_tokens=256, load_s=0.0,
                 overlap=False)


class Wire:
    """The client's two sockets seen from its workers' side."""

    def __init__(self, endpoints: Endpoints):
        self.ctx = zmq.Context()
        self.requests = pull(self.ctx, endpoints.detokenizer)
        self.to_api = push(self.ctx, endpoints.api)

    async def next_request(self) -> object:
        """The next message the client sent (read off the event loop)."""
        assert await asyncio.get_running_loop().run_in_executor(None, self.requests.poll, 10_000), "nothing came"
        return recv(self.requests)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def remote() -> Iterator[tuple[RemoteClient, Wire]]:
    runtime = Runtime()  # no children: the test is the workers
    wire = Wire(runtime.endpoints)
    client = RemoteClient(INFO, runtime.endpoints, 0, runtime)
    yield client, wire
    client.close()
    wire.close()


def test_a_message_the_api_cannot_read_is_dropped_and_every_stream_goes_on(remote):
    client, wire = remote

    async def run() -> None:
        stream = client.submit(GenerateRequest(input_ids=[1, 2, 3], params=SamplingParams(max_new_tokens=2)))
        first = asyncio.ensure_future(anext(stream))
        add = await wire.next_request()
        assert isinstance(add, AddRequest)
        wire.to_api.send(b"\xc1 not msgpack")  # unreadable
        send(wire.to_api, AddRequest("x", [1], SamplingParams()))  # readable, but nothing the API takes
        send(wire.to_api, TokenizeReply(12345, [1]))  # a reply to no query
        send(wire.to_api, DetokOutput([DecodedPiece(add.rid, "hi", [5], "length")]))
        delta = await asyncio.wait_for(first, 10)  # the receive thread used to die on the first of them
        assert (delta.text, delta.finish_reason, delta.error) == ("hi", "length", None)
        await stream.aclose()

    asyncio.run(run())


def test_a_late_reply_to_a_query_given_up_on_is_dropped_and_later_queries_are_answered(remote):
    client, wire = remote
    chat = GenerateRequest(messages=[{"role": "user", "content": "hi"}])

    async def run() -> None:
        given_up = asyncio.ensure_future(client.prompt(chat))
        query = await wire.next_request()
        assert isinstance(query, TokenizeQuery)
        given_up.cancel()  # a hang-up, or the request's deadline
        with pytest.raises(asyncio.CancelledError):
            await given_up
        send(wire.to_api, TokenizeReply(query.qid, [1, 2]))  # its reply comes anyway
        asked = asyncio.ensure_future(client.prompt(chat))
        again = await wire.next_request()
        assert isinstance(again, TokenizeQuery) and again.qid != query.qid
        send(wire.to_api, TokenizeReply(again.qid, [7, 8, 9]))
        assert (await asyncio.wait_for(asked, 10)).ids == [7, 8, 9]  # the late reply used to end the receive thread
        assert client._replies == {}  # nothing of either query outlives it

    asyncio.run(run())


def test_the_detokenizer_keeps_no_outputs_of_requests_it_never_hears_of(default_model_dir, tmp_path, monkeypatch):
    endpoints = Endpoints(str(tmp_path))
    ctx = zmq.Context()
    try:
        api = pull(ctx, endpoints.api)
        pull(ctx, endpoints.scheduler)
        worker = tokenizer_proc._Worker(WorkerJob(-1, str(default_model_dir), endpoints, False, True), ctx)
        monkeypatch.setattr(tokenizer_proc, "EARLY_MAX", 8)
        # An output may beat its request's AddRequest here: it waits for it...
        worker.handle(StepOutput([TokenOutput("late", 28)]))
        # ... while outputs of requests that never come fill the room, the oldest of them going first.
        for i in range(20):
            worker.handle(StepOutput([TokenOutput(f"unknown-{i}", 28)]))
        assert len(worker.early) <= 8 and "late" not in worker.early and "unknown-19" in worker.early
        worker.handle(StepOutput([TokenOutput("soon", 28)]))
        worker.handle(AddRequest("soon", [1], SamplingParams(max_new_tokens=2)))
        worker.handle(StepOutput([TokenOutput("soon", 29, finish_reason="length")]))
        pieces = [p for _ in range(2) for p in recv(api).pieces]
        assert [(p.rid, p.token_ids) for p in pieces] == [("soon", [28]), ("soon", [29])]
        # Past EARLY_S (0 here) what is left of the unknown requests goes at the next step.
        monkeypatch.setattr(tokenizer_proc, "EARLY_S", 0.0)
        worker.handle(StepOutput([]))
        assert worker.early == {}
    finally:
        ctx.destroy(linger=0)
