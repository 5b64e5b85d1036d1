"""`minisgl serve` as a user runs it, as a real process with its children: start-up, signals, deaths, orphans.

Each test starts `minisgl serve --tp 2 --num-tokenizer 1` on a tiny model (CPU, gloo), so every kind of
child exists: the detokenizer, a tokenizer worker and two scheduler ranks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from serve_process import Serve, gone

from minisgl_cli.api.http_server import free_port

pytestmark = pytest.mark.slow

CHILD_KINDS = ["detokenizer", "tokenizer 0", "scheduler rank 0", "scheduler rank 1"]


@pytest.fixture
def serve(tiny_model_dirs, tmp_path):
    started: list[Serve] = []

    def start() -> Serve:
        s = Serve(tiny_model_dirs["llama"], tmp_path, "--tp", "2", "--num-tokenizer", "1",
                  "--dist-init-addr", f"127.0.0.1:{free_port()}")
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


def test_health_is_503_until_every_rank_is_ready_then_200_and_kill_9_of_the_server_leaves_no_orphan(serve):
    """One server for both (each start costs ~12 s of the suite): its start-up, then its end by kill -9."""
    s = serve()
    seen = s.wait_healthy()
    assert seen[0] == 503 and seen[-1] == 200, seen
    assert set(s.children()) == set(CHILD_KINDS)
    assert s.answers()
    tree = psutil.Process(s.proc.pid).children(recursive=True)
    s.proc.kill()
    s.proc.wait(10)
    assert gone(tree) == []


def test_a_signal_stops_every_child_within_5s(serve):
    """SIGTERM; a SIGINT sent to serve alone (not its group) runs the same handler (supervisor.stop_on_signals sets
    one event for either), and the Ctrl-C test below sends it."""
    s = serve()
    s.wait_healthy()
    pids = list(s.children().values())
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(10) == 0, s.stderr()
    assert time.monotonic() - t0 < 5 + 1  # children within 5 s; the last second is the server's own exit
    assert gone(pids, 1) == []


def test_ctrl_c_pressed_again_during_the_shutdown_still_stops_everything(serve):
    """The later signals find the shutdown under way: they neither cut it short nor leave children behind."""
    s = serve()
    s.wait_healthy()
    pids = list(s.children().values())
    for _ in range(3):
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.1)
    code = s.proc.wait(10)  # cut short, the exit used to wait forever on the children never stopped
    # A press after the shutdown ends the process at once (130); one in its last instant, once Python has put the
    # default handler back, ends it as it ends any program (-SIGINT).
    assert code in (0, 128 + signal.SIGINT, -signal.SIGINT) and "Traceback" not in s.stderr(), s.stderr()
    assert gone(pids, 1) == []


def test_a_signal_after_the_shutdown_ends_the_process_at_once():
    """What a press after serve's shutdown meets: exit 130 at once and no traceback (with the default handler
    back, it was a KeyboardInterrupt traceback from wherever the interpreter was)."""
    code = ("import os, signal, time\n"
            "from minisgl_cli.runtime.supervisor import stop_on_signals\n"
            "with stop_on_signals():\n"
            "    pass\n"
            "print('shut down', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(10)\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout == "shut down\n"
    assert done.returncode == 128 + signal.SIGINT and done.stderr == "", done.stderr
    assert time.monotonic() - t0 < 9  # at once, not after the sleep


# The detokenizer, tokenizer 0 and scheduler rank 0 are killed under load in test_serve_faults.py's dead-child test,
# which checks this line and this tree too: here the rank only TP 2 has.
@pytest.mark.parametrize("kind", ["scheduler rank 1"])
def test_a_dead_child_stops_the_server_with_one_line_naming_it(serve, kind):
    """kill -9 of a child: serve exits non-zero with one line naming it, and every process under serve is gone (its
    whole tree as psutil sees it, not only the children it named)."""
    s = serve()
    s.wait_healthy()
    children = s.children()
    tree = psutil.Process(s.proc.pid).children(recursive=True)
    assert set(children.values()) <= {p.pid for p in tree}
    os.kill(children[kind], signal.SIGKILL)
    assert s.proc.wait(30) != 0
    lines = s.stderr().strip().splitlines()
    after = lines[next(i for i, line in enumerate(lines) if line.startswith("minisgl: serving ")) + 1:]
    assert len(after) == 1, lines
    assert after[0].startswith("error: ") and f"{kind} (pid {children[kind]}) exited with code -9" in after[0], lines
    assert gone(tree) == []


@pytest.mark.slow
def test_the_log_at_the_default_level_says_what_happens_and_a_sigterm_ends_it_cleanly(default_built_step, tmp_path):
    """`minisgl serve` of the default model as a newcomer runs it, on an empty store of compiled steps (conftest's
    default_built_step): plain `minisgl: ...` lines for the start, the ready line (not a WARNING), the compiled CPU
    decode's build (how long, what speed until then) and its end; a SIGTERM after requests adds the shutdown line and
    nothing else (no Python warnings). The second start loads the stored step before it answers /health: compiled
    from the first request."""
    lines = default_built_step.lines
    assert all(line.startswith("minisgl: ") for line in lines), lines
    assert any("compiled CPU decode build" in line and "slower" in line for line in lines), lines
    ready = next(i for i, line in enumerate(lines) if line.startswith("minisgl: serving "))
    assert f"at {default_built_step.url} (OpenAI API at /v1)" in lines[ready]
    # The build's lines come from the scheduler process: its start may print after the API's ready line.
    after = [line for line in lines[ready + 1:] if "the compiled step is built" not in line
             and "compiled CPU decode build" not in line]
    assert after == ["minisgl: stopping"], lines

    again = Serve("smollm2-135m-instruct", tmp_path, "--torch-compile", "auto",
                  env={"MINISGL_COMPILED_DIR": str(default_built_step.store)})
    try:
        again.wait_healthy()
        assert httpx.get(f"{again.url}/metrics", timeout=10).json()["scheduler"]["decode_step"] == "compiled"
        assert again.answers()
    finally:
        again.stop()
    assert "CPU decode: the compiled step, loaded from" in again.stderr()
    assert "compiled CPU decode build" not in again.stderr(), again.stderr()
