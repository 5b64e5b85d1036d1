"""DeepSeek-V3 and V2 (-Lite) on the engine: greedy ids equal transformers fp32 token for token on tiny random
configs -- MLA with and without q_lora_rank, interleaved and half-split rope, YaRN with its mscale softmax
correction, sigmoid routing with the correction bias and grouped top-k (V3), softmax group-limited routing (V2),
shared experts, dense first layers -- cold, cached, chunked, with a long shared prefix, two copies of one prompt at
once (n = 2) and at TP 2; the absorbed decode against the expanded one; each feature switched off makes the answers
differ; the latent KV cache's bytes against an MHA cache of the same width, from the engine's own accounting; and the
FP8 latent cache (`--kv-cache-dtype fp8_e4m3`) against the fp32 one, teacher-forced; a checkpoint in DeepSeek's
block-wise FP8 form (e4m3 weights, a scale per block) loaded as shipped."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from conftest import save_checkpoint
from test_hf_parity import EXACT, cold_and_cached, hf_greedy

from minisgl_cli import LLM, SamplingParams
from tests.triton_interp import INTERPRET, patch_interpreter

N_NEW = 16
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
         "beta_fast": 32.0, "beta_slow": 1.0}
_TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
             n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
             topk_group=2, max_position_embeddings=1024, eos_token_id=2, bos_token_id=1)
# three layers: one dense, two MoE (8 experts in 4 groups, the best 2 groups eligible, 3 experts a token)
FAMILIES = {
    # V3: q through q_lora_rank, rope in (x0, x1) pairs, YaRN with mscale_all_dim (the softmax scale corrected)
    "v3": ("DeepseekV3", dict(q_lora_rank=48, routed_scaling_factor=2.5,
                              rope_parameters={**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # V3 with its rope dims as halves (rope_interleave false), plain RoPE, weights not renormalized
    "v3_halves": ("DeepseekV3", dict(q_lora_rank=48, rope_interleave=False, norm_topk_prob=False)),
    # V2-Lite's shape: a plain q_proj; V2's softmax routing over limited groups, V2-Lite's mscale 0.707
    "v2": ("DeepseekV2", dict(q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                              rope_parameters={**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707})),
}


def make_tiny_deepseek(family: str, out: Path, tokenizer_from: Path, **overrides) -> Path:
    """A tiny random DeepSeek checkpoint of `family` (config fields: its own, `overrides`) saved by transformers, with
    the default model's tokenizer; its weights larger than the init default and V3's correction bias random (else
    zeros), so routing and tokens vary."""
    import transformers

    name, fields = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{name}Config")(**{**_TINY, **fields, **overrides})
    model = getattr(transformers, f"{name}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    return save_checkpoint(model, out, tokenizer_from)


def _prompts() -> list[list[int]]:
    """Short and long prompts (past YaRN's original 16 positions), and three sharing a long prefix."""
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 13, 40)]
    prefix = torch.randint(3, 49152, (30,), generator=g).tolist()
    return ids + [prefix + torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 6, 11)]


def _ours(model_dir: Path, prompts: list[list[int]], backend: str = "torch",
          **kw) -> tuple[list[list[int]], list[list[int]]]:
    """(cold, cached), each prompt's latent KV from the radix cache the second time."""
    return cold_and_cached(model_dir, prompts, N_NEW, backend, **kw)


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {f: make_tiny_deepseek(f, root / f, tokenizer_dir) for f in FAMILIES}


@pytest.fixture(scope="module")
def theirs(deepseek_dirs) -> dict[str, list[list[int]]]:
    """transformers' fp32 greedy answers, once per family."""
    return {f: hf_greedy(d, _prompts(), N_NEW) for f, d in deepseek_dirs.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_deepseek_greedy_matches_transformers_cold_and_cached(deepseek_dirs, theirs, family):
    assert len({tuple(t) for t in theirs[family]}) == len(_prompts()), "degenerate tiny model"
    cold, cached = _ours(deepseek_dirs[family], _prompts())
    assert cold == theirs[family]
    assert cached == theirs[family]


def test_two_copies_of_a_prompt_at_once_both_answer_as_transformers(deepseek_dirs, theirs):
    """n = 2: the same prompt twice in one batch (the second shares the first's latent prefix once it is cached)."""
    prompts = _prompts()
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    with LLM(str(deepseek_dirs["v3"]), attention_backend="torch", **EXACT) as llm:
        out = [r.token_ids for r in llm.generate([prompts[2], prompts[2], prompts[4], prompts[4]], [params] * 4)]
        llm.client.check_pages()
    assert out == [theirs["v3"][2]] * 2 + [theirs["v3"][4]] * 2


@pytest.mark.slow
@pytest.mark.parametrize("family", ["v3", "v2"])
def test_tp2_answers_as_tp1(deepseek_dirs, theirs, family):
    """TP 2 on the CPU: each rank its half of the heads (q, kv_b_proj, o_proj) and of every expert and the shared
    experts; the latent and the low-rank projections whole on both."""
    cold, cached = _ours(deepseek_dirs[family], _prompts(), tp_size=2, device="cpu")
    assert cold == cached == theirs[family]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["overlap", "ngram"])
def test_overlap_and_speculative_verify_keep_the_answers(deepseek_dirs, theirs, mode):
    """Overlap scheduling (forced on the CPU) and prompt-lookup speculation (drafts as extra decode rows, each an
    absorbed decode row over the latent cache, the rejected ones' latent rows written and dropped)."""
    kw = (dict(overlap_on_cpu=True) if mode == "overlap" else
          dict(speculative_algorithm="ngram", num_speculative_tokens=3))
    cold, cached = _ours(deepseek_dirs["v3"], _prompts(), **kw)
    assert cold == cached == theirs["v3"]


def test_absorbed_decode_answers_as_the_expanded_one(deepseek_dirs, theirs, monkeypatch):
    from minisgl_cli.attention.mla import MlaBackend

    monkeypatch.setattr(MlaBackend, "absorb", False)
    cold, _ = _ours(deepseek_dirs["v3"], _prompts())
    assert cold == theirs["v3"]


@pytest.mark.skipif(not (INTERPRET and importlib.util.find_spec("triton") is not None),
                    reason="needs TRITON_INTERPRET=1 with triton importable (tests/test_gpu_mla_attention.py)")
def test_triton_absorbed_decode_under_the_interpreter_answers_as_transformers(deepseek_dirs, theirs, monkeypatch):
    """The CUDA path's kernel (kernels/triton/mla.py) run on CPU tensors by Triton's interpreter, in the engine."""
    from minisgl_cli.attention.mla import MlaBackend

    patch_interpreter()
    monkeypatch.setattr(MlaBackend, "triton_decode", True)  # as on CUDA
    cold, cached = _ours(deepseek_dirs["v3"], _prompts(), backend="auto")
    assert cold == cached == theirs["v3"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Triton MLA decode kernel")
def test_deepseek_on_cuda_matches_transformers(deepseek_dirs, theirs):
    """The CUDA path in the exact mode: prefill expanded in torch, decode through the Triton kernel (fp32 dots)."""
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    for family in ("v3", "v2"):
        with LLM(str(deepseek_dirs[family]), max_prefill_tokens=12, device="cuda", **EXACT) as llm:
            cold = [r.token_ids for r in llm.generate(_prompts(), [params] * len(_prompts()))]
            cached = [r.token_ids for r in llm.generate(_prompts(), [params] * len(_prompts()))]
            llm.client.check_pages()
        assert cold == cached == theirs[family]


def test_absorbed_and_expanded_decode_are_the_same_numbers():
    """One decode step of MLA over a latent pool: W_UK folded into the query and W_UV after attention over the
    latent rows against the keys and values expanded per head, and both against plain attention written out."""
    from minisgl_cli.attention.mla import MlaBackend
    from minisgl_cli.engine.batch import ForwardBatch
    from minisgl_cli.engine.host import HostBuffers
    from minisgl_cli.kvcache.pool import KVPool, KVShape

    H, dn, dr, dv, R, L = 4, 16, 8, 12, 32, 37
    g = torch.Generator().manual_seed(0)
    pool = KVPool(KVShape(1, 1, R + dr, torch.float32, latent=R), num_pages=64, page_size=1, max_reqs=2,
                  max_context_len=64, device="cpu")
    slots = torch.arange(1, L + 1)
    pool.page_table[0, :L] = slots.to(torch.int32)
    latent = torch.randn(L, R + dr, generator=g)
    pool.store(0, slots[:-1], latent[:-1, None], latent[:-1, None])
    kv_b = torch.randn(H * (dn + dv), R, generator=g) / R**0.5

    class Weights:
        w_uk = kv_b.view(H, dn + dv, R)[:, :dn]
        w_uv = kv_b.view(H, dn + dv, R)[:, dn:]

        @staticmethod
        def expand(c):
            kv = (c @ kv_b.T).view(c.shape[0], H, dn + dv)
            return kv[..., :dn], kv[..., dn:]

    q_nope, q_pe = torch.randn(1, H, dn, generator=g), torch.randn(1, H, dr, generator=g)
    scale = (dn + dr) ** -0.5
    outs = []
    for absorb in (True, False):
        backend = MlaBackend(pool, H, R, dr, scale)
        backend.absorb = absorb
        batch = ForwardBatch.build("decode", [0], [0], [L - 1], [1], slots[-1:], "cpu", HostBuffers())
        backend.prepare(batch)
        outs.append(backend.forward_mla(q_nope, q_pe, latent[-1:], 0, batch, Weights()))
    k_nope, v = Weights.expand(latent[:, :R])
    scores = (torch.einsum("hd,lhd->hl", q_nope[0], k_nope) + q_pe[0] @ latent[:, R:].T) * scale
    reference = torch.einsum("hl,lhv->hv", scores.softmax(-1), v)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[0][0], reference, rtol=1e-5, atol=1e-6)


def _switch_off(monkeypatch, feature: str) -> None:
    """Our engine with one DeepSeek feature done wrong: `rope_layout` (interleaved rope rows left as pairs),
    `correction_bias` (V3's bias left out of the choice), `groups` (top-k over every expert), `mscale` (the softmax
    scale without YaRN's correction)."""
    import dataclasses

    from minisgl_cli.attention import mla
    from minisgl_cli.layers import moe
    from minisgl_cli.models import deepseek

    if feature == "rope_layout":
        monkeypatch.setattr(deepseek, "_halves", lambda w, width, start: w)
        return
    if feature == "mscale":
        from minisgl_cli.engine import engine

        create = mla.create_mla_backend

        def plain_scale(name, pool, heads, rank, rope_dim, scale, kernels=None):
            return create(name, pool, heads, rank, rope_dim, (_TINY["qk_nope_head_dim"] + rope_dim) ** -0.5, kernels)

        monkeypatch.setattr(engine, "create_mla_backend", plain_scale)
        return
    grouped = moe.route_grouped

    def wrong(logits, top_k, r, bias, ops=None):
        if feature == "correction_bias":
            return grouped(logits, top_k, r, None, ops)
        return grouped(logits, top_k, dataclasses.replace(r, n_group=1, topk_group=1, group_score="max"), bias, ops)

    monkeypatch.setattr(moe, "route_grouped", wrong)


@pytest.mark.parametrize("family,feature", [("v3", "rope_layout"), ("v2", "rope_layout"), ("v3", "correction_bias"),
                                            ("v3", "groups"), ("v2", "groups"), ("v3", "mscale"), ("v2", "mscale")])
def test_each_feature_done_wrong_changes_the_answers(deepseek_dirs, theirs, monkeypatch, family, feature):
    """The negative control: the parity test above fails with any one of these features wrong."""
    _switch_off(monkeypatch, feature)
    cold, _ = _ours(deepseek_dirs[family], _prompts())
    assert cold != theirs[family]


def test_latent_cache_holds_no_v_half_and_32k_tokens_cost_what_it_says(deepseek_dirs, tokenizer_dir, tmp_path):
    """The engine's own accounting: a 32k-token request's cache bytes for the MLA model (one latent row of
    kv_lora_rank + rope dims a token and layer) against an MHA model of the same width (K and V per KV head), the
    pool's tensors exactly that size, and a KV budget holding as many more tokens."""
    from conftest import make_tiny_checkpoint

    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine

    # MHA of the MLA model's width: its 3 layers, 4 heads of 16 (as many KV heads), hidden 64
    mha_dir = make_tiny_checkpoint("llama", tmp_path / "mha", tokenizer_dir, num_hidden_layers=3,
                                   num_key_value_heads=4)
    engines = {name: Engine(EngineConfig(model=str(d), kv_cache_gib=0.01, page_size=16, device="cpu", **EXACT))
               for name, d in (("mla", deepseek_dirs["v3"]), ("mha", mha_dir))}
    mla, mha = engines["mla"].pool, engines["mha"].pool
    assert mla.shape.latent == 32 and mla.shape.head_dim == 32 + 8 and mla.shape.num_kv_heads == 1
    per_token = {n: e.pool.shape.bytes_per_token() for n, e in engines.items()}
    assert per_token["mla"] == 3 * (32 + 8) * 4  # layers x (latent + rope) x fp32, no V
    assert per_token["mha"] == 2 * 3 * 4 * 16 * 4  # K and V x layers x KV heads x head_dim x fp32
    tokens = 32 * 1024
    print(f"32k tokens: MLA {tokens * per_token['mla']:,} B, MHA {tokens * per_token['mha']:,} B")
    # the pool's memory is what it counts: its V tensors are views of K's latent columns
    for pool in (mla, mha):
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in pool.k + pool.v}
        assert sum(storages.values()) == (pool.num_pages + 1) * pool.page_size * pool.shape.bytes_per_token()
    # one budget, kv_tokens (what admission and /metrics count) in proportion
    assert mla.num_pages == int(0.01 * 2**30) // (per_token["mla"] * 16)
    assert mha.num_pages == int(0.01 * 2**30) // (per_token["mha"] * 16)


_BLOCK = (16, 32)  # the tiny config's FP8 blocks (DeepSeek ships 128 x 128): rows and columns with partial blocks


@pytest.fixture(scope="module")
def block_fp8_dirs(deepseek_dirs, tmp_path_factory) -> dict[str, Path]:
    return block_fp8_checkpoints(deepseek_dirs["v3"], tmp_path_factory.mktemp("block_fp8"))


def block_fp8_checkpoints(v3: Path, root: Path) -> dict[str, Path]:
    """The v3 checkpoint as DeepSeek ships its FP8 one: every decoder linear's `weight` in e4m3 blocks of _BLOCK with
    its `weight_scale_inv` (the router, norms, embeddings and LM head as they were), quantization_config saying so;
    and the same weights dequantized to fp32 in a plain checkpoint, for transformers."""
    import json

    from safetensors.torch import load_file, save_file

    from minisgl_cli.loader.blocks import quantize_fp8_blocks

    dirs = {kind: root / kind for kind in ("fp8", "dequantized")}
    for d in dirs.values():
        shutil.copytree(v3, d)
    fp8, dense = {}, {}
    for name, w in load_file(str(v3 / "model.safetensors")).items():
        if w.dim() == 2 and name.startswith("model.layers.") and not name.endswith(".mlp.gate.weight"):
            blocks = quantize_fp8_blocks(w, _BLOCK)
            fp8[name], fp8[f"{name}_scale_inv"] = blocks.q, blocks.scale_inv
            dense[name] = blocks.dequantize()
        else:
            fp8[name] = dense[name] = w
    save_file(fp8, str(dirs["fp8"] / "model.safetensors"), metadata={"format": "pt"})
    save_file(dense, str(dirs["dequantized"] / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dirs["fp8"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(_BLOCK)}
    (dirs["fp8"] / "config.json").write_text(json.dumps(cfg))
    return dirs


@pytest.fixture(scope="module")
def block_fp8_theirs(block_fp8_dirs) -> list[list[int]]:
    """transformers' fp32 greedy answers on the dequantized weights."""
    return hf_greedy(block_fp8_dirs["dequantized"], _prompts(), N_NEW)


def test_block_fp8_checkpoint_loads_and_answers_as_transformers_on_its_dequantized_weights(block_fp8_dirs,
                                                                                          block_fp8_theirs, theirs):
    """On the CPU the e4m3 blocks are dequantized at load (fp32 here): greedy ids equal transformers fp32 running the
    dequantized weights, token for token, cold and cached; they are not the unquantized model's answers."""
    want = block_fp8_theirs
    cold, cached = _ours(block_fp8_dirs["fp8"], _prompts())
    assert cold == cached == want
    assert want != theirs["v3"]  # the blocks' rounding shows: the scales were applied to the right blocks


@pytest.mark.slow
def test_tp2_loads_block_fp8_shards_as_tp1(block_fp8_dirs, block_fp8_theirs):
    """TP 2: each rank cuts its shards out of the blocks (q_b_proj's heads and the experts' gate / up rows on block
    boundaries; o_proj's and the experts' down columns off them, dequantized whole first) and answers as TP 1."""
    cold, cached = _ours(block_fp8_dirs["fp8"], _prompts(), tp_size=2, device="cpu")
    assert cold == cached == block_fp8_theirs


def test_fp8_blocks_cut_reorder_and_dequantize_by_their_blocks():
    """loader/blocks.py's Fp8Blocks: a shard of rows or columns starting on a block keeps its codes and its scales'
    rows / columns (a partial last block too); one off the blocks comes dequantized; rows reordered within their
    blocks stay blocks. layers/quant.py's fp8-block method holds them as shipped and multiplies as its kernel does
    (kernels/fp8.py's per-token-group activations), here by its fp32 reference path."""
    from minisgl_cli.kernels import fp8 as fp8_numerics
    from minisgl_cli.layers.linear import ColumnParallelLinear
    from minisgl_cli.layers.quant import Fp8BlockMethod
    from minisgl_cli.loader.blocks import Fp8Blocks, quantize_fp8_blocks

    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 72, generator=g)
    b = quantize_fp8_blocks(w, _BLOCK)
    assert b.q.dtype == torch.float8_e4m3fn and b.scale_inv.shape == (3, 3)
    assert (b.dequantize() - w).abs().max() <= w.abs().max() / 16
    rows, cols = b.narrow(0, 16, 24), b.narrow(1, 32, 40)
    assert isinstance(rows, Fp8Blocks) and isinstance(cols, Fp8Blocks)
    torch.testing.assert_close(rows.dequantize(), b.dequantize()[16:], rtol=0, atol=0)
    torch.testing.assert_close(cols.dequantize(), b.dequantize()[:, 32:], rtol=0, atol=0)
    off = b.narrow(0, 8, 16)
    assert not isinstance(off, Fp8Blocks) and torch.equal(off, b.dequantize()[8:24])
    within = torch.arange(40).view(-1, 8).flip(-1).reshape(-1)  # each run of 8 rows reversed: inside its 16-row block
    assert isinstance(b.take_rows(within), Fp8Blocks)
    torch.testing.assert_close(b.take_rows(within).dequantize(), b.dequantize()[within], rtol=0, atol=0)
    across = torch.arange(40).roll(8)
    assert torch.equal(b.take_rows(across), b.dequantize()[across])

    layer = ColumnParallelLinear(72, [32, 8], bias=False, method=Fp8BlockMethod(_BLOCK))  # merged: rows 0..31, 32..39
    layer.load_shard("weight", b.narrow(0, 0, 32), 0)
    layer.load_shard("weight", b.narrow(0, 32, 8), 1)
    assert layer.weight.dtype == torch.float8_e4m3fn and torch.equal(layer.weight_scale_inv, b.scale_inv)
    x = torch.randn(5, 72, generator=g)
    codes, scales = fp8_numerics.quantize_groups(x, _BLOCK[1])
    want = fp8_numerics.dequantize_groups(codes, scales, _BLOCK[1]) @ b.dequantize().T
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_block_fp8_experts_keep_each_tp_ranks_blocks_as_shipped(tp):
    """A block-FP8 checkpoint's experts under the fp8-block method (layers/moe.py's Experts, `fp8_block`) keep each
    rank's codes and block scales as shipped (gate and up rows, down's columns: whole blocks); dequantized they are
    that rank's slice of the dequantized experts. A dense matrix (dummy weights) is made into blocks as DeepSeek's were;
    a rank's width that splits a block leaves the experts dense."""
    from minisgl_cli.distributed import TPInfo
    from minisgl_cli.layers.moe import Experts, fp8_expert_blocks
    from minisgl_cli.layers.quant import Fp8BlockMethod
    from minisgl_cli.loader.blocks import quantize_fp8_blocks

    n_exp, hidden, inter = 2, 72, 64  # hidden 72: a partial last column block of gate/up, a partial row block of down
    assert fp8_expert_blocks(Fp8BlockMethod(_BLOCK), inter, TPInfo(0, tp)) == _BLOCK
    assert fp8_expert_blocks(Fp8BlockMethod(_BLOCK), 48, TPInfo(0, 2)) is None  # 24 columns a rank: not whole blocks
    g = torch.Generator().manual_seed(tp)
    shipped = {(e, p): quantize_fp8_blocks(torch.randn(*shape, generator=g), _BLOCK) for e in range(n_exp)
               for p, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter)))}
    for rank in range(tp):
        experts = Experts(n_exp, hidden, inter, TPInfo(rank, tp), fp8_block=_BLOCK)
        for (e, proj), b in shipped.items():
            experts.load_expert(e, proj, b if e == 0 else b.dequantize())  # expert 1: dense, made into blocks
        assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
        assert experts.gate_up_scale.shape == (n_exp, 2 * inter // tp // 16, 3)
        gate_up, down = experts.dense(torch.float32)
        n, start = inter // tp, rank * inter // tp
        for e in range(n_exp):
            want = [shipped[(e, p)].dequantize() for p in ("gate_proj", "up_proj", "down_proj")]
            assert torch.equal(gate_up[e], torch.cat([w[start:start + n] for w in want[:2]]))
            assert torch.equal(down[e], want[2][:, start:start + n])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs CUDA 8.9+: the block-wise FP8 GEMM")
def test_block_fp8_checkpoint_on_cuda_keeps_its_blocks(block_fp8_dirs):
    """On an FP8 GPU auto keeps the blocks as shipped (e4m3 weights, kernels/triton/fp8_block.py's GEMM with the
    activations per token group; the MoE experts' blocks too, on the torch path here: fp32): teacher-forced against
    the dequantized weights on the CPU (prefill chunks, then decode steps), the logits within 9% and the greedy choice
    the same at 80% of positions: what FP8 activations cost this tiny model (the method's fp32 reference path, the
    kernel's numbers, measured 6.4% and 86% on the CPU; 6.3% and 86% with the experts dense)."""
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine

    gpu = Engine(EngineConfig(model=str(block_fp8_dirs["fp8"]), device="cuda", dtype="float32", max_total_tokens=256))
    cpu = Engine(EngineConfig(model=str(block_fp8_dirs["fp8"]), max_total_tokens=256, **EXACT))
    assert gpu.quantization == "fp8-block" and cpu.quantization == "none"
    attn = gpu.model.layers[0].self_attn
    assert attn.q_a_proj.weight.dtype == torch.float8_e4m3fn and attn.kv_b_proj.weight.dtype == torch.float32
    assert gpu.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    rel, same = [], []
    for prompt in _prompts():
        # the last 4 tokens as decode steps: one-row linears (the shared experts' SiLU-and-mul included)
        exact, fp8 = (_teacher_forced_logits(e, prompt, len(prompt) - 4).cpu() for e in (cpu, gpu))
        rel.append((fp8 - exact).norm(dim=-1) / exact.norm(dim=-1))
        same.append(fp8.argmax(-1) == exact.argmax(-1))
    assert torch.cat(rel).mean().item() <= 0.09 and torch.cat(same).float().mean().item() >= 0.8


def _teacher_forced_logits(engine, ids: list[int], prompt_len: int) -> torch.Tensor:
    """Logits [len(ids), vocab] fp32 of every position of `ids` through the engine's own paths: the first
    `prompt_len` in prefill chunks of 8 (each chunk reading the earlier ones from the pool), the rest one decode step
    each (the absorbed decode over the cached rows)."""
    from minisgl_cli.engine.batch import ForwardBatch

    pool, n = engine.pool, len(ids)
    row, pages = pool.alloc_req_row(), pool.alloc_pages(-(-n // pool.page_size))
    assert row is not None and pages is not None
    slots = pool.slots_of_pages(pages)[:n]
    pool.page_table[row, :n] = slots.to(pool.device, torch.int32)
    steps = [(s, min(s + 8, prompt_len)) for s in range(0, prompt_len, 8)] + [(p, p + 1) for p in range(prompt_len, n)]
    outs = []
    for start, end in steps:
        batch = ForwardBatch.build("prefill" if start < prompt_len else "decode", ids[start:end], [row], [start],
                                   [end - start], slots[start:end], engine.device, engine.host)
        batch.logits_indices = torch.arange(end - start, device=engine.device)
        outs.append(engine.forward(batch).float())
    pool.free_pages(pages)
    pool.free_req_row(row)
    return torch.cat(outs)


@pytest.mark.parametrize("family", ["v3", "v2"])
def test_fp8_latent_cache_costs_what_fp8_kv_costs_mha(deepseek_dirs, theirs, family):
    """`--kv-cache-dtype fp8_e4m3` on an MLA model: each latent row as e4m3 codes with the layer's scale and means,
    read back by prefill chunks and decode steps. The bar, teacher-forced on transformers' greedy answers (prompt in
    chunks of 8, the answer in decode steps), against the same engine with the fp32 cache: the logits within 6%
    (relative norm, mean over positions) and the greedy choice the same at 85% of positions. A tiny random MHA model
    of the same width (llama, 3 layers of 4 heads of 16) with FP8 KV measured 5.2% and 88% (in prefill chunks of 8
    alone); these MLA models measure 3.6% and 93% (v3), 4.6% and 90% (v2). Tiny random models have near-flat logits,
    so greedy runs part ways within a few tokens: the real-weights bar is tests/test_fp8.py's perplexity within 1%."""
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine

    engines = {kv: Engine(EngineConfig(model=str(deepseek_dirs[family]), max_total_tokens=256, kv_cache_dtype=kv,
                                       **EXACT)) for kv in ("auto", "fp8_e4m3")}
    assert engines["fp8_e4m3"].pool.quantized and engines["fp8_e4m3"].pool.k[0].dtype == torch.float8_e4m3fn
    rel, same = [], []
    for prompt, answer in zip(_prompts(), theirs[family]):
        exact, fp8 = (_teacher_forced_logits(e, prompt + answer, len(prompt)) for e in engines.values())
        rel.append((fp8 - exact).norm(dim=-1) / exact.norm(dim=-1))
        same.append(fp8.argmax(-1) == exact.argmax(-1))
    rel_mean, agree = torch.cat(rel).mean().item(), torch.cat(same).float().mean().item()
    print(f"\nFP8 latent ({family}): logits {rel_mean:.2%} off, greedy choice equal at {agree:.1%} of positions")
    assert 0 < rel_mean <= 0.06 and agree >= 0.85
    for e in engines.values():
        assert e.pool.num_free_pages == e.pool.num_pages
    if family == "v3":  # served: chunked prefills, the radix cache's FP8 rows reused, every page accounted for
        cold, cached = _ours(deepseek_dirs[family], _prompts(), kv_cache_dtype="fp8_e4m3")
        for run in (cold, cached):  # greedy runs part ways after a few tokens (see above), but start alike
            assert sum(ours[0] == want[0] for ours, want in zip(run, theirs[family])) >= 4


def test_fp8_latent_cache_halves_the_bytes_a_token(deepseek_dirs):
    """The engine's own accounting: FP8 latent rows cost one byte a value, half of bf16's, and the same KV budget holds
    twice the pages; the pool's tensors are that size."""
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine

    pools = {kv: Engine(EngineConfig(model=str(deepseek_dirs["v3"]), kv_cache_gib=0.004, page_size=16,
                                     kv_cache_dtype=kv, device="cpu", **EXACT)).pool for kv in ("bf16", "fp8_e4m3")}
    bf16, fp8 = (p.shape.bytes_per_token() for p in pools.values())
    assert (bf16, fp8) == (3 * (32 + 8) * 2, 3 * (32 + 8))
    assert pools["fp8_e4m3"].num_pages == int(0.004 * 2**30) // (fp8 * 16) >= 2 * pools["bf16"].num_pages - 1
    for pool in pools.values():
        assert sum(k.untyped_storage().nbytes() for k in pool.k) == (
            (pool.num_pages + 1) * pool.page_size * pool.shape.bytes_per_token())


def test_full_size_latent_cache_against_mha_of_the_same_width():
    """DeepSeek-V3's shape (61 layers): one 512 + 64 latent row a token and layer, against its 128 heads as an MHA
    cache of the same width keeps them (K of 128 + 64 dims, V of 128), and against 128 heads of 128 for K and V."""
    from minisgl_cli.kvcache.pool import KVShape
    from minisgl_cli.loader.configs import builtin_config
    from minisgl_cli.models import ModelConfig

    mc = ModelConfig.from_hf(builtin_config("deepseek-v3-5layer") | {"num_hidden_layers": 61})
    m = mc.mla
    assert m is not None
    mla = KVShape(mc.num_layers, 1, m.latent_dim, torch.bfloat16, m.kv_lora_rank).bytes_per_token()
    square = KVShape(mc.num_layers, mc.num_heads, 128, torch.bfloat16).bytes_per_token()
    mha = mc.num_layers * mc.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 2
    assert mla == 61 * 576 * 2 == 70_272
    assert (square, mha) == (3_997_696, 4_997_120)
    tokens = 32 * 1024  # 2.1 GiB of latent rows against 152.5 GiB of K and V (122 GiB at 128 dims each)
    assert (tokens * mla / 2**30, tokens * mha / 2**30) == (2.14453125, 152.5)
    assert mha // mla == 71


def test_deepseek_yarn_and_softmax_scale_are_transformers():
    """V3's and V2-Lite's YaRN (mscale, mscale_all_dim): the frequencies, the cos / sin factor, and the softmax
    scale's correction, as transformers computes them."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    from minisgl_cli.layers.rotary import _inv_freq
    from minisgl_cli.loader.configs import builtin_config
    from minisgl_cli.models import ModelConfig

    for name in ("deepseek-v3-5layer", "deepseek-v2-lite"):
        cfg = builtin_config(name)
        mc = ModelConfig.from_hf(cfg)
        assert mc.mla is not None and mc.rope_scaling is not None
        rope = {**cfg["rope_scaling"], "rope_type": "yarn", "rope_theta": cfg["rope_theta"]}
        rope.pop("type", None)
        hf_cfg = transformers.DeepseekV3Config(**{**_TINY, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                                                  "rope_parameters": rope, "max_position_embeddings": 163840})
        theirs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
        ours, our_factor = _inv_freq(64, mc.rope_theta, mc.rope_scaling)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        assert our_factor == pytest.approx(their_factor)
        assert mc.attn_scale == pytest.approx(DeepseekV3Attention(hf_cfg, 0).scaling, rel=1e-12)


def test_what_is_not_supported_is_refused_by_name(deepseek_dirs, tmp_path):
    import json

    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.loader.configs import builtin_config
    from minisgl_cli.models import ModelConfig

    v2 = builtin_config("deepseek-v2-lite")
    with pytest.raises(ValueError, match="moe_layer_freq"):
        ModelConfig.from_hf({**v2, "moe_layer_freq": 2})
    with pytest.raises(ValueError, match="norm_topk_prob"):
        ModelConfig.from_hf({**v2, "norm_topk_prob": True})
    with pytest.raises(ValueError, match="scoring_func"):
        ModelConfig.from_hf({**builtin_config("deepseek-v3-5layer"), "scoring_func": "softmax"})
    with pytest.raises(ValueError, match="no MLA"):
        Engine(EngineConfig(model=str(deepseek_dirs["v3"]), attention_backend="flashinfer", device="cpu", **EXACT))
    with pytest.raises(ValueError, match="'triton' needs a CUDA device"):
        Engine(EngineConfig(model=str(deepseek_dirs["v3"]), attention_backend="triton", device="cpu", **EXACT))
    fp8 = tmp_path / "fp8"
    shutil.copytree(deepseek_dirs["v3"], fp8)
    cfg = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(Exception, match="only block-wise FP8 weights"):  # per-tensor / per-channel scales
        Engine(EngineConfig(model=str(fp8), **EXACT))


def test_builtin_deepseek_configs_have_their_published_shapes():
    from minisgl_cli.loader.configs import builtin_config
    from minisgl_cli.models import ModelConfig

    lite = ModelConfig.from_hf(builtin_config("deepseek-v2-lite"))
    assert lite.mla is not None and lite.mla.q_lora_rank == 0 and lite.mla.latent_dim == 576
    assert (lite.num_layers, lite.num_experts, lite.num_experts_per_tok, lite.n_shared_experts) == (27, 64, 6, 2)
    assert lite.mlp_only_layers == (0,) and lite.routing is not None and lite.routing.scoring == "softmax"
    v3 = ModelConfig.from_hf(builtin_config("deepseek-v3-5layer"))
    assert v3.mla is not None and v3.mla.q_lora_rank == 1536 and v3.num_heads == 128
    assert v3.routing is not None and (v3.routing.n_group, v3.routing.topk_group) == (8, 4)
    assert v3.num_experts == 256 and v3.mlp_only_layers == (0,) and v3.num_layers == 5


@pytest.mark.parametrize("family", ["v3", "v3_halves", "v2", "v2_greedy"])
def test_grouped_routing_is_transformers_router(family):
    """layers/moe.py's route_grouped against transformers' DeepseekV3TopkRouter / DeepseekV2TopkRouter on the same
    gate: the same experts and the same weights for every token (ties aside: random fp32 scores have none)."""
    import transformers

    from minisgl_cli.layers.moe import route_grouped
    from minisgl_cli.models import ModelConfig

    name, fields = FAMILIES["v2" if family == "v2_greedy" else family]
    fields = {**fields, "topk_method": "greedy"} if family == "v2_greedy" else fields
    hf_cfg = getattr(transformers, f"{name}Config")(**{**_TINY, **fields, "n_routed_experts": 16})
    module = __import__(f"transformers.models.deepseek_{name[-2:].lower()}.modeling_deepseek_{name[-2:].lower()}",
                        fromlist=["x"])
    router = getattr(module, f"{name}TopkRouter")(hf_cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3)
    x = torch.randn(64, _TINY["hidden_size"], generator=g)
    _, their_w, their_ids = router(x)
    mc = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": [f"{name}ForCausalLM"]})
    assert mc.routing is not None
    bias = getattr(router, "e_score_correction_bias", None) if mc.routing.correction_bias else None
    our_w, our_ids = route_grouped(torch.nn.functional.linear(x, router.weight), hf_cfg.num_experts_per_tok,
                                   mc.routing, bias)
    order = their_ids.argsort(dim=-1)
    assert torch.equal(our_ids, their_ids.gather(1, order))
    torch.testing.assert_close(our_w, their_w.gather(1, order), rtol=0, atol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dummy_checkpoint_has_the_shapes_transformers_saves(deepseek_dirs, family):
    """--load-format dummy's tensors for a DeepSeek config: every name and shape a transformers checkpoint has."""
    import json

    from safetensors import safe_open

    from minisgl_cli.models import ModelConfig
    from minisgl_cli.models.dummy import _shapes

    d = deepseek_dirs[family]
    mc = ModelConfig.from_hf(json.loads((d / "config.json").read_text()))
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert dict(_shapes(mc)) == saved


def test_builtin_dummy_deepseek_starts_and_generates_on_cpu():
    """`--load-format dummy --model deepseek-tiny` on the CPU (deepseek-v2-lite's 31 GB are GPU work): the engine
    starts and answers token ids."""
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with LLM("deepseek-tiny", load_format="dummy", device="cpu", max_total_tokens=512) as llm:
        out = llm.generate([[5, 6, 7, 8, 9]], [params])
        llm.client.check_pages()
    assert len(out[0].token_ids) == 4
