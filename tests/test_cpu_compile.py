"""The compiled CPU decode step (cpu_step/compiled.py): built once by a child process, stored by its key, loaded by
every later engine of that key; a package of another key is rebuilt, never loaded; its greedy answers are eager's.

The key tests build one tiny random model's step (seconds to a minute); the default model's step is built once a run
by `minisgl serve` (conftest's default_built_step) and loaded from its store."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from serve_process import Serve, gone
from test_cache_invariance import ANSWER, CHATS

from minisgl_cli import LLM
from minisgl_cli.cpu_step import build as cpu_build
from minisgl_cli.cpu_step import compiled as cpu_compile
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.engine.engine import Engine


def test_decode_step_resolves_per_device_mode_and_owner():
    """auto runs the CPU's int4 / int8 modes at TP 1 over a 16-bit KV cache: it loads a stored step in any engine and
    builds one where the engine is a scheduler process's or says compile_in_process (chat, bench); on builds in
    every engine and refuses what it cannot run; off and --deterministic decode eagerly."""
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    auto = EngineConfig(device="cpu", torch_compile="auto")
    assert auto.decode_step("int4", bf16, 1, True) == "build" and auto.decode_step("int8", bf16, 1, True) == "build"
    assert auto.decode_step("int4", bf16, 1, False) == "load"  # the Python API: a stored step, never a build
    chat = EngineConfig(device="cpu", torch_compile="auto", compile_in_process=True)
    assert chat.decode_step("int4", bf16, 1, False) == "build"
    assert auto.decode_step("none", bf16, 1, True) == "off"  # the exact mode keeps eager's numbers (HF parity)
    assert auto.decode_step("int4", bf16, 2, True) == "off"
    assert auto.decode_step("int4", fp8, 1, True) == "off"  # the FP8 KV scales are set by the first prefill
    assert EngineConfig(device="cpu", torch_compile="off").decode_step("int4", bf16, 1, True) == "off"
    assert EngineConfig(device="cpu", torch_compile="on").decode_step("int4", bf16, 1, False) == "build"
    assert EngineConfig(device="cpu", deterministic=True).decode_step("int4", bf16, 1, True) == "off"
    for quantization, tp in (("none", 1), ("int4", 2)):
        with pytest.raises(ValueError, match="--torch-compile on runs the CPU's int4 / int8 modes at TP 1"):
            EngineConfig(device="cpu", torch_compile="on").decode_step(quantization, bf16, tp, True)
    with pytest.raises(ValueError, match="--torch-compile must be one of auto, on, off"):
        EngineConfig(torch_compile="yes")  # type: ignore[arg-type]


def test_every_part_of_the_key_names_another_package():
    key = cpu_compile.StepKey("weights", "config", "int4", "torch.bfloat16", "torch.bfloat16", "2.13.0", "cpu", "src",
                              "int4=minisgl attention=minisgl")
    paths = {key.path} | {dataclasses.replace(key, **{f.name: "other"}).path for f in dataclasses.fields(key)}
    assert len(paths) == 1 + len(dataclasses.fields(key))


def test_the_source_key_follows_the_cpu_code_not_cudas_kernels(tmp_path, monkeypatch):
    """An edit to a traced file changes StepKey.source; one to kernels/triton (CUDA only) keeps the stored steps."""
    for rel in ("kernels/cpu/a.py", "kernels/triton/b.py", "models/c.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    monkeypatch.setattr(cpu_compile, "_ROOT", tmp_path)
    monkeypatch.setattr(cpu_compile, "_TRACED", ("kernels", "models"))
    before = cpu_compile._source()
    (tmp_path / "kernels/triton/b.py").write_text("x = 2\n")
    assert cpu_compile._source() == before
    for rel in ("kernels/cpu/a.py", "models/c.py"):
        (tmp_path / rel).write_text("x = 3\n")
        assert cpu_compile._source() != before
        before = cpu_compile._source()


def test_a_build_removes_the_packages_it_supersedes_only(tmp_path, monkeypatch):
    """After a build, the same model and mode built by another minisgl source or torch goes; another model's stays."""
    monkeypatch.setenv("MINISGL_COMPILED_DIR", str(tmp_path))
    key = cpu_compile.StepKey("weights", "config", "int4", "torch.bfloat16", "torch.bfloat16", "2.13.0", "cpu", "src",
                              "int4=minisgl attention=minisgl")
    older = dataclasses.replace(key, source="older", torch_version="2.12.0")
    other = dataclasses.replace(key, weights="another model")
    aten = dataclasses.replace(key, kernels="int4=aten attention=minisgl")  # another kernel's: a mode of its own, kept
    for k in (key, older, other, aten):  # packages as AOTInductor writes their key (cpu_step/compiled.py: _stored_key)
        with zipfile.ZipFile(k.path, "w") as z:
            z.writestr("m/x.wrapper_metadata.json", json.dumps({cpu_compile._KEY: k.to_json()}))
    assert cpu_compile._stored_key(older.path) == older.to_json()
    cpu_build._prune(key, key.path)
    assert key.path.exists() and other.path.exists() and aten.path.exists() and not older.path.exists()


def _tiny(model_dir, seed: int) -> EngineConfig:
    """The tiny random Llama's config as int4 dummy weights of `seed` (the seed is the weights' key)."""
    return EngineConfig(model=str(model_dir), load_format="dummy", seed=seed, quantization="int4",
                        torch_compile="on", max_total_tokens=512)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    """The tiny model's compiled-step store (not the shared one)."""
    return tmp_path_factory.mktemp("compiled")


@pytest.fixture
def store(store_dir, monkeypatch):
    monkeypatch.setenv("MINISGL_COMPILED_DIR", str(store_dir))
    return store_dir


@pytest.fixture(scope="module")
def tiny_step(store_dir, tiny_model_dirs) -> cpu_compile.StepKey:
    """The tiny Llama's step (seed 1), built once into the store."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINISGL_COMPILED_DIR", str(store_dir))
        engine = Engine(_tiny(tiny_model_dirs["llama"], 1))
    assert engine.compiled is not None and engine.decode_step == "building"
    assert engine.compiled.wait(900), engine.compiled.error
    assert engine.compiled.path.exists() and engine.decode_step == "compiled"
    return engine.compiled.key


def _prefill(engine: Engine, n: int) -> list[tuple[int, torch.Tensor]]:
    """n requests of 100 prompt tokens each in the pool: (req slot, its KV slots)."""
    pool, rows = engine.pool, []
    for r in range(n):
        row = pool.alloc_req_row()
        pages = pool.alloc_pages(101)
        assert row is not None and pages is not None
        slots = pool.slots_of_pages(pages)[:101]
        pool.page_table[row, :101] = slots.to(torch.int32)
        engine.forward(ForwardBatch.build("prefill", list(range(1000 + 7 * r, 1100 + 7 * r)), [row], [0], [100],
                                          slots[:100], engine.device, engine.host))
        rows.append((row, slots))
    return rows


def _decode(engine: Engine, rows: list[tuple[int, torch.Tensor]]) -> ForwardBatch:
    n = len(rows)
    return ForwardBatch.build("decode", [5] * n, [r for r, _ in rows], [100] * n, [1] * n,
                              [int(s[100]) for _, s in rows], engine.device, engine.host)


def _unpacked() -> set[str]:
    """The package copies in the temp dir: AOTInductor's loader's own (aotinductor_*) and whatever is in ours (a
    process's minisgl-unpack-<pid> stays while it lives, emptied after each load)."""
    tmp = Path(tempfile.gettempdir())
    return {str(p.relative_to(tmp)) for p in [*tmp.glob("aotinductor_*"), *tmp.glob("minisgl-unpack-*/*")]}


@pytest.mark.slow
def test_a_later_engine_loads_the_stored_step_and_decodes_as_eager(tiny_step, store, tiny_model_dirs):
    """A second engine of the same key loads the package at construction (no build process), and its decode gives a
    row the eager step's hidden state whatever the rows beside it. The package's unpacked copy is gone once loaded
    (a process that ends without destroying the loader, killed say, left ~130 MB in /tmp each start)."""
    before = _unpacked()
    engine = Engine(_tiny(tiny_model_dirs["llama"], 1))
    assert _unpacked() <= before
    compiled = engine.compiled
    assert compiled is not None and engine.decode_step == "compiled" and not engine.compiling
    engine.start_serving()
    assert compiled._proc is None  # nothing built
    rows = _prefill(engine, 3)
    with torch.inference_mode():
        alone = [compiled.run(_decode(engine, [r])) for r in rows]
        together = compiled.run(_decode(engine, rows))
        batch = _decode(engine, rows)
        engine.attn.prepare(batch)
        eager = engine.model(batch, engine.attn)
    assert all(h is not None for h in alone) and together is not None
    assert torch.equal(torch.cat(alone), together)  # type: ignore[arg-type]
    assert torch.equal(together, eager)
    assert compiled.steps == 4 and compiled.declined == 0
    assert not compiled.can_run(ForwardBatch.build("prefill", [1, 2], [rows[0][0]], [0], [2], [0, 0], "cpu",
                                                   engine.host))


@pytest.mark.slow
def test_a_package_of_another_key_is_rebuilt_never_loaded(tiny_step, store, tiny_model_dirs):
    """The seed-1 package under the seed-2 engine's name: refused (and removed) at construction, then rebuilt with
    the seed-2 weights."""
    cfg = _tiny(tiny_model_dirs["llama"], 2)
    other = Engine(dataclasses.replace(cfg, torch_compile="off"))
    key = cpu_compile.StepKey.of(cfg, other.model_cfg, other.spec.model_dir, other.loaded.source, other.dtype,
                                 other.kv_dtype, other.quantization)
    assert key.path != tiny_step.path
    shutil.copy(tiny_step.path, key.path)
    engine = Engine(cfg)
    assert engine.compiled is not None and engine.decode_step == "building"  # not loaded
    assert not key.path.exists()
    assert engine.compiled.wait(900), engine.compiled.error
    assert cpu_compile._stored_key(key.path) == key.to_json()
    rows = _prefill(engine, 1)
    with torch.inference_mode():
        compiled = engine.compiled.run(_decode(engine, rows))
        batch = _decode(engine, rows)
        engine.attn.prepare(batch)
        assert torch.equal(compiled, engine.model(batch, engine.attn))  # the seed-2 weights, not seed 1's


@pytest.mark.slow
def test_compiled_greedy_answers_equal_eager_on_the_parity_prompts(default_built_step, monkeypatch):
    """The default model (int4 GGUF) through the step `minisgl serve` stored (conftest's default_built_step; a
    prebuild finds it there and builds nothing): the parity prompts' greedy tokens equal the eager step's, one at a
    time and all in one batch."""
    monkeypatch.setenv("MINISGL_COMPILED_DIR", str(default_built_step.store))
    stored = {p: p.stat().st_mtime_ns for p in default_built_step.store.glob("*.pt2")}
    assert len(stored) == 1
    assert cpu_build.prebuild(EngineConfig(torch_compile="auto")) in stored
    assert {p: p.stat().st_mtime_ns for p in default_built_step.store.glob("*.pt2")} == stored
    answers = {}
    for mode in ("off", "auto"):
        with LLM(torch_compile=mode, cache="naive") as llm:
            assert llm.client.stats().decode_compiled == (mode == "auto")  # loaded, not built
            assert llm.client.stats().decode_compiling == 0
            answers[mode] = ([llm.generate(chat, ANSWER)[0].token_ids for chat in CHATS],
                             [o.token_ids for o in llm.generate(CHATS, [ANSWER] * len(CHATS))])
    assert answers["auto"] == answers["off"]


@pytest.mark.slow
def test_serve_answers_while_building_and_stops_at_once(default_model_dir, tmp_path):
    """`minisgl serve` on the default model with an empty store builds its step once it serves: healthy before the
    build, /metrics says it is building, requests answer eagerly meanwhile, and a Ctrl-C mid-build stops every
    process of the server within seconds; the build goes on (for the next start) until a SIGTERM stops it, which
    takes its compiler and its partial package with it."""
    s = Serve(default_model_dir, tmp_path, env={"MINISGL_TORCH_COMPILE": "auto",  # the suite's default is off
                                                "MINISGL_COMPILED_DIR": str(tmp_path / "compiled")})
    try:
        s.wait_healthy()
        scheduler = httpx.get(f"{s.url}/metrics", timeout=10).json()["scheduler"]
        assert scheduler["decode_compiling"] == 1 and scheduler["decode_compiled"] == 0
        assert scheduler["decode_step"] == "building"
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
            "temperature": 0})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"], r.text
        pids = s.children()
        builder = pids.pop("the compiled CPU decode build")
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(15) == 0, s.stderr()
        assert time.monotonic() - t0 < 6, s.stderr()
        assert gone(list(pids.values()), 5) == []
        assert gone([builder], 3) == [builder]  # the build goes on: the next start loads its step
        os.kill(builder, signal.SIGTERM)
        assert gone([builder], 10) == []
        assert list((tmp_path / "compiled").glob("*.partial.pt2")) == []
    finally:
        s.stop()


# An engine that starts serving (its scheduler's start), as a chat or a server does, then ends: argv model dir, seed.
_START = """
import sys
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.engine.engine import Engine
engine = Engine(EngineConfig(model=sys.argv[1], load_format="dummy", seed=int(sys.argv[2]), quantization="int4",
                             torch_compile="on", max_total_tokens=512))
engine.start_serving()
proc = engine.compiled._proc
print(engine.decode_step, proc.pid if proc else "none", flush=True)
"""


def _start(model_dir, seed: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _START, str(model_dir), str(seed)], stdout=subprocess.PIPE,
                            text=True)


def _leftovers(store: Path) -> list[str]:
    """What a build leaves behind besides its package and lock file: partial packages and logs (of a failure)."""
    return sorted(p.name for p in [*store.glob("*.partial.pt2"), *store.glob("*.log")])


@pytest.mark.slow
def test_one_build_per_key_outlives_its_starter_and_the_next_engine_takes_over_a_dead_one(store, tiny_model_dirs):
    """Two engines start serving at once with no step stored: one build process, no second; both end and the build
    goes on. Killed (SIGKILL: no clean-up), the next engine that waits for it starts it again; another engine waiting
    meanwhile builds nothing and decodes through the step once it is stored. A partial package a killed build left is
    gone, as is the build's log."""
    cfg = _tiny(tiny_model_dirs["llama"], 3)
    key = cpu_compile.StepKey.of(cfg, *_key_parts(cfg))
    stale = key.path.with_suffix(".4194304.partial.pt2")  # a SIGKILLed build's (its lock went with it)
    stale.write_bytes(b"PK half a package")
    starts = [_start(tiny_model_dirs["llama"], 3) for _ in range(2)]
    said = sorted((p.communicate(timeout=120)[0].split() for p in starts), key=lambda said: said[1] != "none")
    assert all(p.returncode == 0 for p in starts)
    assert [state for state, _ in said] == ["building", "building"]
    assert said[0][1] == "none" and said[1][1] != "none", said  # one started the build, the other found it
    first = int(said[1][1])
    assert gone([first], 0) == [first]  # its starter has ended
    engines = [Engine(cfg) for _ in range(2)]
    for engine in engines:
        assert engine.compiled is not None and engine.decode_step == "building"
        engine.start_serving()
        assert engine.compiled._proc is None  # the first build runs
    os.killpg(first, signal.SIGKILL)
    for engine in engines:
        assert engine.compiled is not None and engine.compiled.wait(300), engine.compiled.error
        assert engine.decode_step == "compiled"
    builders = [e.compiled._proc for e in engines if e.compiled is not None and e.compiled._proc is not None]
    assert len(builders) == 1 and builders[0].returncode == 0  # one took over; the other waited for it
    assert cpu_compile._stored_key(key.path) == key.to_json() and _leftovers(store) == []
    rows = _prefill(engines[0], 1)
    with torch.inference_mode():
        assert engines[0].compiled.run(_decode(engines[0], rows)) is not None  # type: ignore[union-attr]


@pytest.mark.parametrize("stop", ["limit", "sigterm"])
def test_a_stopped_build_ends_its_process_group_and_frees_its_key(store, tiny_model_dirs, stop):
    """A build past its time limit, or sent a SIGTERM, ends with everything it started, stores nothing, and frees its
    key's lock (the next engine builds): a build never runs on for ever."""
    cfg = _tiny(tiny_model_dirs["llama"], 5)
    key = cpu_compile.StepKey.of(cfg, *_key_parts(cfg))
    fd = cpu_compile._claim(key.path)
    assert fd is not None
    proc = cpu_compile.spawn_build(cpu_compile.BuildJob(cfg, key, key.path, limit_s=4 if stop == "limit" else 600),
                                   fd)
    assert cpu_compile._claim(key.path) is None  # the build holds it
    if stop == "sigterm":
        deadline = time.monotonic() + 60
        while "building" not in key.path.with_suffix(".log").read_text():  # its handlers are set (it says so)
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGKILL  # stop(): the whole group
    assert gone([p for p in psutil.process_iter() if _pgid(p.pid) == proc.pid], 5) == []
    fd = cpu_compile._claim(key.path)
    assert fd is not None
    os.close(fd)
    assert not key.path.exists() and list(store.glob("*.partial.pt2")) == []
    assert "stopping the build" in key.path.with_suffix(".log").read_text()


def test_torch_compile_off_builds_nothing(tmp_path, monkeypatch, tiny_model_dirs):
    """--torch-compile off (MINISGL_TORCH_COMPILE=off): no build, no lock, eager decode."""
    monkeypatch.setenv("MINISGL_COMPILED_DIR", str(tmp_path))
    engine = Engine(dataclasses.replace(_tiny(tiny_model_dirs["llama"], 6), torch_compile="off"))
    engine.start_serving()
    assert engine.compiled is None and engine.decode_step == "eager" and list(tmp_path.iterdir()) == []


def _key_parts(cfg: EngineConfig) -> tuple:
    """StepKey.of's arguments after the config, from an eager engine of `cfg`."""
    e = Engine(dataclasses.replace(cfg, torch_compile="off"))
    return e.model_cfg, e.spec.model_dir, e.loaded.source, e.dtype, e.kv_dtype, e.quantization


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_a_store_that_cannot_be_written_leaves_decode_eager(tmp_path, monkeypatch, tiny_model_dirs):
    """No lock file can be made (the store's path runs through a file; a full disk or a read-only dir alike): the
    engine serves, eagerly, and says why; nothing is started."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MINISGL_COMPILED_DIR", str(tmp_path / "file" / "compiled"))
    engine = Engine(_tiny(tiny_model_dirs["llama"], 7))
    engine.start_serving()
    assert engine.compiled is not None and engine.compiled._proc is None
    assert engine.decode_step == "eager" and "could not start" in str(engine.compiled.error)


def test_the_unpack_dir_is_this_processs_and_a_dead_ones_is_swept(monkeypatch):
    """The loader unpacks into <temp>/minisgl-unpack-<pid>, which stays while the process lives (a child that
    inherited TMPDIR naming it during a load keeps a temp dir that exists); a killed process's is removed."""
    from minisgl_cli.cpu_step import compiled

    proc = subprocess.Popen(["true"])
    proc.wait()  # a pid no process has now
    dead = Path(tempfile.gettempdir()) / f"minisgl-unpack-{proc.pid}"
    dead.mkdir(exist_ok=True)
    (dead / "left.so").write_bytes(b"x")
    monkeypatch.setattr(compiled, "_UNPACK", None)
    mine = compiled._unpack_dir()
    assert mine.name == f"minisgl-unpack-{os.getpid()}" and mine.is_dir()
    assert not dead.exists()
    assert compiled._unpack_dir() == mine
