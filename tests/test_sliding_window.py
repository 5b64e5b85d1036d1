"""Sliding-window attention and attention sinks: greedy ids equal transformers fp32 token for token on tiny random
Mistral (a window on every layer), Gemma 3 (five local layers to one global), Gemma 4 (local and global layers of
different head shapes, K = V, shared KV, per-layer inputs) and gpt-oss (alternating windowed and
full layers, sinks, biased experts) -- prompts longer than the window, decode crossing it, a chunked prefill
cutting inside a window, the prompts cached, a long prefix shared -- and each feature switched off in turn makes
the answers differ (the test can tell them apart). KV memory that follows the window: an all-windowed model gives
its pages back behind the window; a mixed one (Gemma 3, gpt-oss) keeps its sliding layers' KV in window pages that
follow the window, with the prefix cache exact, and Gemma-3-12B at 32k tokens holds under a quarter of the KV every
layer keeping every token would (the engine's own accounting)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest
import torch
from conftest import make_tiny_checkpoint
from test_hf_parity import EXACT, cold_and_cached, hf_greedy

from minisgl_cli import LLM, SamplingParams
from minisgl_cli.types import SchedulerStats
from tests.triton_interp import INTERPRET, patch_interpreter

WINDOW = 8
N_NEW = 24


def _prompts() -> list[list[int]]:
    """Prompts shorter and longer than the window, and three sharing a long prefix (past two windows)."""
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 13, 29, 50)]
    prefix = torch.randint(3, 49152, (21,), generator=g).tolist()
    return ids + [prefix + torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 6, 11)]


def _ours(model_dir, prompts: list[list[int]], backend: str = "torch", n: int = N_NEW,
          **kw) -> tuple[list[list[int]], list[list[int]]]:
    """(cold, cached); the prompts' 12-token chunks end inside a window."""
    return cold_and_cached(model_dir, prompts, n, backend, **kw)


@pytest.fixture(scope="module")
def windowed_dirs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("windowed")
    return {
        "mistral": make_tiny_checkpoint("mistral", root / "mistral", tokenizer_dir, sliding_window=WINDOW),
        # six layers: five local (window 8, RoPE base 10k) and one global (1M), query_pre_attn_scalar unlike head_dim
        "gemma3": make_tiny_checkpoint("gemma3", root / "gemma3", tokenizer_dir, sliding_window=WINDOW,
                                       num_hidden_layers=6, query_pre_attn_scalar=24, final_logit_softcapping=30.0),
        # layers 0 and 2 windowed, 1 and 3 full; 4 experts, 2 per token; YaRN over a short original context
        "gpt_oss": make_tiny_checkpoint("gpt_oss", root / "gpt_oss", tokenizer_dir, sliding_window=WINDOW,
                                        num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2,
                                        intermediate_size=32, swiglu_limit=1.5,
                                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                         "original_max_position_embeddings": 16}),
        "gemma4": make_tiny_checkpoint("gemma4", root / "gemma4", tokenizer_dir, **GEMMA4),
    }


# Gemma 4 with each of its own mechanisms on: local layers (window 8, 2 KV heads of 16) and global ones (1 KV head of
# 32, K = V, proportional RoPE turning a quarter of the pairs), the last two layers reading layers 3's and 2's KV
# (and their MLPs twice as wide), per-layer inputs of width 8, a final soft cap.
GEMMA4 = dict(num_hidden_layers=6, sliding_window=WINDOW, layer_types=["sliding_attention", "sliding_attention",
              "full_attention", "sliding_attention", "sliding_attention", "full_attention"],
              global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=8,
              vocab_size_per_layer_input=49152, num_kv_shared_layers=2, use_double_wide_mlp=True,
              final_logit_softcapping=30.0)


@pytest.mark.parametrize("family", ["mistral", "gemma3", "gemma4", "gpt_oss"])
def test_windowed_models_greedy_match_transformers(windowed_dirs, family):
    model_dir = windowed_dirs[family]
    prompts = _prompts()
    theirs = hf_greedy(model_dir, prompts, N_NEW)
    assert len({tuple(t) for t in theirs}) > 1, "degenerate tiny model: outputs do not depend on the prompt"
    cold, cached = _ours(model_dir, prompts)
    assert cold == theirs
    assert cached == theirs


# The same answers through the rest of the engine: overlap scheduling (forced on the CPU), speculative verify steps
# (prompt lookup: drafts as extra decode rows, each with its own window), and TP 2 (each rank its heads' sinks and its
# slice of every expert).
MODES = {"overlap": dict(overlap_on_cpu=True), "ngram": dict(speculative_algorithm="ngram", num_speculative_tokens=3),
         "tp2": dict(tp_size=2)}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", ["mistral", "gemma3", "gemma4", "gpt_oss"])
def test_windowed_models_keep_their_answers_under_overlap_speculation_and_tp(windowed_dirs, family, mode):
    model_dir = windowed_dirs[family]
    prompts = _prompts()
    cold, cached = _ours(model_dir, prompts, device="cpu", **MODES[mode])  # TP 2 over gloo, on any machine
    assert cold == cached == hf_greedy(model_dir, prompts, N_NEW)


def _switched_off(monkeypatch, feature: str) -> None:
    """Our engine with one feature ignored: `window` (every layer full), `sinks` (none), `experts` (gpt-oss's
    experts as plain SiLU-gated ones: no biases, no clamped SwiGLU), `per_layer_inputs` (Gemma 4's: none)."""
    from minisgl_cli.attention.torch_backend import TorchBackend
    from minisgl_cli.layers import moe
    from minisgl_cli.models.gemma4 import Gemma4DecoderLayer

    if feature == "per_layer_inputs":
        layer_forward = Gemma4DecoderLayer.forward
        monkeypatch.setattr(Gemma4DecoderLayer, "forward",
                            lambda self, h, per_layer, *a: layer_forward(self, h, None, *a))
        return

    if feature == "experts":
        fused = moe.fused_experts

        def plain(*args, **kw):
            return fused(*args, **{**kw, "act_fn": moe.silu_and_mul, "biases": None})

        monkeypatch.setattr(moe, "fused_experts", plain)
        return

    attend = TorchBackend.attend

    def without(self, q, k, v, layer_id, batch, window=0, sinks=None):
        if feature == "window":
            window = 0
        if feature == "sinks":
            sinks = None
        return attend(self, q, k, v, layer_id, batch, window, sinks)

    monkeypatch.setattr(TorchBackend, "attend", without)


@pytest.mark.parametrize("family,feature", [("mistral", "window"), ("gemma3", "window"), ("gemma4", "window"),
                                            ("gemma4", "per_layer_inputs"), ("gpt_oss", "window"),
                                            ("gpt_oss", "sinks"), ("gpt_oss", "experts")])
def test_each_feature_switched_off_changes_the_answers(windowed_dirs, monkeypatch, family, feature):
    """The negative control: the parity test above fails with any one of the features switched off."""
    model_dir = windowed_dirs[family]
    prompts = _prompts()
    theirs = hf_greedy(model_dir, prompts, N_NEW)
    _switched_off(monkeypatch, feature)
    cold, _ = _ours(model_dir, prompts)
    assert cold != theirs


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_are_transformers(truncate):
    """gpt-oss's RoPE (YaRN, as its built-in configs carry it): the inverse frequencies and the cos / sin factor."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from minisgl_cli.layers.rotary import _inv_freq
    from minisgl_cli.loader.configs import builtin_config

    cfg = builtin_config("gpt-oss-20b")
    scaling = {**cfg["rope_scaling"], "truncate": truncate}
    hf_cfg = transformers.GptOssConfig(head_dim=64, rope_parameters={**scaling, "rope_theta": cfg["rope_theta"]})
    theirs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours, our_factor = _inv_freq(64, cfg["rope_theta"], scaling)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert our_factor == pytest.approx(their_factor)


def test_builtin_windowed_configs_have_their_published_layer_patterns():
    from minisgl_cli.loader.configs import builtin_config
    from minisgl_cli.models import ModelConfig

    oss = ModelConfig.from_hf(builtin_config("gpt-oss-20b"))
    assert oss.layer_windows == (128, 0) * 12 and oss.attn_sinks and oss.num_experts == 32
    gemma = ModelConfig.from_hf(builtin_config("gemma-3-27b"))
    assert gemma.layer_windows == ((1024,) * 5 + (0,)) * 10 + (1024, 1024)
    assert gemma.attn_scale == 168**-0.5 and gemma.local_rope_theta == 10000.0
    g4 = ModelConfig.from_hf(builtin_config("gemma-4-31b"))
    assert g4.layer_windows == ((1024,) * 5 + (0,)) * 10 and g4.attn_scale == 1.0 and g4.attention_k_eq_v
    assert g4.layer_head_dims == ((256,) * 5 + (512,)) * 10 and g4.layer_kv_heads == ((16,) * 5 + (4,)) * 10
    assert g4.rope_scaling == {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}


def test_gemma4_dummy_weights_are_named_and_shaped_as_transformers_saves_them(windowed_dirs):
    """--load-format dummy of a Gemma 4 config: the same tensors a transformers checkpoint of it holds (so the
    built-in gemma-4-31b loads through the path real weights take)."""
    import json

    from safetensors import safe_open

    from minisgl_cli.models import ModelConfig
    from minisgl_cli.models.dummy import _shapes

    model_dir = windowed_dirs["gemma4"]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        theirs = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if k != "lm_head.weight"}
    mc = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    assert dict(_shapes(mc)) == theirs


def test_gemma4_checkpoint_wrapped_with_towers_serves_its_text_model(windowed_dirs, tmp_path):
    """A hub checkpoint (Gemma4ForConditionalGeneration: text_config, model.language_model.*, tower tensors) loads
    its language model: the same greedy ids as the text-only checkpoint."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = windowed_dirs["gemma4"]
    wrapped = tmp_path / "wrapped"
    shutil.copytree(src, wrapped)
    text = json.loads((src / "config.json").read_text())
    (wrapped / "config.json").write_text(json.dumps({"architectures": ["Gemma4ForConditionalGeneration"],
                                                     "model_type": "gemma4", "text_config": text,
                                                     "tie_word_embeddings": True}))
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    tensors["model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(wrapped / "model.safetensors"))
    prompts = _prompts()[2:4]
    assert _ours(wrapped, prompts) == _ours(src, prompts)


def test_gemma4_parts_not_built_are_refused_at_load_by_name(windowed_dirs, tmp_path):
    """Gemma 4's MoE block and its bidirectional mode are refused by name; so is FlashInfer for layers of two head
    shapes (torch and Triton run them), windowed or not."""
    import json
    import shutil

    from minisgl_cli.attention import create_backend
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.kvcache.pool import KVPool, KVShape
    from minisgl_cli.loader.errors import ModelLoadError

    src = windowed_dirs["gemma4"]
    cfg = json.loads((src / "config.json").read_text())
    for field, value, what in (("enable_moe_block", True, "MoE block"),
                               ("use_bidirectional_attention", "all", "bidirectional")):
        d = tmp_path / field
        shutil.copytree(src, d)
        (d / "config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(ModelLoadError, match=what):
            Engine(EngineConfig(model=str(d), **EXACT))
    with pytest.raises(ValueError, match="flashinfer"):
        Engine(EngineConfig(model=str(src), attention_backend="flashinfer", **EXACT))
    pool = KVPool(KVShape(2, 2, 16, torch.float32, per_layer=((2, 16), (1, 32))), 4, 1, 1, 4, "cpu")
    with pytest.raises(ValueError, match="heads of different shapes.*flashinfer"):
        create_backend("flashinfer", pool, 4, 2, 16, 1.0, "cpu")


@pytest.mark.skipif(not (INTERPRET and importlib.util.find_spec("triton") is not None),
                    reason="needs TRITON_INTERPRET=1 with triton importable (tests/test_gpu_window_attention.py)")
def test_gemma4_on_triton_under_the_interpreter_matches_transformers(windowed_dirs):
    """The CUDA path's Triton backend and kernels, run on CPU tensors by Triton's interpreter, over Gemma 4's layers of
    two head shapes (sliding: 2 KV heads of 16 in window pages; global: 1 of 32; two layers reading others' KV): a
    prompt past the window prefilled in chunks, decode across the window, then the prompt cached -- transformers'
    greedy ids. (One prompt and 8 tokens: the interpreter takes ~50 ms a program.)"""
    patch_interpreter()
    model_dir = windowed_dirs["gemma4"]
    prompts = _prompts()[2:3]  # 29 tokens: chunks of 12, 12 and 5 over a window of 8
    cold, cached = _ours(model_dir, prompts, backend="triton", n=8)
    assert cold == cached == hf_greedy(model_dir, prompts, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Triton kernels and CUDA graphs")
@pytest.mark.parametrize("family", ["mistral", "gemma3", "gemma4", "gpt_oss"])
def test_windowed_models_on_triton_and_cuda_graphs_match_transformers(windowed_dirs, family):
    """The CUDA path in the exact mode: Triton prefill / extend and decode kernels (windows, sinks; Gemma 4's layers
    of two head shapes, each shape its own split-K plan), decode replayed from CUDA graphs (every layer's window and
    sinks captured as constants), the prompts chunked and cached."""
    model_dir = windowed_dirs[family]
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    with LLM(str(model_dir), attention_backend="triton", max_prefill_tokens=12, device="cuda", **EXACT) as llm:
        cold = [r.token_ids for r in llm.generate(prompts, [params] * len(prompts))]
        cached = [r.token_ids for r in llm.generate(prompts, [params] * len(prompts))]
        llm.client.check_pages()
    theirs = hf_greedy(model_dir, prompts, N_NEW)
    assert cold == cached == theirs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gemma4_on_cuda_runs_the_triton_backend_and_matches_transformers(windowed_dirs):
    """Gemma 4's layers of two head shapes on CUDA: auto takes the Triton backend (FlashInfer is skipped for them),
    the same greedy ids as transformers, cold and cached."""
    model_dir = windowed_dirs["gemma4"]
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    with LLM(str(model_dir), max_prefill_tokens=12, device="cuda", **EXACT) as llm:
        assert llm.client.info.attention_backend == "triton"
        cold = [r.token_ids for r in llm.generate(prompts, [params] * len(prompts))]
        cached = [r.token_ids for r in llm.generate(prompts, [params] * len(prompts))]
        llm.client.check_pages()
    assert cold == cached == hf_greedy(model_dir, prompts, N_NEW)


def test_flashinfer_is_refused_for_windowed_layers_at_load_by_name(windowed_dirs):
    """What does not run yet says so when the model loads: FlashInfer for windowed / sink layers (gpt-oss's MXFP4
    experts load: tests/test_mxfp4.py)."""
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine

    with pytest.raises(ValueError, match="sliding-window or sink.*flashinfer"):
        Engine(EngineConfig(model=str(windowed_dirs["mistral"]), attention_backend="flashinfer", **EXACT))


# KV that follows the window: a model whose every layer is windowed (Mistral) gives a request's pages back once they
# fall behind the window (scheduler/cache.py), so a long generation holds its prompt and about a window of pages.
LONG = 64
MEMORY_RUNS = {"radix": dict(page_size=2), "overlap": dict(page_size=2, overlap_on_cpu=True),
               "naive-chunked": dict(cache="naive", max_prefill_tokens=12, page_size=1)}


def _held_while_generating(llm: LLM, prompt: list[int], abort_after: int = 0, every: int = 1,
                           lent: Callable[[SchedulerStats], int] | None = None) -> tuple[list[int], int]:
    """(the tokens, the most KV tokens the pool lent out at once while they came: pool minus free at each token, or
    at every `every`-th; `lent`: another figure of the stats instead)."""
    import asyncio

    from minisgl_cli.types import GenerateRequest

    async def run() -> tuple[list[int], int]:
        got: list[int] = []
        held = 0
        stream = llm.client.submit(GenerateRequest(input_ids=prompt,
                                                   params=SamplingParams(max_new_tokens=LONG, ignore_eos=True)))
        async for delta in stream:
            got.extend(delta.token_ids)
            if len(got) % every == 0:
                s = llm.client.stats()
                held = max(held, lent(s) if lent is not None else s.tokens_total - s.tokens_free)
            if abort_after and len(got) >= abort_after:
                await stream.aclose()
                break
        return got, held

    return asyncio.run(run())


@pytest.mark.parametrize("run", list(MEMORY_RUNS))
def test_all_windowed_model_gives_back_kv_behind_the_window(windowed_dirs, run):
    """Mistral (window 8 on every layer), 64 tokens after a 50-token prompt: the greedy ids equal transformers, cold
    and with the prompt cached; the pool lends out at most the prompt, a window and a few pages of slack (not the
    114 tokens the request spans), and every page is back after it ends and after an abort."""
    from test_scheduler import settle

    model_dir = windowed_dirs["mistral"]
    prompt = _prompts()[3]
    theirs = hf_greedy(model_dir, [prompt], LONG)[0]
    opts = MEMORY_RUNS[run]
    with LLM(str(model_dir), attention_backend="torch", **{"max_prefill_tokens": 16, **opts}, **EXACT) as llm:
        for _ in range(2):  # cold, then the prompt from the prefix cache (radix)
            got, held = _held_while_generating(llm, prompt)
            assert got == theirs
            assert held <= len(prompt) + WINDOW + 4 * opts["page_size"], held
            settle(llm)
        _held_while_generating(llm, prompt, abort_after=WINDOW * 3)
        settle(llm)


def test_kv_behind_the_window_held_without_giving_back(windowed_dirs, monkeypatch):
    """The control: with pages never given back, the same request holds all of its tokens."""
    from minisgl_cli.scheduler.cache import CacheManager

    monkeypatch.setattr(CacheManager, "_drop_behind", lambda self, req: None)
    prompt = _prompts()[3]
    with LLM(str(windowed_dirs["mistral"]), attention_backend="torch", page_size=2, **EXACT) as llm:
        _, held = _held_while_generating(llm, prompt)
    assert held >= len(prompt) + LONG - 4  # the last tokens are read after the request gave its pages back


# KV that follows the window where sliding and full layers mix (Gemma 3, gpt-oss): the full layers keep every token,
# the sliding layers' KV lives in window pages of its own, given back once behind the window (scheduler/cache.py).
MIXED_RUNS = {("gemma3", "radix"): dict(page_size=2),
              ("gemma3", "naive-chunked-overlap"): dict(cache="naive", max_prefill_tokens=12, overlap_on_cpu=True),
              ("gpt_oss", "radix"): dict(page_size=1)}


@pytest.fixture(scope="module")
def mixed_answers(windowed_dirs) -> dict[str, tuple[list[int], list[int], list[int]]]:
    """Per mixed family: (a 50-token prompt, one sharing its first 30 tokens, transformers' 64 greedy ids for each)."""
    prompt = _prompts()[3]
    g = torch.Generator().manual_seed(11)
    sharing = prompt[:30] + torch.randint(3, 49152, (9,), generator=g).tolist()
    return {family: (prompt, sharing, *hf_greedy(windowed_dirs[family], [prompt, sharing], LONG))
            for family in ("gemma3", "gpt_oss")}


def _window_lent(s: SchedulerStats) -> int:
    return s.window_tokens_total - s.window_tokens_free


@pytest.mark.parametrize("family,run", list(MIXED_RUNS))
def test_mixed_model_keeps_only_the_window_in_its_window_pages(windowed_dirs, mixed_answers, family, run):
    """64 tokens after a 50-token prompt: the greedy ids equal transformers, cold and with the prompt cached; the
    window pages lent out stay within the window (twice: the request's and its prompt's last, kept for a repeat), a
    few pages of slack and a chunk, not the 114 positions the request spans, while every full page stays; a prompt
    sharing only the first 30 tokens, whose window KV was given back, is recomputed and still answers as
    transformers; the window pages' accounting is exact after each request and after an abort (all of them free
    again where nothing is cached)."""
    from test_scheduler import settle

    model_dir = windowed_dirs[family]
    prompt, sharing, theirs, their_sharing = mixed_answers[family]
    opts = MIXED_RUNS[family, run]
    p = opts.get("page_size", 1)
    with LLM(str(model_dir), attention_backend="torch", **{"max_prefill_tokens": 16, **opts}, **EXACT) as llm:
        s = llm.client.stats()
        start = s.window_tokens_free
        assert s.window_tokens_total == start > 0 and s.kv_bytes_used == 0
        for _ in range(2):  # cold, then the prompt from the prefix cache (radix)
            got, lent = _held_while_generating(llm, prompt, every=8, lent=_window_lent)
            assert got == theirs
            if run == "radix":  # the full layers' KV of every position is cached (not only the window's)
                assert llm.client.stats().tokens_cached >= len(prompt) + LONG - 2 * p
            assert lent <= 2 * WINDOW + 16 + 6 * p, lent
            settle(llm)
        if run == "radix":
            assert llm.client.stats().cache_hit_tokens >= len(prompt) - p  # the repeat took its prompt's KV
        shared = llm.generate([sharing], SamplingParams(max_new_tokens=LONG, ignore_eos=True))[0].token_ids
        assert shared == their_sharing
        _held_while_generating(llm, prompt, abort_after=WINDOW * 3)
        settle(llm)
        if run != "radix":
            assert llm.client.stats().window_tokens_free == start


def test_window_pages_held_without_giving_back(windowed_dirs, monkeypatch):
    """The control: with window pages never given back, the same request holds a window page for every token."""
    from minisgl_cli.scheduler.cache import CacheManager

    monkeypatch.setattr(CacheManager, "_drop_windows", lambda self, req, end: None)
    prompt = _prompts()[3]
    with LLM(str(windowed_dirs["gemma3"]), attention_backend="torch", cache="naive", **EXACT) as llm:
        _, lent = _held_while_generating(llm, prompt, every=8, lent=_window_lent)
    assert lent >= len(prompt) + LONG - 8 - 2  # at the last poll, 8 tokens before the end


def test_gemma3_12b_at_32k_keeps_a_quarter_of_all_global_kv():
    """The engine's own accounting at full size (gemma-3-12b, bf16; on the meta device: shapes, no memory): a
    32k-token prompt prefilled in 2048-token chunks and decoded for a window and more, through the scheduler's cache
    verbs, holds at most a quarter of the bytes every layer keeping every token would (48 layers x 32k), at every
    step; the pool's tensors are the bytes its pages count, and /metrics' kv_bytes_used says the same."""
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.scheduler.cache import CacheManager
    from minisgl_cli.scheduler.config import SchedulerConfig
    from minisgl_cli.scheduler.request import Req
    from minisgl_cli.scheduler.scheduler import Scheduler
    from minisgl_cli.server.metrics import ServerMetrics

    engine = Engine(EngineConfig(model="gemma-3-12b", load_format="dummy", device="meta", dtype="bfloat16",
                                 kv_cache_gib=80, max_running_requests=8, page_size=16))
    pool, spec = engine.pool, engine.spec
    assert len(pool.window_layers) == 40 and spec.window == 1024  # five local layers to one global, window 1024
    full_bytes, window_bytes = spec.page_bytes
    storage = sum(t.numel() * t.element_size() for t in pool.k + pool.v)
    assert storage == (spec.num_pages + 1) * full_bytes + (spec.num_window_pages + 1) * window_bytes
    all_global = 32768 * pool.shape.bytes_per_token()  # K and V of 48 layers x 8 KV heads x 256, bf16
    assert all_global == 32768 * 48 * 2 * 8 * 256 * 2
    scheduler = Scheduler(engine, SchedulerConfig(), emit=lambda _: None)
    cache: CacheManager = scheduler.cache
    free = (cache.num_free_pages, engine.num_free_window_pages)

    def used() -> int:
        return ((spec.num_pages - cache.num_free_pages) * full_bytes
                + (spec.num_window_pages - engine.num_free_window_pages) * window_bytes)

    req = Req("long", list(range(32768)), SamplingParams(max_new_tokens=2048))
    assert cache.attach(req)
    peak = 0
    while req.kv_len < len(req.input_ids):  # prefill, as the scheduler runs it (_prefill_batch, _run, _launch)
        n = cache.prefill_cut(req, min(req.remaining_prefill, 2048))
        assert cache.reserve(req, n)
        req.kv_len += n
        cache.cache_prefilled(req)
        peak = max(peak, used())
    for _ in range(1500):  # decode past a window (_decode_batch)
        req.output_ids.append(7)
        assert cache.reserve_each([req], 1)
        req.kv_len += 1
        peak = max(peak, used())
    cache.check([req])
    snap = scheduler.snapshot()
    assert snap.kv_bytes_used == used() and snap.window_tokens_total == spec.num_window_pages * 16
    prom = ServerMetrics().to_prometheus(snap, "gemma-3-12b")
    assert f'minisgl_kv_bytes_used{{model_name="gemma-3-12b"}} {used()}' in prom
    assert "minisgl_kv_window_tokens_free" in prom
    print(f"gemma-3-12b at 32k: peak {peak / 2**30:.2f} GiB of {all_global / 2**30:.2f} GiB all-global "
          f"({peak / all_global:.1%})")
    assert peak <= all_global / 4
    cache.release(req)
    cache.check([])
    cache.clear()  # the prompt and the sequence the tree kept, with their last windows
    assert (cache.num_free_pages, engine.num_free_window_pages) == free


def test_short_window_pool_gives_back_the_cache_s_window_pages_and_stays_exact(windowed_dirs, monkeypatch):
    """Gemma 3 with window pages for one request's windows and no headroom (20 tokens; chunks cut to 10): each
    request needs the window pages the prefix cache kept for the ones before it, which it gives back (least recently
    used first, full pages kept); the repeated prompts, whose window KV went, are recomputed: every answer equals
    transformers and the pages add up."""
    from minisgl_cli.engine import engine

    monkeypatch.setattr(engine, "WINDOW_HEADROOM", 0)
    model_dir = windowed_dirs["gemma3"]
    prompts = _prompts()[2:4] + _prompts()[2:4]
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    with LLM(str(model_dir), attention_backend="torch", max_running_requests=1, **EXACT) as llm:
        assert llm.client.stats().window_tokens_total == 2 * (WINDOW + 2)
        got = [llm.generate([p], params)[0].token_ids for p in prompts]
        llm.client.check_pages()
        s = llm.client.stats()
    assert got == hf_greedy(model_dir, prompts, N_NEW)
    assert s.tokens_cached == 29 + 50 + 2 * (N_NEW - 1)  # both sequences' full pages stayed in the cache
