"""int4 / int8 weights on CPU: the GGUF's own blocks as shipped, quantize-at-load, the linear methods' kernels, and
their quality against the exact fp32 path on the same weights (perplexity on a fixed English text, the
parity test's chat prompts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from perplexity import perplexity

from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.engine.engine import Engine
from minisgl_cli.layers import quant
from minisgl_cli.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl_cli.layers.linear import ColumnParallelLinear
from minisgl_cli.loader.blocks import Int4Groups, Int8Groups, blocks_file, iter_blocks, quantize_int4, quantize_int8

EXACT = dict(dtype="float32", quantization="none")


def test_gguf_blocks_are_kept_as_shipped_and_dequantize_to_the_fp32_export(default_model_dir):
    """The converted GGUF keeps its Q4_1 / Q8_0 blocks; dequantized they equal the fp32 weights transformers loads."""
    from safetensors import safe_open

    kinds = {}
    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as fp32:
        for name, w in iter_blocks(blocks_file(default_model_dir)):
            kinds[name] = type(w).__name__
            got = w if isinstance(w, torch.Tensor) else w.dequantize()
            assert torch.equal(got, fp32.get_tensor(name)), name
    linears = ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight")
    assert [kinds[n] for n in linears] == ["Int4Groups", "Int4Groups"]
    assert kinds["model.embed_tokens.weight"] == "Int8Groups" and kinds["model.norm.weight"] == "Tensor"


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_block_parsing_matches_the_gguf_package(kind):
    """Random blocks of each kept type: our planes dequantize to exactly what gguf-py's dequantize gives."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from minisgl_cli.loader.gguf import _blocks

    rows, blocks = 6, 3
    g = np.random.default_rng(0)
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    raw = g.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    scales = g.normal(0, 0.02, (rows, blocks, 2 if kind == "Q4_1" else 1)).astype(np.float16).view(np.uint8)
    raw[..., : scales.shape[-1]] = scales  # finite fp16 d (and m)
    raw = raw.reshape(rows, blocks * size)
    qtype = GGMLQuantizationType[kind]
    ours = _blocks(kind, raw, np.ascontiguousarray)
    assert isinstance(ours, Int8Groups if kind == "Q8_0" else Int4Groups)
    assert torch.equal(ours.dequantize(), torch.from_numpy(dequantize(raw, qtype).astype(np.float32)))


@pytest.mark.parametrize("method", [quant.Int4Method, quant.Int8Method])
def test_quantized_linear_computes_with_its_low_bit_copy_or_its_exact_weight(method):
    """Merged shards (GGUF-style groups, and a dense tensor quantized at load) into 40 rows (the int4 pack pads to
    48), with a bias: a decode step runs the low-bit kernel on the quantized values, a prefill step the dense GEMM
    on the exact ones, whatever their row counts."""
    torch.manual_seed(0)
    layer = ColumnParallelLinear(64, [24, 16], bias=True, method=method())
    a = quantize_int4(torch.randn(24, 64) * 0.1)  # a shard as a GGUF ships it
    b = torch.randn(16, 64) * 0.1  # a dense shard
    layer.load_shard("weight", a, 0)
    layer.load_shard("weight", b, 1)
    layer.load_shard("bias", torch.randn(24), 0)
    layer.load_shard("bias", torch.randn(16), 1)
    layer.finish_loading()
    exact = torch.cat([a.dequantize(), b])
    assert torch.equal(layer.weight, exact)
    low_bit = (torch.cat([a.dequantize(), quantize_int4(b).dequantize()]) if method is quant.Int4Method
               else quantize_int8(exact).dequantize())
    for rows, decode, w in ((1, True, low_bit), (33, True, low_bit), (1, False, exact), (33, False, exact)):
        x = torch.randn(rows, 64)
        want = x @ w.t() + layer.bias
        got = layer(x, decode)
        assert got.shape == (rows, 40) and got.dtype == torch.float32
        # bf16 activations, scales and outputs in the kernels: ~3 significant digits
        assert torch.allclose(got, want, rtol=0.01, atol=0.01 * want.abs().max().item()), (rows, decode)


@pytest.mark.parametrize("fbgemm", [True, False])
def test_quantized_lm_head_is_int8_with_fp32_logits_and_tied_to_the_embedding(fbgemm, monkeypatch):
    """fbgemm's dynamic int8 linear where this torch packs for it, else torch._int_mm: fp32 logits close to exact."""
    # The quantized methods' head: int8 where fbgemm runs it at 8 bits (VNNI), else dense (exact logits).
    assert isinstance(quant.Int4Method().for_lm_head(), quant.Int8LogitsMethod) == quant._FBGEMM
    if fbgemm and not quant._FBGEMM:
        pytest.skip("fbgemm runs the head where the CPU has VNNI (without, its 7-bit activations are too coarse)")
    if not fbgemm:
        monkeypatch.setattr(quant, "_fbgemm_pack", lambda q, scale: None)
    torch.manual_seed(0)
    embed = VocabParallelEmbedding(100, 64)
    head = ParallelLMHead(100, 64, method=quant.Int8LogitsMethod(), tied=embed)
    embed.load_shard("weight", torch.randn(100, 64))
    head.finish_loading()
    assert (head.fbgemm is not None) == fbgemm
    x = torch.randn(3, 64)
    want = x @ embed.weight.t()
    got = head.logits(x)
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=0.02, atol=0.02 * want.abs().max().item())


@pytest.mark.parametrize("fbgemm", [True, False])
def test_the_int8_head_keeps_a_rows_ordinary_features_beside_an_outlier(fbgemm, monkeypatch):
    """Hidden states carry a few features far larger than the rest: one 8-bit row at the row's largest value left the
    rest a few codes each (5% of the largest logit; SmolLM2 then answered "L'Étoile, ..." for Paris). The head's two
    8-bit rows (codes, then the remainder's) keep the logits within 0.1% of the int8 weights' exact product."""
    if fbgemm and not quant._FBGEMM:
        pytest.skip("fbgemm runs the head where the CPU has VNNI")
    if not fbgemm:
        monkeypatch.setattr(quant, "_fbgemm_pack", lambda q, scale: None)
    torch.manual_seed(0)
    head = ParallelLMHead(512, 256, method=quant.Int8LogitsMethod())
    w = torch.randn(512, 256) * 0.05
    head.load_shard("weight", w)
    head.finish_loading()
    assert (head.fbgemm is not None) == fbgemm
    q = quant.quantize_int8(w)
    x = torch.randn(3, 256)
    x[:, 7] = 60.0  # the outlier feature
    want = x @ (q.q.float() * q.scale).t()
    got = head.logits(x)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()


@pytest.mark.slow  # ~90 s on 2 cores: every row of the text as a decode step, three engines; make test runs it
def test_quantized_perplexity_stays_close_to_the_exact_path(default_model_dir, text_docs, monkeypatch):
    """Same weights (the bundled Q4_1 GGUF), same text: int8 within 1% and int4 (its blocks as shipped) within 3% of
    the exact fp32 path. The text is read as 512-token prefills (tests/perplexity.py), so the low-bit kernels are
    made to take every row as a decode step's (decode runs them; prefill would otherwise take the dense weights)."""
    assert sum(len(d) for d in text_docs) > 5000
    tokens = max(len(d) for d in text_docs) + 8
    exact = perplexity(Engine(EngineConfig(max_total_tokens=tokens, **EXACT)), text_docs)
    low_bit = quant._WeightOnly.apply
    monkeypatch.setattr(quant._WeightOnly, "apply", lambda self, layer, x, bias, decode=False:
                        low_bit(self, layer, x, bias, decode=True))
    got = {}
    for q in ("int8", "int4"):
        engine = Engine(EngineConfig(max_total_tokens=tokens, quantization=q))
        assert engine.quantization == q
        got[q] = perplexity(engine, text_docs)
    print(f"perplexity over {sum(len(d) for d in text_docs)} tokens: exact fp32 {exact:.3f}, int8 {got['int8']:.3f}, "
          f"int4 {got['int4']:.3f}")
    assert 5 < exact < 40  # the model reads English
    assert abs(got["int8"] / exact - 1) < 0.01
    assert abs(got["int4"] / exact - 1) < 0.03


# On-topic words the exact fp32 mode's answers carry too (tests/test_hf_parity.py's prompts). The cities prompt's
# int4 (and int8) answer names two more ("The cities of Shanghai and Beijing ..."), the exact one repeats the three
# ("Zürich, Krakow, and 東京 are all cities."): a near tie, which answer a rounding decides.
# A word each sensible answer holds (any of several: a rounding change may pick another sensible one).
TOPICS = {"What is the capital of France?": ("paris",), "Write a haiku about the sea.": ("sea", "ocean"),
          "List three prime numbers.": ("2",), "Explain what a KV cache is in one sentence.": ("cache",),
          "Zürich, Kraków and 東京 are cities. Name one more:": ("cities",), "def fibonacci(n):": ("fibonacci",),
          "Once upon a time, in a small village,": ("village",)}


def test_default_model_runs_its_int4_blocks_and_answers_the_parity_prompts_sensibly():
    from test_hf_parity import PROMPTS

    from minisgl_cli import LLM, SamplingParams

    with LLM(attention_backend="torch") as llm:
        info = llm.client.info
        native_bf16 = torch.cpu._is_avx512_bf16_supported()  # then bf16 activations, else fp32
        assert (info.quantization, info.dtype, info.device) == ("int4", "bfloat16" if native_bf16 else "float32", "cpu")
        chats = [[{"role": "user", "content": p}] for p in PROMPTS]
        out = llm.generate(chats, SamplingParams(max_new_tokens=32))
        llm.client.check_pages()
    for prompt, done in zip(PROMPTS, out):
        assert len(done.text.split()) >= 3, (prompt, done.text)
        assert any(word in done.text.lower() for word in TOPICS.get(prompt, ("",))), (prompt, done.text)


@pytest.mark.parametrize("q", ["int4", "int8"])
def test_a_safetensors_model_quantizes_at_load(tiny_model_dirs, q):
    """A dense checkpoint (tiny Qwen2: q/k/v bias, tied head) under --quantization int4 / int8: the first decode step's
    logits (the low-bit kernels) stay close to the dense model's, and greedy decoding runs to the end."""
    from minisgl_cli import LLM, SamplingParams

    model = str(tiny_model_dirs["qwen2"])
    logits = {}
    for mode in ("none", q):
        engine = Engine(EngineConfig(model=model, quantization=mode, max_total_tokens=256))
        assert engine.quantization == mode
        table = engine.pool.page_table
        table[0, :2] = torch.tensor([1, 2], dtype=table.dtype)
        with torch.inference_mode():
            engine.forward(ForwardBatch.build("prefill", [5], [0], [0], [1], [1], engine.device, engine.host))
            step = ForwardBatch.build("decode", [7], [0], [1], [1], [2], engine.device, engine.host)
            logits[mode] = engine.forward(step)[0].float()
    cos = torch.nn.functional.cosine_similarity(logits["none"], logits[q], dim=0)
    assert cos > 0.99, cos
    with LLM(model, quantization=q) as llm:
        out = llm.generate([[3, 4, 5, 6]], SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert len(out[0].token_ids) == 8


def test_quantization_and_kv_dtype_flags_are_offered_and_bad_values_are_one_line_errors():
    from typer.testing import CliRunner

    from minisgl_cli.app import app

    for command in ("chat", "serve", "bench", "smoke"):
        usage = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
        assert "--quantization" in usage and "--kv-cache-dtype" in usage
    for flag, value, error in (
        ("--quantization", "int3", "unknown quantization 'int3'; choose one of auto, none, int4, int8, fp8"),
        ("--kv-cache-dtype", "fp16", "unknown KV cache dtype 'fp16'; choose one of auto, bf16, fp8_e4m3"),
    ):
        bad = CliRunner().invoke(app, ["smoke", "hi", flag, value])
        assert bad.exit_code == 1 and bad.output.strip().splitlines() == [f"error: {error}"]
    with pytest.raises(ValueError, match="does not run on cuda"):
        EngineConfig(device="cuda", quantization="int4").resolved_quantization()
    assert EngineConfig(device="cuda").resolved_quantization("int4") == "none"  # auto keeps what the device can run
