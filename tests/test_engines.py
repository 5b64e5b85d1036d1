"""Engine backends (`--engine`, BACKEND_IMPL): hf and mlx behind the same EngineClient as ours, sgl's fallback,
flags a backend has no use for refused, figures it does not have shown as n/a."""

from __future__ import annotations

import importlib.util
import io
import json
import logging

import httpx
import pytest
from rich.console import Console
from serve_process import Serve
from typer.testing import CliRunner

from commands.common import ALL, EngineOptions, engine_options
from minisgl_cli import backends
from minisgl_cli.backends.serial import PieceDecoder
from minisgl_cli.messages import DecodedPiece
from minisgl_cli.repl.view import ChatView, status_line
from minisgl_cli.server.metrics import ServerMetrics
from minisgl_cli.types import RequestStats, SamplingParams, SchedulerStats

PARIS = "What is the capital of France?"
SERIAL = ["hf", pytest.param("mlx", marks=pytest.mark.skipif(
    importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm is not installed (pip install 'minisgl[mlx]')"))]


def _probe(args: list[str], env: dict[str, str] | None = None):
    """Run a command offering every engine option; (exit code, output, the EngineOptions it got)."""
    import typer

    app, seen = typer.Typer(), []

    @app.command()
    @engine_options(ALL)
    def probe(*, opts: EngineOptions) -> None:
        seen.append(opts)

    result = CliRunner().invoke(app, args, env={"COLUMNS": "300", **(env or {})})
    return result.exit_code, result.output, seen[0] if seen else None


def test_engine_comes_from_backend_impl_and_attention_has_its_own_variable():
    code, out, opts = _probe([], env={"BACKEND_IMPL": "sgl", "MINISGL_ATTENTION_BACKEND": "torch"})
    assert code == 0, out
    assert (opts.engine.engine, opts.engine.attention_backend) == ("sgl", "torch")
    assert _probe([], env={"BACKEND_IMPL": "hf"})[2].engine.engine == "hf"
    code, out, opts = _probe(["--engine", "sgl", "--attention-backend", "triton"])
    assert code == 0 and (opts.engine.engine, opts.engine.attention_backend) == ("sgl", "triton")
    code, out, _ = _probe(["--engine", "vllm"])
    assert code == 2 and "--engine must be one of auto, torch, sgl, hf, mlx" in out


@pytest.mark.parametrize("engine", ["hf", "mlx"])
def test_a_serial_engine_refuses_the_flags_of_ours_in_one_line(engine):
    code, out, _ = _probe(["--engine", engine, "--page-size", "4", "--cache", "naive", "--tp", "2", "--dp", "2"])
    assert code == 2
    assert f"--engine {engine} runs in this process" in out
    assert "drop --page-size, --cache, --tp, --dp (they configure the torch engine)" in " ".join(out.split())
    code, out, _ = _probe(["--engine", engine, "--runtime", "processes"])
    assert code == 2 and "--runtime processes" in out
    assert _probe(["--engine", engine, "--dtype", "float32", "--device", "cpu", "--runtime", "in-process"])[0] == 0


def test_auto_is_mlx_on_apple_silicon_with_mlx_lm_else_torch(monkeypatch, caplog):
    def auto(apple: bool, mlx: bool) -> str:
        backends._auto.cache_clear()
        monkeypatch.setattr(backends, "apple_silicon", lambda: apple)
        monkeypatch.setattr(backends, "mlx_available", lambda: mlx)
        return backends.resolve("auto")

    try:
        assert auto(apple=False, mlx=True) == "torch"
        assert auto(apple=True, mlx=True) == "mlx"
        with caplog.at_level(logging.WARNING, "minisgl.backends"):
            assert auto(apple=True, mlx=False) == "torch"
        assert [r.getMessage() for r in caplog.records] == [
            "--engine auto: the torch engine (mlx-lm is not installed: pip install 'minisgl[mlx]')"]
        assert backends.resolve("hf") == "hf"
    finally:
        backends._auto.cache_clear()


def test_figures_an_engine_lacks_are_na_never_zero():
    """None in SchedulerStats is n/a: null in /metrics JSON, no Prometheus series, "n/a" in chat."""
    s = SchedulerStats(tokens_total=None, tokens_free=None, tokens_cached=None, tokens_in_use=None,
                       cache_hit_tokens=None, cache_miss_tokens=None, cache_hit_requests=None, cache_miss_requests=None,
                       steps=None, retracted_requests=None, prefill_tokens=37, decode_tokens=7, finished_requests=1)
    doc = s.to_dict()
    assert doc["tokens_total"] is None and doc["cache_hit_rate"] is None and doc["prefill_tokens"] == 37
    prom = ServerMetrics().to_prometheus(s, "m")
    assert "minisgl_kv_tokens_total" not in prom and "minisgl_cache_hit_tokens_total" not in prom
    assert "minisgl_retracted_requests_total" not in prom and "minisgl_decode_throughput" in prom
    out = io.StringIO()
    view = ChatView(Console(file=out, width=100))
    view.prefix_cache = None
    view.stats(s, 1, [])
    table = out.getvalue()
    assert "prefix cache hit rate" in table and "n/a" in table and "37 / 7" in table
    st = RequestStats(prompt_tokens=37, cached_tokens=0, completion_tokens=8, ttft_s=0.1, latency_s=0.8)
    assert "cached n/a" in status_line(st, "stop", None)
    assert "cached 0 (0% prompt hit)" in status_line(st, "stop", "prompt")


def test_serial_stop_strings_cut_the_streamed_text():
    dec = PieceDecoder(SamplingParams(stop=["Par"]))
    first = dec.feed([DecodedPiece("r", "The capital is ", [1, 2, 3])])
    assert (first.text, first.finish_reason) == ("The capital is ", None)
    held = dec.feed([DecodedPiece("r", "Pa", [4])])  # could start the stop string: held back
    assert held.text == "" and held.finish_reason is None
    cut = dec.feed([DecodedPiece("r", "ris.", [5])])
    assert (cut.text, cut.finish_reason, cut.stopped_early) == ("", "stop", True)
    plain = PieceDecoder(SamplingParams()).feed([DecodedPiece("r", "Hi", [7]),
                                                 DecodedPiece("r", "", [2], finish_reason="stop")])
    assert (plain.text, plain.token_ids, plain.finish_reason, plain.stopped_early) == ("Hi", [7, 2], "stop", False)


def test_sgl_without_cuda_is_the_torch_engine_with_one_line_why(tiny_model_dirs, caplog):
    from minisgl_cli.engine.config import EngineConfig

    with caplog.at_level(logging.WARNING, "minisgl.engine"):
        client = backends.in_process_client(EngineConfig(model=str(tiny_model_dirs["llama"]), engine="sgl",
                                                        max_total_tokens=256))
    try:
        assert client.info.engine == "torch"
    finally:
        client.close()
    lines = [r.getMessage() for r in caplog.records if "sgl" in r.getMessage()]
    assert lines == ["--engine sgl: sgl_kernel's ops run on CUDA only, and this engine is on cpu; "
                     "running the torch engine"]


# --- end to end, on the default model ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("engine", SERIAL)
def test_smoke_answers_paris(engine):
    from minisgl_cli.app import app

    result = CliRunner().invoke(app, ["smoke", PARIS, "--engine", engine, "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "Paris" in result.stdout and f"engine={engine} " in result.stdout


@pytest.fixture(scope="module", params=SERIAL)
def serial_server(request, tmp_path_factory, default_model_dir):
    server = Serve(default_model_dir, tmp_path_factory.mktemp("serve"), "--engine", request.param, kv_tokens=None)
    try:
        server.wait_healthy()
        yield request.param, server
    finally:
        server.stop()


@pytest.mark.slow
def test_serve_answers_through_the_openai_client(serial_server):
    import openai

    engine, server = serial_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    first = [{"role": "user", "content": PARIS}]
    reply = client.chat.completions.create(model="default", messages=first, max_tokens=12, temperature=0)
    assert "Paris" in (reply.choices[0].message.content or "")
    streamed = client.chat.completions.create(model="default", messages=first, max_tokens=12, temperature=0,
                                              stream=True)
    assert "Paris" in "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    with pytest.raises(openai.BadRequestError, match="logprobs: the .* engine does not implement it"):
        client.chat.completions.create(model="default", messages=first, max_tokens=4, logprobs=True)
    if engine == "mlx":  # the next turn of the chat: the conversation so far comes from mlx-lm's prompt cache
        turn2 = [*first, {"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "And of Germany?"}]
        again = client.chat.completions.create(model="default", messages=turn2, max_tokens=12, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens
    sched = httpx.get(f"{server.url}/metrics", timeout=10).json()["scheduler"]
    assert sched["tokens_total"] is None and sched["steps"] is None and sched["finished_requests"] >= 2
    if engine == "hf":  # no prefix cache: its hits are n/a, not 0
        assert sched["cache_hit_tokens"] is None and sched["cache_hit_rate"] is None
    else:
        assert sched["cache_hit_tokens"] >= reply.usage.prompt_tokens


@pytest.mark.slow
def test_bench_compares_the_engines_in_one_table(tmp_path):
    from minisgl_cli.app import app

    engines_run = ["torch", "hf"] + (["mlx"] if importlib.util.find_spec("mlx_lm") else [])
    out_json = tmp_path / "backends.json"
    args = ["bench", "--repeat", "1", "--warmup", "0", "--max-new-tokens", "4", "--num-prompts", "2", "--case",
            "short", "--concurrency", "2", "--no-baseline", "--output-json", str(out_json)]
    result = CliRunner().invoke(app, [*args, *(x for e in engines_run for x in ("--engine", e))],
                                env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output + repr(result.exception)
    rows = {r["engine"]: r for r in json.loads(out_json.read_text())["results"]}
    assert list(rows) == [f"minisgl[{e}]" for e in engines_run]
    for r in rows.values():  # one workload: the same prompts, the same token counts
        assert (r["completed"], r["failed"]) == (2, 0)
        assert r["total_input_tokens"] == rows["minisgl[torch]"]["total_input_tokens"]
        assert 2 <= r["total_output_tokens"] <= 8
    assert rows["minisgl[hf]"]["total_cached_tokens"] is None  # n/a: hf has no prefix cache
    for e in engines_run:
        assert f"minisgl[{e}]" in result.output  # the table's rows


# --- sgl on a GPU where sgl_kernel imports (not on the machines here: docs/backends.md says why) -----------------


def _sgl_kernel():
    if not __import__("torch").cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        import sgl_kernel
    except Exception as exc:
        pytest.skip(f"sgl_kernel does not import ({type(exc).__name__})")
    return sgl_kernel


@pytest.mark.gpu
def test_sgl_kernel_ops_match_ours():
    """RMSNorm (+add), SiLU-and-mul and RoPE through sgl_kernel against our torch ops, bf16 on CUDA."""
    import torch

    from minisgl_cli.layers.activation import silu_and_mul
    from minisgl_cli.layers.kernel_choice import Kernels
    from minisgl_cli.layers.norm import RMSNorm
    from minisgl_cli.layers.rotary import RotaryEmbedding

    sgl, ours = Kernels(sgl=_sgl_kernel()), Kernels(fused=False)
    g = torch.Generator("cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g).bfloat16()

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return (a.float() - b.float()).abs().max().item() <= 0.02 * b.float().abs().max().item()

    norm = RMSNorm(1024, 1e-6, sgl).cuda().bfloat16()
    norm.weight.data = rand(1024)
    ref = RMSNorm(1024, 1e-6, ours).cuda().bfloat16()
    ref.weight.data = norm.weight.data.clone()
    x, res, heads = rand(7, 1024), rand(7, 1024), rand(7, 8, 128)
    assert close(norm(x), ref(x))
    want_h, want_r = ref.forward_residual(x.clone(), res.clone())
    got_h, got_r = norm.forward_residual(x.clone(), res.clone())
    assert close(got_h, want_h) and close(got_r, want_r)
    head_norm, head_ref = RMSNorm(128, 1e-6, sgl).cuda().bfloat16(), RMSNorm(128, 1e-6, ours).cuda().bfloat16()
    assert close(head_norm(heads), head_ref(heads))
    gate_up = rand(7, 2 * 1536)
    assert close(silu_and_mul(gate_up, sgl), silu_and_mul(gate_up, ours))
    rope = RotaryEmbedding(128, 4096, 1e6).cuda()
    pos = torch.tensor([0, 1, 2, 3, 100, 2000, 4095], device="cuda")
    q, k = rand(7, 16, 128), rand(7, 4, 128)
    want_q, want_k = rope(pos, q, k)
    rope.apply_sgl_(sgl.sgl, pos, q, k)
    assert close(q, want_q) and close(k, want_k)


@pytest.mark.gpu
def test_sgl_engine_answers_and_says_so():
    _sgl_kernel()
    from minisgl_cli.llm import LLM
    from minisgl_cli.types import SamplingParams

    with LLM(engine="sgl") as llm:
        assert llm.client.info.engine == "sgl"
        out = llm.generate([[{"role": "user", "content": PARIS}]], SamplingParams(max_new_tokens=12))
    assert "Paris" in out[0].text
