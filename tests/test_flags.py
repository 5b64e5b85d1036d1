"""A flag is implemented or refused: a combination in which a flag would change nothing is a usage error, one line
and exit 2, before any model loads (issue 27)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from commands.common import ALL, EngineOptions, engine_options
from minisgl_cli.app import app

REFUSED = [
    # Our engine's options under the serial engines, which run one request at a time on their own KV cache.
    (["serve", "--engine", "hf", "--kv-cache-dtype", "bf16", "--torch-compile", "on"],
     "--engine hf runs in this process", "drop --kv-cache-dtype, --torch-compile (they configure the torch engine)"),
    (["serve", "--engine", "hf", "--deterministic"], "--engine hf", "drop --deterministic"),
    (["bench", "--engine", "hf", "--quantization", "int8"], "--engine hf", "drop --quantization"),
    (["smoke", "--engine", "hf", "--dist-init-addr", "127.0.0.1:1"], "--engine hf", "drop --dist-init-addr"),
    (["serve", "--engine", "mlx", "--num-tokenizer", "1"], "--engine mlx", "drop --num-tokenizer"),
    # The multi-process runtime's options where the engine runs in this process.
    (["chat", "--num-tokenizer", "2"], "drop --num-tokenizer or add --runtime processes",
     "this command's default for --runtime auto"),
    (["smoke", "--num-tokenizer", "1"], "drop --num-tokenizer", "runs in this process"),
    (["bench", "--runtime", "in-process", "--num-tokenizer", "1"], "drop --num-tokenizer", "(--runtime in-process)"),
    (["serve", "--runtime", "in-process", "--num-tokenizer", "1"], "drop --num-tokenizer",
     "(--runtime in-process)"),
    # A rendezvous address with no ranks to meet there.
    (["serve", "--dist-init-addr", "127.0.0.1:29999"], "--dist-init-addr is where the --tp ranks meet",
     "--tp 1 has one rank"),
    (["chat", "--dist-init-addr", "127.0.0.1:29999"], "--dist-init-addr", "--tp 1 has one rank"),
    # ... and several hosts without one: no port on this host's loopback is theirs to meet at.
    (["serve", "--tp", "2", "--nnodes", "2"], "--nnodes > 1 needs --dist-init-addr", "which every node reaches"),
    # bench: the options of the engine it would load here against a server, and a server's options without one.
    (["bench", "--url", "http://127.0.0.1:9", "--tp", "2", "--kv-cache-dtype", "bf16", "--cache", "naive",
      "--peer", "llama-cpp"], "--url benchmarks a running server", "drop --kv-cache-dtype, --tp, --cache, --peer"),
    (["bench", "--url", "http://127.0.0.1:9", "--engine", "hf"], "--url benchmarks", "drop --engine"),
    (["bench", "--api", "chat", "--request-rate", "4"], "drop --api, --request-rate or add --url", "a server"),
    (["bench", "--served-model-name", "m"], "drop --served-model-name or add --url", "a server"),
    # Speculative decoding's knobs without the algorithm they configure, and speculation on a serial engine.
    (["chat", "--num-speculative-tokens", "5"], "drop --num-speculative-tokens or use --speculative-algorithm "
     "ngram or draft", "(speculative decoding is off)"),
    (["serve", "--speculative-algorithm", "draft", "--speculative-draft-model", "smollm2", "--prompt-lookup-max",
      "4"], "drop --prompt-lookup-max or use --speculative-algorithm ngram", "(draft does not use them)"),
    (["serve", "--engine", "hf", "--speculative-algorithm", "ngram"], "--engine hf", "drop --speculative-algorithm"),
]


@pytest.mark.parametrize("args,first,second", REFUSED, ids=[" ".join(r[0]) for r in REFUSED])
def test_a_flag_that_would_change_nothing_is_refused_in_one_line(args, first, second):
    result = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert first in lines[0] and second in lines[0], lines[0]


def _options(args: list[str], processes: bool = False) -> EngineOptions | str:
    """The EngineOptions a command offering every engine option gets (`processes`: its --runtime auto runs the
    multi-process runtime, as serve's does), or its one-line refusal."""
    probe, seen = typer.Typer(), []

    @probe.command()
    @engine_options(ALL, processes=processes)
    def run(*, opts: EngineOptions) -> None:
        seen.append(opts)

    result = CliRunner().invoke(probe, args, env={"COLUMNS": "300"})
    return seen[0] if result.exit_code == 0 and seen else result.output


def test_the_same_flags_are_taken_where_they_do_something():
    opts = _options(["--num-tokenizer", "2"], processes=True)
    assert isinstance(opts, EngineOptions) and opts.runtime.num_tokenizer == 2
    assert isinstance(_options(["--num-tokenizer", "2", "--runtime", "processes"]), EngineOptions)
    assert isinstance(_options(["--num-tokenizer", "1", "--tp", "2"]), EngineOptions)  # auto: processes for --tp 2
    opts = _options(["--tp", "2", "--dist-init-addr", "127.0.0.1:29999"])
    assert isinstance(opts, EngineOptions) and opts.runtime.dist_init_addr == "127.0.0.1:29999"
    assert isinstance(_options(["--kv-cache-dtype", "bf16", "--torch-compile", "off"]), EngineOptions)
    opts = _options(["--engine", "hf", "--dtype", "float32", "--device", "cpu", "--runtime", "in-process"])
    assert isinstance(opts, EngineOptions) and opts.engine.engine == "hf"
    assert "drop --num-tokenizer" in str(_options(["--num-tokenizer", "2"]))


def test_ranks_meet_at_a_port_free_at_start_unless_told_where():
    """Without --dist-init-addr each replica's ranks meet at a loopback port nothing holds at start (two engines
    started side by side on one host once collided at the old fixed 29517); with it, at its port plus the replica."""
    import socket

    from minisgl_cli.runtime.config import RuntimeConfig

    with socket.socket() as held:  # a port in use is never the one picked
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        rt = RuntimeConfig(tp_size=2, dp_size=2)
        addrs = [rt.replica_dist(i).init_addr for i in range(2)]
    for addr in addrs:
        host, _, port = addr.rpartition(":")
        assert host == "127.0.0.1" and int(port) not in (taken, 29517)
    told = RuntimeConfig(tp_size=2, dp_size=2, dist_init_addr="10.0.0.1:29999")
    assert [told.replica_dist(i).init_addr for i in range(2)] == ["10.0.0.1:29999", "10.0.0.1:30000"]
