"""env.py: every environment variable minisgl reads, one boolean parser for all of them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from minisgl_cli import env


@pytest.mark.parametrize("raw, want", [("1", True), ("TRUE", True), ("yes", True), (" on ", True),
                                       ("0", False), ("false", False), ("No", False), ("off", False), ("", False)])
def test_boolean_variables_share_one_parser(monkeypatch, raw, want):
    for name in ("MINISGL_DISABLE_OVERLAP_SCHEDULING", "MINISGL_DISABLE_PDL", "HF_HUB_OFFLINE", "BENCH_MIXED_PROMPTS"):
        monkeypatch.setenv(name, raw)
    got = (env.disable_overlap_scheduling(), env.disable_pdl(), env.hub_offline(), env.bench_mixed_prompts())
    assert got == (want,) * 4


def test_unset_variables_take_their_default_and_unclear_ones_are_refused_by_name(monkeypatch):
    monkeypatch.delenv("BENCH_MIXED_PROMPTS", raising=False)
    monkeypatch.delenv("MINISGL_DISABLE_FUSED_OPS", raising=False)
    assert env.bench_mixed_prompts() is True and env.disable_fused_ops() is False
    monkeypatch.setenv("MINISGL_DISABLE_FUSED_OPS", "2")
    with pytest.raises(ValueError, match="MINISGL_DISABLE_FUSED_OPS='2' is not a boolean"):
        env.disable_fused_ops()
    monkeypatch.setenv("BENCH_CONCURRENCY", "1, 4 16")
    assert env.bench_concurrency() == [1, 4, 16]


def test_the_openmp_wait_policy_is_the_users():
    """minisgl_cli leaves OMP_WAIT_POLICY to the user: libgomp's own default (spin a while at a barrier) is 2x faster
    a token on a machine of one's own, PASSIVE where other busy processes share the cores (docs/benchmarks.md)."""
    code = "import os, minisgl_cli, torch; print(os.environ.get('OMP_WAIT_POLICY', 'unset'))"
    for given, want in ((None, "unset"), ("PASSIVE", "PASSIVE")):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | (
            {"OMP_WAIT_POLICY": given} if given else {})
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want


def test_temp_dir_blocks_in_two_threads_leave_tmpdir_as_it_was(monkeypatch, tmp_path):
    """Two compiled steps loading at once (an engine starting while another's watcher loads) each set TMPDIR for
    their unpack: the later block to end must not put back the earlier one's removed dir."""
    import threading
    import time

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    first_in = threading.Event()

    def block(name: str, hold: float, signal: bool) -> None:
        with env.temp_dir(tmp_path / name):
            if signal:
                first_in.set()
            time.sleep(hold)

    a = threading.Thread(target=block, args=("a", 0.2, True))
    a.start()
    first_in.wait(5)
    b = threading.Thread(target=block, args=("b", 0.4, False))  # would end last, restoring a's dir, were they let in
    b.start()
    a.join()
    b.join()
    assert os.environ["TMPDIR"] == str(tmp_path)
