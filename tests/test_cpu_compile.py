"""The CPU decode through torch.compile (engine/cpu_compile.py), on the real default model's int4 weights."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import torch
from serve_process import Serve, gone

from minisgl_cli.core.batch import ForwardBatch
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.engine.engine import Engine


def test_torch_compile_resolves_per_device_and_mode():
    """auto compiles the CPU's int4 / int8 decode at TP 1 in a scheduler process only; on refuses what it
    cannot run."""
    auto = EngineConfig(device="cpu", torch_compile="auto")
    assert auto.compiles_decode("int4", 1, True) and auto.compiles_decode("int8", 1, True)
    assert not auto.compiles_decode("int4", 1, False)  # in-process: an exit mid-compile would have to wait
    bench = EngineConfig(device="cpu", torch_compile="auto", compile_in_process=True)  # minisgl bench's engines
    assert bench.compiles_decode("int4", 1, False)
    assert not auto.compiles_decode("none", 1, True)  # the exact mode keeps eager's numbers (HF parity)
    assert not auto.compiles_decode("int4", 2, True)
    assert not EngineConfig(device="cpu", torch_compile="off").compiles_decode("int4", 1, True)
    assert EngineConfig(device="cpu", torch_compile="on").compiles_decode("none", 1, False)
    with pytest.raises(ValueError, match="--torch-compile on runs on the CPU at TP 1"):
        EngineConfig(device="cpu", torch_compile="on").compiles_decode("int4", 2, True)
    with pytest.raises(ValueError, match="--torch-compile must be one of auto, on, off"):
        EngineConfig(torch_compile="yes")  # type: ignore[arg-type]


def _prefill(engine: Engine, n: int) -> list[tuple[int, torch.Tensor]]:
    """n requests of 100 prompt tokens each in the pool: (req slot, its KV slots)."""
    pool, rows = engine.pool, []
    for r in range(n):
        row = pool.alloc_req_slot()
        pages = pool.alloc_pages(256)
        assert row is not None and pages is not None
        slots = pool.slots_of_pages(pages)[:256]
        pool.page_table[row, :256] = slots.to(torch.int32)
        engine.forward(ForwardBatch.build("extend", list(range(1000 + 7 * r, 1100 + 7 * r)), [row], [0], [100],
                                          slots[:100], engine.device, engine.host))
        rows.append((row, slots))
    return rows


def _decode(engine: Engine, rows: list[tuple[int, torch.Tensor]]) -> ForwardBatch:
    """A decode step of `rows`, built as the scheduler builds it (outside inference mode: torch.compile's guards
    tell inference tensors apart)."""
    n = len(rows)
    return ForwardBatch.build("decode", [5] * n, [r for r, _ in rows], [100] * n, [1] * n,
                              [int(s[100]) for _, s in rows], engine.device, engine.host)


@pytest.mark.slow
def test_compiled_decode_matches_eager_against_the_fp32_truth():
    """Engine.forward's decode through the compiled function (bf16 activations) is as close to the same int4
    weights run in fp32 as the eager step, and the same top-1 token wherever bf16's error cannot flip it, at batch 1,
    3 and 5 (one shape
    compiled for 2..max_bs rows), within eager's own distance of the fp32 logits. Batches over max_bs rows and
    prefills run eagerly; nothing is sent back to eager for want of a compile."""
    truth_engine = Engine(EngineConfig(max_total_tokens=2048, dtype="float32", quantization="int4",
                                       torch_compile="off"))
    engine = Engine(EngineConfig(max_total_tokens=2048, torch_compile="on"))
    compiled = engine.compiled
    assert compiled is not None and engine.quantization == "int4"
    assert engine.compiling and not compiled.can_run(_decode(engine, [(0, torch.zeros(256, dtype=torch.long))]))
    assert compiled.wait(900), compiled.error
    assert not engine.compiling
    truth_rows, rows = _prefill(truth_engine, 5), _prefill(engine, 5)
    decided = 0
    for n in (1, 3, 5):
        truth = truth_engine.forward(_decode(truth_engine, truth_rows[:n])).float()
        batch = _decode(engine, rows[:n])
        with torch.inference_mode():
            engine.attn.prepare(batch)
            eager = engine.model.logits(engine.model(batch, engine.attn)).float()
        steps = compiled.steps
        got = engine.forward(_decode(engine, rows[:n])).float()
        assert compiled.steps == steps + 1  # it ran compiled
        assert (got - truth).abs().max() <= 1.25 * (eager - truth).abs().max()
        # The top-1 token wherever bf16's own error cannot flip it (a near tie in fp32 is not decidable in bf16).
        top2 = truth.topk(2, dim=-1)
        moved = (eager - truth).abs().gather(-1, top2.indices).amax(dim=-1)  # how far bf16 moved the two leaders
        sure = top2.values[:, 0] - top2.values[:, 1] > 2 * moved
        decided += int(sure.sum())
        for out in (got, eager):
            assert torch.equal(out.argmax(-1)[sure], truth.argmax(-1)[sure])
        assert not torch.equal(got, eager)  # it is another program (fused, fp32 inside), not eager again
    assert decided > 0  # the top-1 check above is not empty
    assert compiled.declined == 0
    assert not compiled.can_run(_decode(engine, [rows[0]] * (compiled.max_bs + 1)))
    assert not compiled.can_run(ForwardBatch.build("extend", [1, 2], [rows[0][0]], [0], [2], [0, 0], "cpu",
                                                   engine.host))


@pytest.mark.slow
def test_llm_decodes_through_the_compiled_step():
    """Through the scheduler (the Python API): once compiled (stats say when), greedy generation runs the
    compiled step and says what the exact mode says to a plain question."""
    import time

    from minisgl_cli import LLM, SamplingParams

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with LLM(torch_compile="on") as llm:
        deadline = time.monotonic() + 900
        while llm.client.stats().decode_compiling and time.monotonic() < deadline:
            time.sleep(0.5)
        assert llm.client.stats().decode_compiling == 0
        ids = llm.client.tokenizer.apply_chat_template(messages)
        out = llm.generate([ids] * 3, SamplingParams(max_new_tokens=16))
    assert all("Paris" in o.text for o in out)


@pytest.mark.slow
def test_serve_answers_while_compiling_and_stops_at_once(default_model_dir, tmp_path, monkeypatch):
    """`minisgl serve` on the default model compiles its decode once it serves (auto, in the scheduler process):
    healthy before the compile, /metrics says it is compiling, requests answer eagerly meanwhile, and a Ctrl-C
    mid-compile stops every process within seconds."""
    monkeypatch.setenv("MINISGL_TORCH_COMPILE", "auto")  # the suite's default is off (conftest)
    s = Serve(default_model_dir, tmp_path)
    try:
        s.wait_healthy()
        assert httpx.get(f"{s.url}/metrics", timeout=10).json()["scheduler"]["decode_compiling"] == 1
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
            "temperature": 0})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
        pids = list(s.children().values())
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(15) == 0, s.stderr()
        assert time.monotonic() - t0 < 6, s.stderr()
        assert gone(pids, 1) == []
    finally:
        s.stop()
