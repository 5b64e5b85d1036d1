"""A step that raises (injected: tests/faults.py) fails the requests it ran and nothing else, and leaves the prefix
cache exact: only KV known to be computed reaches it, so the next identical request (or one extending what the failed
one got, as a chat's next turn does) answers as a cold one, and every page is accounted for after each fault."""

from __future__ import annotations

import asyncio

import pytest
import torch
from faults import InjectedFault, StepFaults, at_random, every_nth, run, run_all

from minisgl_cli import LLM, SamplingParams
from minisgl_cli.messages import AddRequest
from minisgl_cli.scheduler.overlap import Launched
from minisgl_cli.types import ErrorCode
from tests.test_scheduler import settle, workload

GREEDY = dict(ignore_eos=True)


def params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, **GREEDY)


@pytest.fixture(scope="module")
def model(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llama"])


@pytest.fixture(scope="module")
def cold(model):
    """Each prompt's answer run alone on an engine that reuses no KV."""
    with LLM(model, cache="naive") as llm:
        yield lambda ids, n: llm.generate(ids, params(n))[0].token_ids


def engine_of(llm: LLM):
    return llm.client._scheduler().engine


PROMPT = list(range(300, 360))  # 60 tokens


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("after_forward", [False, True], ids=["before-forward", "after-forward"])
@pytest.mark.parametrize("mode,nth,kw", [
    ("prefill", 1, {}),
    ("prefill", 2, {"max_prefill_tokens": 16}),  # the second chunk of four: mid prompt
    ("decode", 3, {}),
], ids=["prefill", "chunk", "decode"])
def test_a_failed_step_leaves_the_cache_exact(model, cold, mode, nth, kw, after_forward, overlap):
    with LLM(model, overlap_on_cpu=overlap, **kw) as llm:
        with StepFaults(engine_of(llm), every_nth(nth, mode), after_forward=after_forward, limit=1) as faults:
            failed = run(llm.client, PROMPT, params(8))
        assert faults.raised == 1 and failed.error_code is ErrorCode.ENGINE_FAILED
        settle(llm)
        # Cached: exactly what the steps before the failed one wrote (the first chunk; the prompt and one token a
        # decode step), with overlap too (the step in flight when the next one's launch raised is written).
        written = len(PROMPT) + faults.steps.count("decode") if mode == "decode" else (nth - 1) * kw.get(
            "max_prefill_tokens", 0)
        assert llm.client.stats().tokens_cached == written, faults.steps
        # The same prompt, then one that goes on from what the failed request got (its cached tail, if any):
        assert run(llm.client, PROMPT, params(8)).token_ids == cold(PROMPT, 8)
        turn = PROMPT + failed.token_ids + [7, 8, 9]
        assert run(llm.client, turn, params(6)).token_ids == cold(turn, 6)
        settle(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_failed_prefill_fails_its_requests_and_the_running_ones_go_on(model, cold, overlap):
    """Driven step by step: r0 decodes while r1's prefill raises. r1 fails; r0 (not in that step) finishes as if
    alone; r1 sent again answers as a cold one."""
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.scheduler.scheduler import Scheduler, SchedulerConfig

    outs: dict[str, list[int]] = {}
    errors: dict[str, ErrorCode | None] = {}

    def sink(msg):
        for o in msg.outputs:
            if o.token_id is not None:
                outs.setdefault(o.rid, []).append(o.token_id)
            if o.error is not None:
                errors[o.rid] = o.error_code

    engine = Engine(EngineConfig(model=model, max_total_tokens=2048))
    sched = Scheduler(engine, SchedulerConfig(overlap_on_cpu=overlap), sink)
    other = list(range(900, 940))
    sched.handle(AddRequest("r0", PROMPT, params(12)))
    while len(outs.get("r0", [])) < 3:
        sched.step()
    sched.handle(AddRequest("r1", other, params(6)))
    with StepFaults(engine, every_nth(1, "prefill"), limit=1) as faults:
        for _ in range(3):
            try:  # as the scheduler's loop does
                sched.step()
            except Exception as exc:
                sched.recover(exc)
    assert faults.raised == 1 and errors == {"r1": ErrorCode.ENGINE_FAILED}
    sched.handle(AddRequest("r2", other, params(6)))
    while sched.waiting or sched.running or sched._inflight:
        sched.step()
    assert outs["r0"] == cold(PROMPT, 12) and outs["r2"] == cold(other, 6)
    assert errors == {"r1": ErrorCode.ENGINE_FAILED}  # and nothing else failed
    sched.check_pages()


def test_a_failed_verify_step_leaves_the_cache_exact(model):
    """Speculative decoding (prompt lookup): a verify step that raises. The reference is the same speculative engine
    with no prefix cache (its greedy tokens are what the verify rows give)."""
    rep = [11, 12, 13, 14, 15, 16] * 8
    with LLM(model, speculative_algorithm="ngram", cache="naive") as ref_llm:
        ref = lambda ids, n: ref_llm.generate(ids, params(n))[0].token_ids  # noqa: E731
        with LLM(model, speculative_algorithm="ngram") as llm:
            with StepFaults(engine_of(llm), every_nth(1, "verify"), limit=1) as faults:
                failed = run(llm.client, rep, params(24))
            assert faults.raised == 1, f"no verify step ran: {faults.steps}"
            assert failed.error_code is ErrorCode.ENGINE_FAILED
            settle(llm)
            # Cached: what was written before the verify step: the prompt, and a token for each plain decode step.
            assert llm.client.stats().tokens_cached == len(rep) + faults.steps.count("decode"), faults.steps
            assert run(llm.client, rep, params(24)).token_ids == ref(rep, 24)
            turn = rep + failed.token_ids + [5, 6]
            assert run(llm.client, turn, params(8)).token_ids == ref(turn, 8)
            settle(llm)


def test_an_unreadable_step_fails_everything_and_empties_the_cache(model, cold, monkeypatch):
    """A step whose results cannot be read (on CUDA: a device fault) leaves no KV trustworthy: every request fails,
    the prefix cache is emptied, and the engine serves the next request as a cold one."""
    with LLM(model, overlap_on_cpu=True) as llm:
        run(llm.client, PROMPT, params(4))  # something cached
        real, calls = Launched.read, [0]

        def read(self):
            calls[0] += 1
            if calls[0] == 3:
                raise InjectedFault("injected: the step's results cannot be read")
            return real(self)

        monkeypatch.setattr(Launched, "read", read)
        got = asyncio.run(run_all(llm.client, [(PROMPT, params(8)), (list(range(700, 730)), params(8))]))
        monkeypatch.undo()
        assert [o.error_code for o in got] == [ErrorCode.ENGINE_FAILED] * 2
        settle(llm)
        assert llm.client.stats().tokens_cached == 0
        assert run(llm.client, PROMPT, params(8)).token_ids == cold(PROMPT, 8)
        settle(llm)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_an_abort_while_a_step_runs_caches_only_computed_kv(model, cold, overlap):
    """A request aborted by its consumer while its next step is in flight; the same prompt and a continuation of what
    it got answer as cold ones."""
    with LLM(model, overlap_on_cpu=overlap) as llm:
        async def abort_after(n: int) -> list[int]:
            from minisgl_cli.types import GenerateRequest
            got: list[int] = []
            stream = llm.client.submit(GenerateRequest(input_ids=PROMPT, params=params(32)))
            async for d in stream:
                got += d.token_ids
                if len(got) >= n:
                    await stream.aclose()
                    break
            return got

        got = asyncio.run(abort_after(3))
        settle(llm)
        turn = PROMPT + got + [42]
        assert run(llm.client, turn, params(6)).token_ids == cold(turn, 6)
        settle(llm)


@pytest.fixture(scope="module")
def random_work(cold) -> tuple[list, list[list[int]]]:
    """The random-faults test's 32 requests and each one's answer alone (the same for each of its variants)."""
    work = workload(32, seed=3)
    return work, [cold(ids, n) for ids, n in work]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("after_forward", [False, True], ids=["before-forward", "after-forward"])
def test_random_faults_under_load_leave_every_survivor_and_retry_as_cold(model, random_work, overlap, after_forward):
    """32 concurrent requests (a third sharing a long prefix) on a small pool (pages evicted, requests retracted),
    with ~1 step in 6 raising at random: every request that finishes answers as alone, every failed one sent again
    answers as alone, and every page is accounted for."""
    work, alone = random_work
    with LLM(model, overlap_on_cpu=overlap, max_total_tokens=1200, page_size=4, max_running_requests=8,
             max_prefill_tokens=96) as llm:
        with StepFaults(engine_of(llm), at_random(1 / 6, seed=7), after_forward=after_forward) as faults:
            got = asyncio.run(run_all(llm.client, [(ids, params(n)) for ids, n in work]))
        failed = [i for i, o in enumerate(got) if o.failed]
        assert faults.raised >= 3 and failed and len(failed) < len(work), faults.steps
        for i, o in enumerate(got):
            if not o.failed:
                assert o.token_ids == alone[i], f"request {i} differs"
        settle(llm)
        again = asyncio.run(run_all(llm.client, [(work[i][0], params(work[i][1])) for i in failed]))
        for i, o in zip(failed, again):
            assert not o.failed and o.token_ids == alone[i], f"request {i} sent again differs"
        settle(llm)


def test_a_failed_prefill_on_the_default_model_leaves_no_poisoned_prefix(default_model_dir):
    """The issue's case on the real default model (int4 weights): a chat whose prefill raised, sent again, answers
    as it does cold (on a fresh engine), not from KV that was never written."""
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    sp = SamplingParams(max_new_tokens=12)
    with LLM(str(default_model_dir), cache="naive") as ref:
        want = ref.generate(chat, sp)[0].token_ids
    with LLM(str(default_model_dir)) as llm:
        with StepFaults(engine_of(llm), every_nth(1, "prefill"), limit=1) as faults:
            with pytest.raises(ValueError, match="internal error in the engine step"):
                llm.generate(chat, sp)
        assert faults.raised == 1
        settle(llm)
        again = llm.generate(chat, sp)[0]
        assert again.token_ids == want
        settle(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("after_forward", [False, True], ids=["before-forward", "after-forward"])
def test_faults_on_cuda_under_overlap_and_graphs_cache_only_written_kv(after_forward):
    """On CUDA (overlap and decode graphs on, as shipped): a failed decode step caches exactly what earlier steps
    wrote, and under random faults every request either finishes whole or fails with an engine error, leaving every
    page accounted for. (Greedy tokens are not compared with a cold run here: bf16 kernels on random weights round by
    the batch's shape.)"""
    with LLM("qwen3-0.6b", load_format="dummy", device="cuda", max_total_tokens=16384, max_running_requests=8,
             max_prefill_tokens=256) as llm:
        assert llm.client.info.overlap and engine_of(llm).graphs is not None  # as shipped
        with StepFaults(engine_of(llm), every_nth(3, "decode"), after_forward=after_forward, limit=1) as faults:
            failed = run(llm.client, PROMPT, params(8))
        assert faults.raised == 1 and failed.error_code is ErrorCode.ENGINE_FAILED
        settle(llm)
        assert llm.client.stats().tokens_cached == len(PROMPT) + faults.steps.count("decode"), faults.steps
        work = workload(48, seed=5)
        with StepFaults(engine_of(llm), at_random(1 / 6, seed=11), after_forward=after_forward) as faults:
            got = asyncio.run(run_all(llm.client, [(ids, params(n)) for ids, n in work]))
        assert faults.raised >= 3, faults.steps
        assert {o.error_code for o in got if o.failed} == {ErrorCode.ENGINE_FAILED}
        assert all(len(o.token_ids) == n for o, (_, n) in zip(got, work) if not o.failed)
        settle(llm)
        again = asyncio.run(run_all(llm.client, [(ids, params(n)) for ids, n in work]))
        assert all(not o.failed and len(o.token_ids) == n for o, (_, n) in zip(again, work))
        settle(llm)
