"""`minisgl bench`: metric maths on synthetic timings, workloads, the HTTP runner on a fake SSE server,
and tiny end-to-end runs (offline with the HF baseline; online against a real `minisgl serve` app)."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import pytest
from typer.testing import CliRunner

from minisgl_cli.bench import workloads as wl
from minisgl_cli.bench.metrics import RequestTiming, compute_metrics, distribution, percentile
from minisgl_cli.bench.report import BenchReport, BenchResult, comparison_line, summary_line, summary_lines

SUMMARY = r"Streaming chat summary: throughput=\d+\.\d{2} tok/s, duration=\d+\.\d{3}s"
BASELINE = r"Baseline HF streaming chat summary: throughput=\d+\.\d{2} tok/s, duration=\d+\.\d{3}s"
COMPARISON = r"Comparison: streaming (faster|slower) by \d+\.\d{3}s with x\d+\.\d{2} throughput"


# --- metric maths ------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 99) == pytest.approx(3.97)  # numpy.percentile([1,2,3,4], 99)
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) == 0.0
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_ttft_tpot_itl_definitions():
    # Sent at 0; chunks at 0.1 (2 tokens), 0.3, 0.6 (1 each): 4 tokens, E2E 0.6.
    t = RequestTiming(prompt_tokens=10, output_tokens=4, ttft_s=0.1, latency_s=0.6, chunk_times_s=[0.1, 0.3, 0.6])
    assert t.tpot_s == pytest.approx((0.6 - 0.1) / 3)
    assert t.itl_s == pytest.approx([0.2, 0.3])
    assert RequestTiming(5, output_tokens=1, ttft_s=0.1, latency_s=0.1).tpot_s is None  # one token: no TPOT
    assert RequestTiming(5, output_tokens=9, ttft_s=None, latency_s=1.0).tpot_s is None  # not streamed


def test_compute_metrics_throughputs_and_distributions():
    timings = [
        RequestTiming(10, 4, 0.1, 0.6, [0.1, 0.3, 0.6], cached_tokens=0),
        RequestTiming(20, 2, 0.2, 0.4, [0.2, 0.4], cached_tokens=8),
        RequestTiming(30, 0, None, 0.05, success=False, error="boom"),
    ]
    m = compute_metrics(timings, duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens, m.total_cached_tokens) == (30, 6, 8)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.input_throughput == pytest.approx(15.0)
    assert m.output_throughput == pytest.approx(3.0)
    assert m.total_throughput == pytest.approx(18.0)
    assert m.ttft_ms.mean == pytest.approx(150.0) and m.ttft_ms.median == pytest.approx(150.0)
    assert m.tpot_ms.count == 2 and m.tpot_ms.mean == pytest.approx((500 / 3 + 200) / 2)
    assert sorted([0.2, 0.3, 0.2]) == pytest.approx(sorted(v / 1000 for v in [200, 300, 200]))
    assert m.itl_ms.count == 3 and m.itl_ms.median == pytest.approx(200.0)
    assert m.e2e_latency_ms.p99 == pytest.approx(percentile([600.0, 400.0], 99))
    assert compute_metrics([], 0.0).output_throughput == 0.0


def test_distribution_std_is_population():
    d = distribution([0.001, 0.003])
    assert (d.mean, d.std, d.count) == (pytest.approx(2.0), pytest.approx(1.0), 2)


def _result(engine: str, tokens: int, duration: float, conc: int = 4) -> BenchResult:
    cached = None if engine.startswith("hf") else 0  # the HF baselines have no prefix cache
    m = compute_metrics([RequestTiming(5, tokens, 0.1, duration, [0.1], cached_tokens=cached)], duration)
    return BenchResult(engine, "short", conc, 1, m)


def test_reference_summary_lines_format():
    ours, base = [_result("minisgl", 386, 10.387)], [_result("hf-stream", 386, 21.825, 1)]
    assert summary_line("Streaming chat", ours) == ("Streaming chat summary: throughput=37.16 tok/s, duration=10.387s "
                                                    "(concurrency=4, output_tokens=386, cached_prompt_tokens=0/5)")
    assert comparison_line(ours, base) == ("Comparison: streaming faster by 11.438s with x2.10 throughput "
                                           "(concurrency 4 vs 1, same output tokens, 0 prompt tokens cached)")
    lines = summary_lines(BenchReport({}, ours + base))
    assert lines[0] == summary_line("Streaming chat", ours)
    assert lines[1] == ("Baseline HF streaming chat summary: throughput=17.69 tok/s, duration=21.825s "
                        "(concurrency=1, output_tokens=386, no prefix cache)")
    assert comparison_line(base, ours).startswith("Comparison: streaming slower by 11.438s")


def test_the_comparison_says_what_besides_the_engine_differs():
    """A headline that mixes concurrency, prefix-cache hits and output lengths says so: each side's concurrency and
    output tokens, and the prompt tokens our cache served."""
    m = compute_metrics([RequestTiming(3102, 609, 0.1, 1.0, [0.1], cached_tokens=2591)], 1.0)
    ours = [BenchResult("minisgl", "long", 4, 1, m)]
    base = [_result("hf-stream", 498, 18.64, 1)]
    assert summary_line("Streaming chat", ours).endswith(
        "(concurrency=4, output_tokens=609, cached_prompt_tokens=2591/3102)")
    assert comparison_line(ours, base).endswith(
        "(concurrency 4 vs 1, output tokens 609 vs 498, 2591 prompt tokens cached)")


# --- workloads ---------------------------------------------------------------------------------


class _Tok:
    """A whitespace tokenizer: enough for the workload builders (its ids decode to words of letters)."""

    all_special_ids = [0]

    def encode(self, text, add_special_tokens=False):
        return [sum(map(ord, w)) % 97 + 1 for w in text.split()]

    def decode(self, ids):
        return " ".join("tok" + "".join(chr(97 + int(d)) for d in str(i)) for i in ids)


def test_reference_cases_lengths_repeat_and_mixed_prompts():
    cases = wl.reference_cases(_Tok(), 100, num_prompts=4, repeat=3, mixed_prompts=True, on_gpu=False)
    assert [c.name for c in cases] == ["short", "medium", "long"]
    assert [c.requests[0].max_new_tokens for c in cases] == [32, 64, 128]
    gpu = wl.reference_cases(_Tok(), 100, num_prompts=1, repeat=1, mixed_prompts=False, on_gpu=True)
    assert [c.requests[0].max_new_tokens for c in gpu] == [256, 512, 1024]
    short = cases[0]
    assert len(short.requests) == 12
    assert short.requests[0].prompt_tokens == 16 and short.requests[1].prompt_tokens > 16  # odd ones get a suffix
    assert short.requests[0].input_ids == short.requests[2].input_ids  # within a run: the same prompt twice
    assert short.requests[1].input_ids[:16] == short.requests[0].input_ids  # and one prompt's prefix
    capped = wl.reference_cases(None, 100, num_prompts=2, repeat=1, mixed_prompts=False, on_gpu=True,
                                max_new_tokens=4, names=["long"])
    assert [c.name for c in capped] == ["long"] and capped[0].requests[0].max_new_tokens == 4
    assert capped[0].requests[0].prompt is None  # no tokenizer (dummy weights): ids only


@pytest.mark.parametrize("tokenizer", ["none", "default"])
def test_every_reference_run_starts_cold_and_decodes_exactly_its_tokens(tokenizer, request):
    """No run (one pass over a case's prompts) of any case or concurrency level shares a first token with another,
    so none finds its prompts in a prefix cache that an earlier one filled; EOS is ignored, so every stack decodes
    the same number of tokens."""
    if tokenizer == "default":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(request.getfixturevalue("default_model_dir")))
        vocab = len(tok)
    else:
        tok, vocab = None, 1000
    levels = [wl.reference_cases(tok, vocab, num_prompts=2, repeat=3, mixed_prompts=True, on_gpu=False, level=k)
              for k in range(2)]
    runs = [case.requests[i: i + 2] for cases in levels for case in cases for i in range(0, 6, 2)]
    assert len(runs) == 2 * 3 * 3
    assert len({run[0].input_ids[0] for run in runs}) == len(runs)  # every run opens with its own token
    for cases in levels:
        for case, spec in zip(cases, wl.REFERENCE_CASES):
            assert all(r.ignore_eos and r.max_new_tokens == spec.max_new_tokens_cpu for r in case.requests)
            assert [r.prompt_tokens for r in case.requests[::2]] == [spec.prompt_tokens] * 3
    if tok is not None:  # a run's prompt text encodes back to its ids (what a server tokenizes)
        first = levels[0][0].requests[0]
        assert tok.encode(first.prompt, add_special_tokens=False) == first.input_ids


def test_random_nano_vllm_and_shared_prefix():
    r = wl.random_case(_Tok(), 50, num_prompts=20, input_len=30, output_len=10, range_ratio=0.5, seed=1)
    assert all(15 <= q.prompt_tokens <= 30 and 5 <= q.max_new_tokens <= 10 and q.ignore_eos for q in r.requests)
    assert all(0 not in q.input_ids for q in r.requests)  # special ids avoided
    assert (
        wl.random_case(_Tok(), 50, num_prompts=3, input_len=8, output_len=2, range_ratio=1.0).requests[0].prompt_tokens
        == 8
    )
    n1, n2 = wl.nano_vllm_case(32000), wl.nano_vllm_case(32000)
    assert len(n1.requests) == 256 and [q.input_ids for q in n1.requests] == [q.input_ids for q in n2.requests]
    assert all(100 <= q.prompt_tokens <= 1024 and 100 <= q.max_new_tokens <= 1024 and q.ignore_eos for q in n1.requests)
    sp = wl.shared_prefix_case(_Tok(), 100, num_prompts=5, prefix_len=40, question_len=6)
    prefix = sp.requests[0].input_ids[:40]
    assert all(q.input_ids[:40] == prefix and q.prompt_tokens == 46 for q in sp.requests)
    assert len({tuple(q.input_ids[40:]) for q in sp.requests}) == 5
    assert [p.input_ids for p in sp.prime] == [prefix]  # the system prompt alone, sent untimed first


def test_a_chat_prompt_goes_out_in_the_models_chat_template(default_model_dir):
    from transformers import AutoTokenizer

    from minisgl_cli.bench.suite import BenchConfig, build_cases

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    case, = build_cases(BenchConfig(dataset="rewrite", num_prompts=3), tok, len(tok), on_gpu=False)
    assert case.name == "rewrite" and len(case.requests) == 3
    req = case.requests[0]
    assert req.prompt is not None and wl.CHAT_PROMPTS["rewrite"] in req.prompt
    assert req.prompt.startswith("<|im_start|>") and req.prompt.endswith("<|im_start|>assistant\n")
    assert req.input_ids == tok.encode(req.prompt, add_special_tokens=False)  # the text a server gets, as ids
    assert req.max_new_tokens == wl.CHAT_NEW_TOKENS and not req.ignore_eos  # the answer ends where it ends
    capped, = build_cases(BenchConfig(dataset="code-edit", max_new_tokens=16), tok, len(tok), on_gpu=False)
    assert len(capped.requests) == 4 and capped.requests[0].max_new_tokens == 16
    with pytest.raises(ValueError, match="tokenizer"):  # dummy weights: no chat template to apply
        wl.chat_case(None, "open-chat", num_prompts=1, max_new_tokens=8)


# --- online runner on a fake OpenAI-compatible server ---------------------------------------------


def _fake_server():
    """An SSE /v1/completions that streams 3 chunks and usage; records the peak number in flight."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    state = {"inflight": 0, "peak": 0, "bodies": []}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(body: dict):
        state["bodies"].append(body)

        async def events():
            state["inflight"] += 1
            state["peak"] = max(state["peak"], state["inflight"])
            try:
                for word in ("a", "b", "c"):
                    await asyncio.sleep(0.02)
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'text': word}]})}\n\n"
                usage = {"prompt_tokens": 3, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 1}}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["inflight"] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return app, state


@pytest.fixture
def fake_url():
    import socket

    import uvicorn

    app, state = _fake_server()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=5)


def test_online_runner_streams_and_limits_concurrency(fake_url):
    from minisgl_cli.bench.online import HttpTarget

    url, state = fake_url
    runner = HttpTarget(url, request_rate=math.inf)
    assert runner.model == "fake-model"
    case = wl.Case("t", [wl.BenchRequest([1, 2, 3], 3, True, "hi there") for _ in range(6)])
    done = []
    out = runner.run(case, 2, lambda: done.append(1))
    assert len(done) == 6 and state["peak"] <= 2
    m = compute_metrics(out.timings, out.duration_s)
    assert (m.completed, m.total_output_tokens, m.total_cached_tokens) == (6, 18, 6)
    assert m.ttft_ms.count == 6 and m.itl_ms.count == 12 and m.tpot_ms.count == 6
    body = state["bodies"][0]
    assert body["stream"] and body["ignore_eos"] and body["prompt"] == "hi there" and body["max_tokens"] == 3


def test_client_processes_merge_every_request_once(fake_url):
    from minisgl_cli.bench.online import HttpTarget
    from minisgl_cli.bench.report import BenchResult
    from minisgl_cli.bench.suite import BenchConfig

    url, state = fake_url
    # Each request's prompt names it, so the merged timings can be matched to the requests they came from.
    case = wl.Case("t", [wl.BenchRequest([1, 2, 3][: 1 + i % 3], 3, True, f"req {i}") for i in range(7)])
    done = []
    out = HttpTarget(url, client_procs=3).run(case, 4, lambda: done.append(1))
    assert len(done) == 7 and len(out.timings) == 7 and state["peak"] <= 4
    assert sorted(b["prompt"] for b in state["bodies"]) == sorted(f"req {i}" for i in range(7))  # each sent once
    assert [t.prompt_tokens for t in out.timings] == [r.prompt_tokens for r in case.requests]  # in request order
    m = compute_metrics(out.timings, out.duration_s)
    assert (m.completed, m.total_output_tokens, m.ttft_ms.count) == (7, 21, 7)
    assert len(out.client_cpu) == 3 and all(u.cpu_s > 0 and u.wall_s > 0 for u in out.client_cpu)
    flat = BenchResult("server", "t", 4, 7, m, client_cpu=out.client_cpu).flat()
    assert flat["client_procs"] == 3 and len(flat["client_core_share"]) == 3
    with pytest.raises(ValueError, match="--client-procs"):  # offline, the engine's client is in this process
        BenchConfig(client_procs=2)


def test_online_runner_sends_the_sampling_knobs(fake_url):
    from minisgl_cli.bench.online import HttpTarget

    url, state = fake_url
    sampling = wl.Sampling(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05)
    HttpTarget(url).run(wl.Case("t", [wl.BenchRequest([1], 3, sampling=sampling)]), 1, lambda: None)
    body = state["bodies"][-1]
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"]) == (0.7, 0.9, 20, 0.05)
    assert sampling.label == "t=0.7 top_p=0.9 top_k=20 min_p=0.05" and wl.Sampling().label == "greedy"
    with pytest.raises(ValueError, match="min_p"):
        wl.Sampling(temperature=1.0, min_p=2.0)


def test_online_poisson_arrivals_spread_requests(fake_url):
    from minisgl_cli.bench.online import HttpTarget

    url, _ = fake_url
    case = wl.Case("t", [wl.BenchRequest([1], 3) for _ in range(5)])
    t0 = time.perf_counter()
    HttpTarget(url, request_rate=20.0, seed=3).run(case, 5, lambda: None)
    # 4 exponential gaps at 20 req/s average 0.2 s in all; at least the gaps' sum must have elapsed.
    import random

    rng = random.Random(3)
    assert time.perf_counter() - t0 >= sum(rng.expovariate(20.0) for _ in range(4))


def test_gc_pauses_count_collections_while_watched_and_not_after():
    """The client's collector pauses (process_cpu.GcPauses): each watcher counts the collections made while it
    watches, every generation's, and none once stopped; two watchers do not disturb each other."""
    import gc

    from minisgl_cli.process_cpu import GcPauses

    outer = GcPauses.watch()
    inner = GcPauses.watch()
    gc.collect()
    gc.collect(0)
    inner.stop()
    gc.collect()
    outer.stop()
    gc.collect()
    assert inner.count >= 2 and outer.count >= inner.count + 1  # (an automatic collection may add one)
    assert 0 < inner.max_s <= inner.total_s and outer.total_s > 0
    assert inner._timed not in gc.callbacks and outer._timed not in gc.callbacks


# --- end to end --------------------------------------------------------------------------------

RESULT_SCHEMA = {
    "type": "object",
    "required": ["engine", "case", "concurrency", "num_requests", "completed", "failed", "duration_s",
                 "request_throughput", "input_throughput", "output_throughput", "total_throughput",
                 "total_input_tokens", "total_output_tokens", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                 "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
                 "mean_e2e_latency_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms", "case_params"],
    "properties": {
        "engine": {"type": "string"}, "case": {"type": "string"},
        "concurrency": {"type": "integer", "minimum": 1}, "num_requests": {"type": "integer"},
        "completed": {"type": "integer"}, "failed": {"type": "integer"},
        "total_cached_tokens": {"type": ["integer", "null"]}, "case_params": {"type": "object"},
        "client_procs": {"type": "integer", "minimum": 1},  # the HTTP client's processes and each one's CPU
        "client_cpu_seconds": {"type": "array", "items": {"type": "number", "minimum": 0}},
        "client_core_share": {"type": "array", "items": {"type": "number", "minimum": 0}},
        "client_gc_seconds": {"type": "array", "items": {"type": "number", "minimum": 0}},  # its collector's pauses
        "client_gc_longest_seconds": {"type": "array", "items": {"type": "number", "minimum": 0}},
        "started_at": {"type": "number"},  # time.time() as the run's clock started
    },
    "patternProperties": {"_(ms|throughput|s)$": {"type": "number", "minimum": 0}},
}
REPORT_SCHEMA = {
    "type": "object",
    "required": ["meta", "results", "summary", "notes"],
    "properties": {
        "meta": {"type": "object", "required": ["model", "device", "mode", "config", "created"]},
        "results": {"type": "array", "minItems": 1, "items": RESULT_SCHEMA},
        "summary": {"type": "array", "items": {"type": "string"}},
        "notes": {"type": "array", "items": {"type": "string"}},
    },
}


def _validate(doc: dict) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(doc, REPORT_SCHEMA)


def test_report_json_schema_on_synthetic_results(tmp_path):
    report = BenchReport({"model": "m", "device": "cpu", "mode": "offline", "config": {}, "created": "now"},
                         [_result("minisgl", 10, 1.0), _result("hf-stream", 10, 2.0, 1)])
    report.write_json(tmp_path / "r.json")
    doc = json.loads((tmp_path / "r.json").read_text())
    _validate(doc)
    assert doc["summary"][0].startswith("Streaming chat summary")


def _invoke(args: list[str]):
    from minisgl_cli.app import app

    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result


TINY = ["--repeat", "1", "--warmup", "0", "--max-new-tokens", "4", "--num-prompts", "2", "--case", "short"]


@pytest.mark.slow
def test_offline_bench_vs_hf_stream_end_to_end(tmp_path):
    out_json, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = _invoke([*TINY, "--concurrency", "2", "--baseline", "hf-stream", "--baseline", "hf-batched",
                      "--peer", "llama-cpp", "--output-json", str(out_json), "--plot", str(png)])
    import re

    for pattern in (SUMMARY, BASELINE, COMPARISON):
        assert re.search(pattern, result.output), result.output
    doc = json.loads(out_json.read_text())
    _validate(doc)
    by_engine = {r["engine"]: r for r in doc["results"]}
    assert set(by_engine) == {"minisgl", "hf-stream", "hf-batched"}
    assert by_engine["hf-stream"]["concurrency"] == 1 and by_engine["minisgl"]["concurrency"] == 2
    for r in doc["results"]:
        assert r["completed"] == 2 and r["failed"] == 0 and 2 <= r["total_output_tokens"] <= 8
    assert by_engine["minisgl"]["median_ttft_ms"] > 0 and by_engine["hf-batched"]["mean_ttft_ms"] == 0
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert any("llama-cpp-python is not installed" in n for n in doc["notes"])
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_offline_bench_compares_like_for_like_with_hf(tmp_path):
    """On the default model: each summary line says its concurrency, output tokens and cache hits; both stacks
    decode the same tokens (EOS ignored); and no run is served from a cache an earlier run filled, at any level (one
    prompt a run: the old suite sent the same prompt every repeat, and every level, and hit the cache)."""
    import re

    out_json = tmp_path / "bench.json"
    result = _invoke(["--case", "short", "--repeat", "2", "--num-prompts", "1", "--no-mixed-prompts", "--warmup", "0",
                      "--max-new-tokens", "4", "--concurrency", "1", "--concurrency", "2", "--output-json",
                      str(out_json)])
    doc = json.loads(out_json.read_text())
    ours = [r for r in doc["results"] if r["engine"] == "minisgl"]
    (hf,) = [r for r in doc["results"] if r["engine"] == "hf-stream"]
    assert [r["concurrency"] for r in ours] == [1, 2] and hf["concurrency"] == 1
    assert [r["total_cached_tokens"] for r in ours] == [0, 0] and hf["total_cached_tokens"] is None
    assert {r["total_output_tokens"] for r in [*ours, hf]} == {2 * 4}  # 2 runs x 4 tokens, EOS or not
    for c, r in zip((1, 2), ours):
        cached = rf"cached_prompt_tokens=0/{r['total_input_tokens']}"
        assert re.search(rf"{SUMMARY} \(concurrency={c}, output_tokens=8, {cached}\)", result.output), result.output
        assert re.search(rf"{COMPARISON} \(concurrency {c} vs 1, same output tokens, 0 prompt tokens cached\)",
                         result.output), result.output
    assert re.search(rf"{BASELINE} \(concurrency=1, output_tokens=8, no prefix cache\)", result.output)


@pytest.mark.slow
def test_offline_bench_samples_when_asked(tmp_path):
    out_json = tmp_path / "bench.json"
    result = _invoke([*TINY, "--no-baseline", "--temperature", "0.7", "--top-p", "0.9", "--output-json",
                      str(out_json)])
    assert "sampling=t=0.7 top_p=0.9" in result.output
    doc = json.loads(out_json.read_text())
    assert doc["meta"]["config"]["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0}
    (r,) = doc["results"]
    assert r["completed"] == 2 and r["failed"] == 0


@pytest.mark.slow
def test_online_bench_against_minisgl_server(tmp_path):
    pytest.importorskip("minisgl_cli.server.app", reason="minisgl serve (minisgl_cli.server.app) not built yet")
    from server_fixtures import shared_client

    from minisgl_cli.api.http_server import BackgroundServer
    from minisgl_cli.server.app import create_app

    out_json = tmp_path / "online.json"
    with BackgroundServer(create_app(shared_client())) as url:
        _invoke([*TINY, "--url", url, "--max-concurrency", "2", "--request-rate", "50", "--output-json", str(out_json)])
        _invoke([*TINY, "--url", url, "--api", "chat", "--max-concurrency", "1"])
    doc = json.loads(out_json.read_text())
    _validate(doc)
    (r,) = doc["results"]
    assert r["engine"].startswith("server@127.0.0.1") and r["concurrency"] == 2
    assert r["completed"] == 2 and r["failed"] == 0 and r["total_output_tokens"] == 8  # server usage counts
    assert r["median_ttft_ms"] > 0 and doc["meta"]["mode"] == "online"
    assert r["client_procs"] == 1 and r["client_cpu_seconds"][0] > 0  # the client measured itself
    assert r["client_gc_seconds"][0] >= 0 and abs(r["started_at"] - time.time()) < 600


@pytest.mark.slow
def test_online_bench_times_tokens_when_neither_side_has_a_tokenizer(tmp_path):
    """A server on dummy weights streams token-only chunks; the client (no tokenizer for qwen3-0.6b here)
    still reports TTFT, TPOT and ITL from them, and counts tokens from the server's usage."""
    from minisgl_cli.api.http_server import BackgroundServer
    from minisgl_cli.client.local import LocalClient
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.server.app import create_app

    client = LocalClient(EngineConfig(model="smollm2-135m", load_format="dummy", max_total_tokens=2048))
    out_json = tmp_path / "online.json"
    try:
        with BackgroundServer(create_app(client)) as url:
            _invoke(["--url", url, "--model", "qwen3-0.6b", "--dataset", "random", "--num-prompts", "4",
                     "--input-len", "16", "--output-len", "8", "--max-concurrency", "2", "--warmup", "0",
                     "--output-json", str(out_json)])
    finally:
        client.close()
    (r,) = json.loads(out_json.read_text())["results"]
    assert r["completed"] == 4 and r["failed"] == 0
    assert r["median_ttft_ms"] > 0 and r["median_tpot_ms"] > 0 and r["median_itl_ms"] > 0
