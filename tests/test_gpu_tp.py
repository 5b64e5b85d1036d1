"""Two GPUs: the one-shot all-reduce (distributed/one_shot.py) gives NCCL's sums bit for bit — bf16, 4 KB to
2 MB, eager and replayed in a CUDA graph — the fused all-reduce + RMSNorm (distributed/push_rows.py) gives the
one-shot sum then the RMSNorm bit for bit, and TP 2's greedy tokens agree with TP 1's within the GPU numerics
tolerance (test_gpu_numerics.py's: logprobs within 6e-2; a different token only where TP 1's top two are that
close). Skipped without two CUDA GPUs.

With two ranks every element is one correctly rounded bf16 addition on either path, so the sums are equal, not
merely close. TP 2 and TP 1 differ in rounding (each rank's GEMMs sum half the products), so their tokens may
split at a near-tie and then differ (docs/benchmarks.md, `--tp 2` vs `--tp 1`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import traceback

import pytest
import torch
from ranks import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]

SIZES = [4 << 10, 8 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20]  # bytes of bf16: decode rows x 1024..4096
TOL = 6e-2


def _on_rank(rank: int, addr: str, out, check) -> None:
    """One of two ranks: join the group on GPU `rank`, run check(rank, device, tp), put (rank, None | traceback)."""
    from minisgl_cli.distributed import DistConfig, comm

    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        check(rank, device, comm.init_tp(rank, DistConfig(tp_size=2, init_addr=addr), device))
        torch.cuda.synchronize()
        out.put((rank, None))
    except BaseException:  # noqa: BLE001 - the parent reports it
        out.put((rank, traceback.format_exc()))
    finally:
        comm.close_tp()


def _sums(rank: int, device: torch.device, tp) -> None:
    """Every size's one-shot sum against NCCL's, eager and in a graph."""
    import torch.distributed as dist

    from minisgl_cli.distributed import comm

    tp = comm.setup_all_reduce(tp, device, torch.bfloat16, max(SIZES))
    assert tp.one_shot is not None, "symmetric memory could not be set up: see the warning above"
    g = torch.Generator(device=device).manual_seed(rank)

    def data(nbytes: int) -> torch.Tensor:
        return torch.randn(nbytes // 2 // 1024, 1024, generator=g, device=device).to(torch.bfloat16)

    def nccl(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y)
        return y

    for n in SIZES:
        x = data(n)
        assert tp.one_shot.takes(x), n
        got = comm.all_reduce(x, tp)
        assert got is not x and torch.equal(got, nccl(x)), f"eager {n} B: {(got - nccl(x)).abs().max()}"
        static = torch.zeros_like(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = comm.all_reduce(static, tp)
        for _ in range(2):
            static.copy_(data(n))
            graph.replay()
            want = nccl(static)
            assert torch.equal(static_out, want), f"graph {n} B: {(static_out - want).abs().max()}"
    big = data(2 * max(SIZES))  # past the buffer: NCCL, in place
    want = nccl(big)
    assert not tp.one_shot.takes(big) and comm.all_reduce(big, tp) is big and torch.equal(big, want)


def test_one_shot_all_reduce_equals_nccl_eager_and_in_a_graph():
    results = run_ranks(_on_rank, 2, _sums)
    assert results == {0: None, 1: None}, "\n".join(str(v) for v in results.values() if v)


def _fused(rank: int, device: torch.device, tp, lamport: bool = False) -> None:
    """The fused all-reduce + RMSNorm against the one-shot sum then the Triton RMSNorm, bit for bit (the normed
    rows, FP8 codes too, and the residual), 1 to 64 rows, eager and replayed in a graph; with its flags or
    (`lamport`) the rows as their own flags."""
    from minisgl_cli.distributed import comm
    from minisgl_cli.distributed.push_rows import FUSED_NORM_ROWS
    from minisgl_cli.kernels.triton import ops

    hidden = 4096
    tp = dataclasses.replace(tp, all_reduce="lamport" if lamport else "auto")
    tp = comm.setup_all_reduce(tp, device, torch.bfloat16, 2 << 20, (FUSED_NORM_ROWS, hidden))
    assert tp.push_rows is not None, "the fused kernel's buffers could not be set up: see the warning above"
    assert tp.push_rows.lamport == lamport
    g = torch.Generator(device=device).manual_seed(rank)  # each rank's partial rows differ
    alike = torch.Generator(device=device).manual_seed(1234)  # the weight and residual are the same on both
    weight = torch.randn(hidden, generator=alike, device=device).to(torch.bfloat16)

    def reference(x, residual, quant):
        r = residual.clone()
        normed = ops.rmsnorm(comm.all_reduce(x, tp), weight, 1e-6, residual=r, pdl=False, quant=quant)
        return normed, r

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return same(a.codes, b.codes) and torch.equal(a.scales, b.scales)

    for rows in (1, 3, 8, FUSED_NORM_ROWS):
        for quant in (False, True):
            x = torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16)
            residual = torch.randn(rows, hidden, generator=alike, device=device).to(torch.bfloat16)
            want, want_r = reference(x, residual, quant)
            for pdl in (False, True):
                r = residual.clone()
                got = ops.all_reduce_rmsnorm(x, r, weight, 1e-6, tp.push_rows, pdl=pdl, quant=quant)
                assert same(got, want) and torch.equal(r, want_r), f"eager {rows} rows, quant {quant}, pdl {pdl}"
            static_x, static_r = torch.zeros_like(x), torch.zeros_like(residual)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = ops.all_reduce_rmsnorm(static_x, static_r, weight, 1e-6, tp.push_rows, quant=quant)
            for _ in range(3):  # both parities of the buffers, and again
                static_x.copy_(torch.randn(rows, hidden, generator=g, device=device).to(torch.bfloat16))
                static_r.copy_(residual)
                want, want_r = reference(static_x, residual, quant)
                graph.replay()
                assert same(static_out, want) and torch.equal(static_r, want_r), f"graph {rows} rows, {quant}"


@pytest.mark.parametrize("lamport", [False, True])
def test_fused_all_reduce_rmsnorm_equals_the_sum_then_the_norm(lamport):
    results = run_ranks(_on_rank, 2, functools.partial(_fused, lamport=lamport), timeout=180)
    assert results == {0: None, 1: None}, "\n".join(str(v) for v in results.values() if v)


def _greedy(tp: int) -> tuple[list, list[str]]:
    """Qwen3-0.6B dummy weights at --tp `tp`: each prompt's 16 greedy tokens with their top-2 logprobs, and the
    start-up lines (which name the all-reduce)."""
    from minisgl_cli.client.protocol import complete
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.runtime.config import RuntimeConfig
    from minisgl_cli.runtime.launch import launch
    from minisgl_cli.scheduler.scheduler import SchedulerConfig
    from minisgl_cli.types import GenerateRequest, SamplingParams

    rnd = random.Random(0)
    prompts = [[rnd.randrange(10000) for _ in range(n)] for n in (17, 100, 250, 600)]
    lines: list[str] = []
    engine = EngineConfig(model="qwen3-0.6b", load_format="dummy", max_total_tokens=8192, max_running_requests=4,
                          cuda_graph_max_bs=4)
    rt = RuntimeConfig(tp_size=tp)
    client = launch(engine, SchedulerConfig(), rt, lines.append)
    try:
        async def run():
            params = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2)
            return await asyncio.gather(*(complete(client, GenerateRequest(input_ids=p, params=params))
                                          for p in prompts))

        return [c.logprobs for c in asyncio.run(run())], lines
    finally:
        client.close()


def test_tp2_greedy_tokens_agree_with_tp1_within_the_numerics_tolerance():
    one, _ = _greedy(1)
    two, lines = _greedy(2)
    assert any("all-reduce fused with RMSNorm" in line for line in lines), lines  # the path under test ran
    for a, b in zip(one, two):
        for i, (x, y) in enumerate(zip(a, b)):
            if x.token_id != y.token_id:
                top = sorted((t.logprob for t in x.top), reverse=True)
                assert top[0] - top[1] < TOL, f"TP 2 left TP 1's token {i} though TP 1's top two differ by " \
                                              f"{top[0] - top[1]:.3f}"
                assert y.token_id in {t.token_id for t in x.top}
                break  # the sequences differ from here on
            assert abs(x.logprob - y.logprob) <= TOL, (i, x.logprob, y.logprob)
