"""Where the Python API's and the offline bench's engine runs: in this process or as the multi-process runtime
(runtime/start.py), with real child processes and the real default model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import psutil
import pytest
from serve_process import gone

from minisgl_cli import LLM, SamplingParams

PROMPTS = ["The capital of France is", [{"role": "user", "content": "Name three colors."}], "def fib(n):",
           [{"role": "user", "content": "Count from one to five."}]]


def _children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


@pytest.mark.slow
def test_llm_as_processes_gives_the_greedy_answers_of_llm_in_process_and_closing_leaves_no_child(default_model_dir):
    """One runtime for both facts (each start of the default model's processes costs ~8 s of the suite); with a
    tokenizer worker, so every kind of child is there to answer and to stop. (Without one, as by default: the
    server tests' shared engine and the left-open test below.)"""
    params = [SamplingParams(max_new_tokens=12 + 4 * i) for i in range(len(PROMPTS))]
    with LLM(str(default_model_dir)) as here:
        want = here.generate(PROMPTS, params)
    before = set(_children())
    apart = LLM(str(default_model_dir), processes=True, num_tokenizer=1)
    started = [p for p in _children() if p not in before and not _resource_tracker(p)]
    try:
        assert {p.name for p in apart.client.runtime.procs.values()} == {"minisgl detokenizer", "minisgl tokenizer 0",
                                                                          "minisgl scheduler rank 0"}
        assert len(started) == 3  # those three, and nothing else
        got = apart.generate(PROMPTS, params)
    finally:
        apart.close()
    assert gone(started) == []
    apart.close()  # a second close does nothing
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.text for c in got] == [c.text for c in want]


def _resource_tracker(p: psutil.Process) -> bool:
    """multiprocessing's resource tracker: one per process that ever spawned, by design alive until it exits."""
    return "resource_tracker" in " ".join(p.cmdline())


@pytest.mark.slow
def test_an_llm_left_open_is_stopped_at_exit_with_its_children(default_model_dir):
    """A script that never calls close(): it exits at once (multiprocessing's exit hook would otherwise wait for ever
    on the children) and leaves no child behind."""
    script = textwrap.dedent(f"""
        import os
        from minisgl_cli import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM({str(default_model_dir)!r}, processes=True)
            llm.generate("Hi", SamplingParams(max_new_tokens=2))
            print(" ".join(str(p.pid) for p in llm.client.runtime.procs.values()), flush=True)
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2 and gone(pids, timeout=10) == []


def test_an_unknown_or_contradictory_llm_option_is_refused_before_anything_loads():
    with pytest.raises(TypeError, match=r"unknown options: tp_sise \(did you mean tp_size\?\)"):
        LLM(tp_sise=2)
    with pytest.raises(TypeError, match="processes=True / False / None"):
        LLM(mode="processes")
    with pytest.raises(TypeError, match="takes True, False or None"):
        LLM(processes="yes")
    with pytest.raises(ValueError, match="tp_size, dp_size and nnodes > 1 need processes=True"):
        LLM(processes=False, tp_size=2)
    with pytest.raises(ValueError, match="num_tokenizer configure the multi-process runtime"):
        LLM(num_tokenizer=2)
    with pytest.raises(ValueError, match="engine='hf' runs in this process"):
        LLM(engine="hf", processes=True)


@pytest.mark.slow
def test_offline_bench_runs_our_engine_as_processes_by_default(tmp_path):
    from typer.testing import CliRunner

    from minisgl_cli.app import app

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--repeat", "1", "--warmup", "0", "--max-new-tokens", "4",
                                      "--num-prompts", "2", "--case", "short", "--no-baseline", "--num-tokenizer", "1",
                                      "--output-json", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    (r,) = json.loads(out.read_text())["results"]
    assert r["completed"] == 2 and r["failed"] == 0
    assert r["client_procs"] == 1  # the bench measured its own process apart from the engine's
