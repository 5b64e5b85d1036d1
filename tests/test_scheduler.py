"""Continuous batching: concurrent, chunked, aborted and memory-starved runs give the same greedy tokens
as running each request alone, and every KV page is accounted for afterwards."""

from __future__ import annotations

import asyncio
import random

import pytest

from minisgl_cli import LLM, SamplingParams
from minisgl_cli.client.protocol import complete
from minisgl_cli.types import ErrorCode, GenerateRequest


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens): mixed lengths, a third sharing one long prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 49152) for _ in range(160)]
    out = []
    for i in range(n):
        tail = [rng.randrange(3, 49152) for _ in range(rng.randint(1, 60))]
        out.append(((shared if i % 3 == 0 else []) + tail, rng.randint(4, 20)))
    return out


@pytest.fixture(scope="module")
def alone(tiny_model_dirs):
    """Reference: each request on its own, no cache reuse."""
    work = workload(64)
    with LLM(str(tiny_model_dirs["llama"]), cache="naive") as llm:
        return [llm.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))[0].token_ids for ids, n in work]


async def run_concurrently(llm: LLM, work, abort_every: int = 0) -> list[list[int] | None]:
    async def one(i: int, ids: list[int], n: int) -> list[int] | None:
        req = GenerateRequest(input_ids=ids, params=SamplingParams(max_new_tokens=n, ignore_eos=True))
        got: list[int] = []
        stream = llm.client.submit(req)
        async for delta in stream:
            got.extend(delta.token_ids)
            if abort_every and i % abort_every == 1 and len(got) >= 2:
                await stream.aclose()  # the consumer walks away midway: the request is aborted
                return None
        return got

    return await asyncio.gather(*(one(i, ids, n) for i, (ids, n) in enumerate(work)))


def settle(llm: LLM) -> None:
    """Wait until aborts have been processed, then assert exact page accounting and an idle pool."""
    for _ in range(100):
        s = llm.client.stats()
        if s.running == 0 and s.waiting == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    llm.client.check_pages()
    s = llm.client.stats()
    assert (s.running, s.waiting, s.tokens_in_use) == (0, 0, 0)
    assert s.tokens_free + s.tokens_cached == s.tokens_total


def test_64_concurrent_requests_with_aborts_match_running_alone(tiny_model_dirs, alone):
    with LLM(str(tiny_model_dirs["llama"]), max_running_requests=32) as llm:
        got = asyncio.run(run_concurrently(llm, workload(64), abort_every=5))
        for i, (mine, ref) in enumerate(zip(got, alone)):
            if mine is not None:
                assert mine == ref, f"request {i} differs"
        assert sum(m is None for m in got) == 13
        settle(llm)
        assert llm.client.stats().cache_hit_requests > 0  # the shared prefix was reused


def test_chunked_prefill_equals_unchunked(tiny_model_dirs, alone):
    with LLM(str(tiny_model_dirs["llama"]), max_prefill_tokens=16) as llm:
        got = asyncio.run(run_concurrently(llm, workload(64)[:12]))
        settle(llm)
    assert got == alone[:12]


@pytest.mark.parametrize("page_size", [1, 4])
def test_requests_queue_when_the_pool_is_too_small_for_all(tiny_model_dirs, alone, page_size):
    # 400 KV tokens for 64 requests of up to 240 tokens each: they must wait, evict, retract — and finish.
    with LLM(str(tiny_model_dirs["llama"]), max_total_tokens=400, page_size=page_size) as llm:
        got = asyncio.run(run_concurrently(llm, workload(64), abort_every=7))
        settle(llm)
        assert [g for g in got if g is not None] == [r for g, r in zip(got, alone) if g is not None]
        stats = llm.client.stats()
        assert stats.tokens_total == 400 and stats.retracted_requests > 0


def test_prompt_over_context_limit_is_an_error_and_others_go_on(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"]), max_context_len=64) as llm:
        too_long = GenerateRequest(input_ids=list(range(3, 103)))

        async def go():
            first = [d async for d in llm.client.submit(too_long)]
            ok = await complete(
                llm.client, GenerateRequest(input_ids=[5, 6, 7], params=SamplingParams(max_new_tokens=4))
            )
            return first, ok

        first, ok = asyncio.run(go())
        assert first[-1].error and "context limit is 64" in first[-1].error
        assert len(ok.token_ids) >= 1
        settle(llm)


def test_a_full_waiting_queue_refuses_as_overloaded_and_llm_feeds_a_larger_batch_in(tiny_model_dirs, alone):
    """The waiting queue is bounded (--max-queued-requests, here 4): a request past it ends at once as OVERLOADED
    (a 429 through the server), the others run as they do alone and no page leaks. LLM.generate feeds a batch larger
    than the bound in as the queue drains: every prompt is answered."""
    work = workload(64)[:16]
    with LLM(str(tiny_model_dirs["llama"]), max_queued_requests=4, max_running_requests=2) as llm:
        async def one(ids: list[int], n: int) -> list:
            req = GenerateRequest(input_ids=ids, params=SamplingParams(max_new_tokens=n, ignore_eos=True))
            return [d async for d in llm.client.submit(req)]

        async def flood() -> list[list]:
            return list(await asyncio.gather(*(one(ids, n) for ids, n in work)))

        results = asyncio.run(flood())
        refused = [i for i, deltas in enumerate(results) if deltas[-1].error]
        assert refused, "16 requests at once at a bound of 4 waiting (2 running): some must be refused"
        for i, deltas in enumerate(results):
            if i in refused:
                assert len(deltas) == 1 and deltas[0].error_code is ErrorCode.OVERLOADED, deltas
                assert "--max-queued-requests" in deltas[0].error
            else:
                assert [t for d in deltas for t in d.token_ids] == alone[i], f"request {i} differs"
        settle(llm)
        got = llm.generate([ids for ids, _ in work], [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                                      for _, n in work])
        assert [c.token_ids for c in got] == alone[:16]
        settle(llm)


def test_model_info_reports_the_limits_the_scheduler_enforces(tiny_model_dirs):
    """ModelInfo comes from the engine's spec through the scheduler: what a front is told is what it runs under."""
    with LLM(str(tiny_model_dirs["llama"]), max_context_len=64, max_running_requests=5, page_size=4) as llm:
        info, stats = llm.client.info, llm.client.stats()
        assert (info.max_context_len, info.max_running, info.page_size) == (64, 5, 4)
        assert info.kv_tokens == stats.tokens_total == stats.tokens_free
        assert llm.client.tokenizer is not None and llm.client.tokenizer.eos_token_ids <= set(info.eos_token_ids)


def test_exact_repeat_skips_prefill_but_the_last_token(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"])) as llm:
        ids = list(range(100, 180))
        a = llm.generate(ids, SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
        b = llm.generate(ids, SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
        assert a.token_ids == b.token_ids
        assert a.stats.cached_tokens == 0 and b.stats.cached_tokens == len(ids) - 1


def test_insert_prefix_warms_the_cache(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"])) as llm:
        prefix = list(range(200, 260))
        assert llm.client.insert_prefix(prefix).wait(30)
        out = llm.generate(prefix + [7, 8, 9], SamplingParams(max_new_tokens=2))[0]
        assert out.stats.cached_tokens == len(prefix)


def test_decode_first_policy_gives_the_same_tokens(tiny_model_dirs, alone):
    with LLM(str(tiny_model_dirs["llama"]), policy="decode-first") as llm:
        got = asyncio.run(run_concurrently(llm, workload(64)[:16]))
        settle(llm)
    assert got == alone[:16]


@pytest.mark.parametrize("page_size", [1, 4])
def test_running_request_shares_its_prompt_before_it_finishes(tiny_model_dirs, page_size):
    system = list(range(300, 402))  # a shared "system prompt" of 102 tokens

    async def go(llm: LLM):
        first = llm.client.submit(
            GenerateRequest(input_ids=system + [7], params=SamplingParams(max_new_tokens=40, ignore_eos=True))
        )
        await first.__anext__()  # A is prefilled and decoding
        b = await complete(
            llm.client, GenerateRequest(input_ids=system + [8, 9], params=SamplingParams(max_new_tokens=2))
        )
        rest = [d async for d in first]
        return b, rest[-1]

    with LLM(str(tiny_model_dirs["llama"]), page_size=page_size) as llm:
        b, a_last = asyncio.run(go(llm))
        assert a_last.finish_reason == "length"  # A was still running when B matched
        assert b.stats.cached_tokens == len(system) - len(system) % page_size
        settle(llm)


def test_same_prompt_admitted_together_is_prefilled_once(tiny_model_dirs):
    """n > 1 choices arrive as requests with one prompt: the first prefills it, the others start from the cache it
    fills (one token each) and, greedy, give its tokens."""
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.messages import AddRequest
    from minisgl_cli.scheduler.scheduler import Scheduler, SchedulerConfig

    outs: dict[str, list[int]] = {}

    def sink(msg):
        for o in msg.outputs:
            if o.token_id is not None:
                outs.setdefault(o.rid, []).append(o.token_id)

    sched = Scheduler(Engine(EngineConfig(model=str(tiny_model_dirs["llama"]), max_total_tokens=4096)),
                      SchedulerConfig(), sink)
    ids = list(range(500, 590))
    for i in range(3):  # in the inbox together, as a request with n = 3 puts them
        sched.handle(AddRequest(f"c{i}", ids, SamplingParams(max_new_tokens=5, ignore_eos=True)))
    while sched.waiting or sched.running or sched._inflight:
        sched.step()
    s = sched.snapshot()
    assert s.prefill_tokens == len(ids) + 2 and s.cache_hit_tokens == 2 * (len(ids) - 1)
    assert outs["c0"] == outs["c1"] == outs["c2"] and len(outs["c0"]) == 5
    sched.check_pages()


def test_torch_profiler_dir_writes_a_table_of_the_profiled_steps(tiny_model_dirs, tmp_path, monkeypatch):
    """MINISGL_TORCH_PROFILER_DIR: after SKIP busy steps, STEPS are profiled and rank 0's table written."""
    monkeypatch.setenv("MINISGL_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("MINISGL_PROFILE_SKIP", "2")
    monkeypatch.setenv("MINISGL_PROFILE_STEPS", "3")
    with LLM(str(tiny_model_dirs["llama"])) as llm:
        llm.generate([1, 2, 3], SamplingParams(max_new_tokens=8, ignore_eos=True))
    text = (tmp_path / "rank0-steps.txt").read_text()
    assert text.startswith("rank0: 3 busy steps after 2: wall ") and "aten::" in text


def test_step_trace_writes_a_line_per_launched_step(tiny_model_dirs, tmp_path, monkeypatch):
    """MINISGL_STEP_TRACE_DIR: each launched step is one line (a lone request: its prefill, then one decode step a
    token), on disk once the scheduler stops; examples/step_trace.py reads the run back as one burst."""
    import importlib.util
    import sys
    from pathlib import Path

    monkeypatch.setenv("MINISGL_STEP_TRACE_DIR", str(tmp_path))
    with LLM(str(tiny_model_dirs["llama"])) as llm:
        llm.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=6, ignore_eos=True))
    [path] = tmp_path.glob("rank0-*-trace.tsv")
    rows = [line.split("\t") for line in path.read_text().splitlines()[1:]]
    assert [r[1] for r in rows] == ["prefill"] + ["decode"] * 5
    assert [(r[2], r[3]) for r in rows] == [("1", "4")] + [("1", "1")] * 5  # rows, tokens
    assert all(float(r[6]) >= 0 for r in rows)  # ms of garbage collection since the launch before
    spec = importlib.util.spec_from_file_location("step_trace", Path(__file__).parents[1] / "examples/step_trace.py")
    assert spec is not None and spec.loader is not None
    step_trace = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "step_trace", step_trace)  # its dataclass looks its module up there
    spec.loader.exec_module(step_trace)
    [burst] = step_trace.bursts(step_trace.read(path), gap_s=5.0)
    assert (burst.steps, burst.decode_steps, burst.prefill_tokens, burst.mean_rows) == (6, 5, 4, 1.0)
    # --by-rows: a step's time is the gap to the next launch, so the last decode launch has none
    by_rows = step_trace.by_rows(tmp_path)
    assert by_rows[0] == f"{path.name}:" and len(by_rows) == 3
    assert by_rows[1].split()[:5] == ["decode", "1", "rows:", "4", "steps,"]
    assert by_rows[2].split()[:5] == ["prefill", "1", "rows:", "1", "steps,"]
