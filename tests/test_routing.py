"""The routing policies on scripted loads: which replica each mode picks, caps, replicas going out and back,
and cache_aware's prefix tree (pure Python: no engine)."""

from __future__ import annotations

import pytest

from minisgl_cli.dispatch import Busy, Dispatcher, NoReplica, PrefixTree
from minisgl_cli.router.app import routing_key

A = list(range(1000, 1100))  # two "system prompts" of 100 token ids each
B = list(range(2000, 2100))


def picks(router: Dispatcher, keys: list, finish: bool = True) -> list[int]:
    out = []
    for key in keys:
        i = router.pick(key)
        out.append(i)
        if finish:
            router.done(i)
    return out


def test_rr_rotates_and_skips_a_replica_that_is_out():
    r = Dispatcher(3, "rr")
    assert picks(r, [None] * 4) == [0, 1, 2, 0]
    r.set_up(1, False)
    assert picks(r, [None] * 3) == [2, 0, 2]
    r.set_up(1, True)
    assert picks(r, [None] * 3) == [0, 1, 2]


def test_fsfs_takes_the_first_replica_with_a_free_slot():
    r = Dispatcher(2, "fsfs", capacity=[2, 2])
    assert picks(r, [None] * 4, finish=False) == [0, 0, 1, 1]
    assert r.pick() == 0  # none free: the least loaded (a tie: the first)
    r.done(1)
    assert r.pick() == 1  # replica 0 holds 3 > its 2 slots; 1 has room again
    assert r.load == [3, 2]


def test_random_spreads_over_the_replicas_that_are_up_and_repeats_with_a_seed():
    r = Dispatcher(3, "random", seed=7)
    r.set_up(2, False)
    got = picks(r, [None] * 40)
    assert set(got) == {0, 1} and 10 < got.count(0) < 30
    assert picks(Dispatcher(3, "random", seed=7), [None] * 10) == picks(Dispatcher(3, "random", seed=7), [None] * 10)


def test_cache_aware_sends_a_shared_prefix_back_to_its_replica():
    r = Dispatcher(2, "cache_aware")
    # A new prompt goes where the tree is smallest; a prompt sharing > 30% of a routed one follows it.
    assert picks(r, [A + [1], B + [2], A + [3], B + [4], B + [5], A + [6]]) == [0, 1, 0, 1, 1, 0]
    assert r.routed == [3, 3]
    assert picks(r, [[7, 8, 9]]) == [0]  # nothing in common: the smaller tree (a tie here: the first)
    assert r.tree.match(A + [3]) == {0: 101, 1: 0}


def test_cache_aware_leaves_a_replica_whose_load_exceeds_the_least_loaded_by_the_threshold():
    r = Dispatcher(2, "cache_aware", balance_abs=2, balance_rel=1.5)
    # A's replica keeps A while it is at most 2 requests busier than the other; then the least loaded takes it.
    assert picks(r, [A] * 4, finish=False) == [0, 0, 0, 1]


def test_cache_aware_forgets_a_replica_that_goes_out():
    r = Dispatcher(2, "cache_aware")
    assert picks(r, [A, B]) == [0, 1]
    r.set_up(0, False)
    assert r.tree.match(A) == {1: 0}
    r.set_up(0, True)
    assert picks(r, [A]) == [0]  # back with an empty tree: the smallest


def test_cap_per_replica_then_busy_and_no_replica():
    r = Dispatcher(2, "rr", cap=1)
    assert picks(r, [None, None], finish=False) == [0, 1]
    with pytest.raises(Busy, match="server busy"):
        r.pick()
    r.done(1)
    assert r.pick() == 1
    with pytest.raises(NoReplica):
        r.pick(exclude=[0, 1])
    r.set_up(0, False)
    r.set_up(1, False)
    with pytest.raises(NoReplica):
        r.pick()


def test_prefix_tree_matches_per_tenant_and_evicts_least_recently_used_leaves():
    t = PrefixTree()
    t.insert("system: be brief\nuser: hi", 0)
    t.insert("system: be brief\nuser: bye", 1)
    t.insert("system: be verbose", 1)
    assert t.match("system: be brief\nuser: hello") == {0: 24, 1: 23}
    assert t.size(0) == len("system: be brief\nuser: hi")
    t.insert([1, 2, 3, 4], 2)
    t.insert([1, 2, 9], 2)
    t.insert([1, 2, 3, 5], 2, limit=5)  # 6 items over a limit of 5: the least recently used leaf ([4]) goes
    assert t.size(2) == 5
    assert t.match([1, 2, 3, 4])[2] == 3 and t.match([1, 2, 9])[2] == 3 and t.match([1, 2, 3, 5])[2] == 4
    t.remove(1)
    assert t.match("system: be verbose") == {0: 11, 2: 0}


def test_router_keys_come_from_messages_prompts_or_token_ids():
    assert routing_key(b'{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": '
                       b'[{"type": "text", "text": "Q"}]}]}') == "system\nS\nuser\nQ\n"
    assert routing_key(b'{"prompt": "hello"}') == "hello"
    assert routing_key(b'{"prompt": ["first", "second"]}') == "first"
    assert routing_key(b'{"prompt": [1, 2, 3]}') == (1, 2, 3)
    assert routing_key(b'{"input_ids": [4, 5]}') == (4, 5)
    assert routing_key(b"not json") is None and routing_key(b'{"model": "x"}') is None


@pytest.mark.parametrize("args, message", [
    (["serve", "--dp", "2", "--runtime", "in-process"], "--dp"),
    (["serve", "--dp", "2", "--nnodes", "2", "--tp", "2"], "minisgl router"),
    (["serve", "--scheduler-mode", "fastest"], "--dispatch must be one of rr, fsfs, random, cache_aware"),
    (["router", "--worker-url", "http://127.0.0.1:1", "--scheduler-mode", "x"], "--dispatch must be"),
    (["router"], "--worker-url"),
    (["router", "--worker-url", "http://127.0.0.1:1", "--processes", "3", "--max-inflight-per-engine", "2"],
     "--processes 3 cannot split a cap of 2"),
])
def test_bad_data_parallel_flags_are_usage_errors(args, message):
    from typer.testing import CliRunner

    from minisgl_cli.app import app

    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2 and message in result.output, result.output


def test_router_refuses_a_worker_url_that_is_not_http():
    from typer.testing import CliRunner

    from minisgl_cli.app import app

    result = CliRunner().invoke(app, ["router", "--worker-url", "localhost:8000"])
    assert result.exit_code == 1 and "--worker-url must be http://HOST:PORT" in result.output, result.output


def test_router_totals_leave_out_workers_without_a_prefix_cache():
    from minisgl_cli.router.app import _prometheus, _total

    def worker(url: str, hit: int | None, miss: int | None) -> dict:
        rate = None if hit is None or miss is None else hit / (hit + miss)
        return {"url": url, "alive": True, "requests": 1, "inflight": 0, "cache_hit_rate": rate,
                "scheduler": {"cache_hit_tokens": hit, "cache_miss_tokens": miss}}

    hf = worker("http://hf:1", None, None)  # --engine hf: its figures are null, never a 0 standing in
    assert _total([hf], 0)["cache_hit_rate"] is None
    total = _total([hf, worker("http://ours:1", 30, 10)], 2)
    assert (total["cache_hit_tokens"], total["cache_hit_rate"], total["requests"]) == (30, 0.75, 2)
    prom = _prometheus([hf, worker("http://ours:1", 30, 10)])
    assert 'minisgl_router_cache_hit_rate{worker="http://ours:1"} 0.75' in prom
    assert 'cache_hit_rate{worker="http://hf:1"}' not in prom and 'worker_up{worker="http://hf:1"} 1' in prom


def test_router_processes_split_the_caps_and_auto_keeps_cache_aware_in_one():
    from minisgl_cli.router.processes import RouterConfig, auto_processes

    cfg = RouterConfig(("http://a:1", "http://b:1"), per_worker_cap=5, total_cap=None)
    assert [cfg.share(3, i).per_worker_cap for i in range(3)] == [2, 2, 1]  # they add up to the cap
    assert {cfg.share(3, i).total_cap for i in range(3)} == {None}
    assert auto_processes(RouterConfig(cfg.urls, mode="cache_aware")) == 1  # one tree sees every prompt
    assert auto_processes(RouterConfig(cfg.urls, total_cap=1)) == 1  # never more than the caps split over
    assert 1 <= auto_processes(RouterConfig(cfg.urls)) <= 4


def test_router_processes_figures_add_up_in_the_tally():
    from minisgl_cli.router.app import _prometheus
    from minisgl_cli.router.tally import ProcessFigures, Tally

    tally = Tally(2, 2)
    tally.claim(0)
    tally.write(1, [3, 4], [1, 0])
    tally.claim(1)  # (as the second process would: here, the same pid)
    tally.write(2, [0, 5], [0, 2])
    a, b = tally.rows()
    assert (a.requests, a.inflight, b.requests, b.load) == (7, 1, 5, (0, 2))
    assert ProcessFigures.whole([a, b]) == ProcessFigures(0, 3, (3, 9), (1, 2))  # per worker, as /metrics adds them
    prom = _prometheus([], [a, b])
    assert 'minisgl_router_process_requests_total{process="0"} 7' in prom
    assert 'minisgl_router_process_inflight{process="1"} 2' in prom


@pytest.mark.parametrize("reuse_port", [False, True])
def test_router_processes_on_a_taken_port_fail_in_one_line(reuse_port):
    """Taken by any program, even one holding it with SO_REUSEPORT (the router's own sockets would join it)."""
    import socket

    from typer.testing import CliRunner

    from minisgl_cli.app import app

    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(reuse_port))
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["router", "--worker-url", "http://127.0.0.1:1", "--processes", "2",
                                          "--port", str(port)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and lines[-1] == f"error: could not serve on 127.0.0.1:{port} (Address already " \
        "in use)", result.output
