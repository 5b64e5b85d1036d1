"""Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5 dense and MoE): greedy ids equal transformers fp32 token for token on
tiny random checkpoints -- prompts longer than a prefill chunk, the prompts cached (the linear layers' state restored
from the radix cache's snapshots), a long prefix shared -- at page sizes 1 and 4; n = 2 choices equal two requests;
state slots come back after a finish and an abort; n-gram speculation gives the plain answer (states advance over
accepted drafts only); TP 2 = TP 1; overlap scheduling; the memory a request holds against a full-attention model's;
a TP size that splits a key head refused; and a negative control per feature (decay, output gates)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from conftest import save_checkpoint
from test_hf_parity import EXACT, hf_greedy

from minisgl_cli import LLM, SamplingParams
from minisgl_cli.types import GenerateRequest

N_NEW = 16
CHUNK = 12  # max_prefill_tokens: the long prompts run in several chunks, the state carried across them

TINY_HYBRID = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
FAMILIES = {  # (transformers' config class, model class, its fields beyond TINY_HYBRID)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", MOE),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", MOE),
}


def make_hybrid(family: str, out: Path, tokenizer_from: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random hybrid saved with save_pretrained beside the default model's tokenizer: 3 Gated DeltaNet layers
    and one gated full-attention layer, every weight drawn (the (1 + w) norms, A_log, dt_bias too)."""
    import transformers

    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_cls)(**{**TINY_HYBRID, **extra, **overrides}, eos_token_id=2, bos_token_id=1)
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv1d" in name:
                p.normal_(0, 0.5)  # a conv that mixes visibly across tokens
            elif p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "A_log" not in name:  # norms, dt_bias; A_log keeps its spread of decay rates
                p.normal_(0, 0.3)
    return save_checkpoint(model, out, tokenizer_from)


@pytest.fixture(scope="module")
def hybrid_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid")
    return {f: make_hybrid(f, root / f, tokenizer_dir) for f in FAMILIES}


def _prompts() -> list[list[int]]:
    """Short prompts, one past four prefill chunks, and three sharing a 21-token prefix."""
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 5, 13, 50)]
    prefix = torch.randint(3, 49152, (21,), generator=g).tolist()
    return ids + [prefix + torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 6, 11)]


def _ours(model_dir: Path, prompts: list[list[int]], **kw) -> tuple[list[list[int]], list[list[int]], dict]:
    """(cold, cached, stats of the cached pass): every prompt greedily, then all of them again (from the cache)."""
    params = [SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)] * len(prompts)
    with LLM(str(model_dir), attention_backend="torch", max_prefill_tokens=CHUNK, **EXACT, **kw) as llm:
        cold = [r.token_ids for r in llm.generate(prompts, params)]
        before = llm.client.stats()
        cached = [r.token_ids for r in llm.generate(prompts, params)]
        after = llm.client.stats()
        llm.client.check_pages()
    hits = {"hit_tokens": after.cache_hit_tokens - before.cache_hit_tokens, "slots_free": after.state_slots_free,
            "slots": after.state_slots_total}
    return cold, cached, hits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hybrids_greedy_match_transformers_cold_and_cached(hybrid_dirs, family):
    model_dir = hybrid_dirs[family]
    prompts = _prompts()
    theirs = hf_greedy(model_dir, prompts, N_NEW)
    assert len({tuple(t) for t in theirs}) > 1, "degenerate tiny model: outputs do not depend on the prompt"
    cold, cached, stats = _ours(model_dir, prompts)
    assert cold == theirs
    assert cached == theirs
    # the second pass started from the snapshots: all of each prompt but its last token came from the cache
    assert stats["hit_tokens"] == sum(len(p) - 1 for p in prompts)
    assert stats["slots_free"] == stats["slots"] > 0


def test_page_size_4_caches_at_page_boundaries_and_keeps_the_answers(hybrid_dirs):
    """Pages of 4: snapshots only where a chunk or request ends on a page boundary; matches cut back to them."""
    model_dir = hybrid_dirs["qwen3_5"]
    prompts = _prompts()
    cold, cached, stats = _ours(model_dir, prompts, page_size=4)
    assert cold == cached == hf_greedy(model_dir, prompts, N_NEW)
    assert stats["hit_tokens"] == sum((len(p) - 1) // 4 * 4 for p in prompts)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_overlap_scheduling_keeps_the_answers(hybrid_dirs, family):
    """Overlap (forced on the CPU): a step launched before the last one is read, a finished request's extra token
    run into its state before it is seen finished; the snapshots still cover exactly the known tokens."""
    model_dir = hybrid_dirs[family]
    prompts = _prompts()
    cold, cached, _ = _ours(model_dir, prompts, overlap_on_cpu=True)
    assert cold == cached == hf_greedy(model_dir, prompts, N_NEW)


def test_few_snapshot_slots_evict_cache_leaves_and_keep_the_answers(hybrid_dirs):
    """Two request slots, so two snapshot slots for seven prompts: each new snapshot evicts the least recently used
    leaf (its pages and its snapshot together); the answers stay transformers' and every page, slot and snapshot is
    accounted for."""
    model_dir = hybrid_dirs["qwen3_5"]
    prompts = _prompts()
    cold, cached, stats = _ours(model_dir, prompts, max_running_requests=2)
    assert cold == cached == hf_greedy(model_dir, prompts, N_NEW)
    assert stats["slots"] == 2 and stats["hit_tokens"] < sum(len(p) - 1 for p in prompts)


def test_retracted_requests_resume_from_their_state_snapshot(hybrid_dirs):
    """A KV pool too small for every running request: the newest is retracted (its KV and a snapshot of its state
    cached at its known tokens), re-queued, and resumes from there; the answers stay transformers'."""
    model_dir = hybrid_dirs["qwen3_next"]
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)] * len(prompts)
    with LLM(str(model_dir), attention_backend="torch", max_prefill_tokens=CHUNK, max_total_tokens=96,
             **EXACT) as llm:
        ours = [r.token_ids for r in llm.generate(prompts, params)]
        s = llm.client.stats()
        llm.client.check_pages()
    assert s.retracted_requests > 0
    assert ours == hf_greedy(model_dir, prompts, N_NEW)


def test_shared_prefix_restores_the_state_of_its_snapshot(hybrid_dirs):
    """A request sharing a long prefix with an earlier one starts from the earlier one's snapshot at a chunk end
    inside that prefix, and answers as it would cold."""
    model_dir = hybrid_dirs["qwen3_next"]
    prompts = _prompts()[4:]  # 21 shared tokens + 1 / 6 / 11
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    with LLM(str(model_dir), attention_backend="torch", max_prefill_tokens=CHUNK, **EXACT) as llm:
        first = llm.generate(prompts[0], params)[0]
        rest = llm.generate(prompts[1:], [params] * 2)
        llm.client.check_pages()
    assert first.stats.cached_tokens == 0
    assert [r.stats.cached_tokens for r in rest] == [21, 21]  # the first request's snapshot after its 21st token
    assert [first.token_ids] + [r.token_ids for r in rest] == hf_greedy(model_dir, prompts, N_NEW)


def test_n_2_choices_equal_two_separate_requests(hybrid_dirs):
    """Two choices of one prompt: the second starts from the state the first left in the cache (all but the last
    token), and both give the tokens one request alone gives."""
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.messages import AddRequest
    from minisgl_cli.scheduler.scheduler import Scheduler, SchedulerConfig

    model_dir = hybrid_dirs["qwen3_5_moe"]
    ids = _prompts()[3]
    outs: dict[str, list[int]] = {}

    def sink(msg):
        for o in msg.outputs:
            if o.token_id is not None:
                outs.setdefault(o.rid, []).append(o.token_id)

    sched = Scheduler(Engine(EngineConfig(model=str(model_dir), attention_backend="torch", max_total_tokens=4096,
                                          **EXACT)), SchedulerConfig(max_prefill_tokens=CHUNK), sink)
    for i in range(2):  # in the inbox together, as a request with n = 2 puts them
        sched.handle(AddRequest(f"c{i}", ids, SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)))
    while sched.waiting or sched.running or sched._inflight:
        sched.step()
    assert sched.snapshot().cache_hit_tokens == len(ids) - 1
    sched.check_pages()
    assert outs["c0"] == outs["c1"] == hf_greedy(model_dir, [ids], N_NEW)[0]


def test_state_slots_come_back_after_finish_and_abort(hybrid_dirs):
    """Slots are held while requests run (one each), and every one is free again after they finish or their
    consumer walks away midway; pages and snapshots stay exactly accounted."""
    model_dir = hybrid_dirs["qwen3_5"]
    with LLM(str(model_dir), attention_backend="torch", max_running_requests=3, **EXACT) as llm:
        total = llm.client.stats().state_slots_total
        assert total == 3

        async def run() -> tuple[int, list[int]]:
            async def one(i: int) -> list[int]:
                req = GenerateRequest(input_ids=[7 + i] * (5 + i), params=SamplingParams(max_new_tokens=40,
                                                                                           ignore_eos=True))
                got: list[int] = []
                stream = llm.client.submit(req)
                async for delta in stream:
                    got.extend(delta.token_ids)
                    if i % 2 and len(got) >= 3:
                        await stream.aclose()  # aborted midway
                        break
                return got

            tasks = [asyncio.ensure_future(one(i)) for i in range(5)]
            await asyncio.sleep(0)
            busy = 0
            for _ in range(200):  # while they run, at most `total` hold a slot (the rest wait for one)
                s = llm.client.stats()
                busy = max(busy, s.state_slots_total - s.state_slots_free)
                assert s.state_slots_free >= 0 and s.running <= total
                if all(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.01)
            return busy, [len(t) for t in await asyncio.gather(*tasks)]

        busy, lens = asyncio.run(run())
        assert busy >= 1 and lens[0] == lens[2] == lens[4] == 40
        for _ in range(100):
            s = llm.client.stats()
            if s.running == s.waiting == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
        llm.client.check_pages()
        assert (s.state_slots_free, s.state_slots_total) == (total, total)
    from minisgl_cli.server.metrics import ServerMetrics

    prom = ServerMetrics().to_prometheus(s, "m")
    assert "minisgl_state_slots_total" in prom and "minisgl_state_slots_free" in prom


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("mode,nth,kw", [("prefill", 2, {"max_prefill_tokens": 16}), ("decode", 3, {})],
                         ids=["chunk", "decode"])
def test_a_step_failing_after_its_forward_leaves_no_state_behind(hybrid_dirs, mode, nth, kw, overlap):
    """A step that raised after its forward had updated the linear layers' states in place: its request fails, its
    slot comes back, and no snapshot of that state reaches the cache, so the same prompt and one going on from what
    the failed request got answer as cold ones."""
    from faults import StepFaults, every_nth, run

    from minisgl_cli.types import ErrorCode

    model_dir = hybrid_dirs["qwen3_5"]
    prompt = _prompts()[3]  # 50 tokens
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with LLM(str(model_dir), attention_backend="torch", overlap_on_cpu=overlap, **EXACT, **kw) as llm:
        engine = llm.client._scheduler().engine
        with StepFaults(engine, every_nth(nth, mode), after_forward=True, limit=1) as faults:
            failed = run(llm.client, prompt, params)
        assert faults.raised == 1 and failed.error_code is ErrorCode.ENGINE_FAILED
        llm.client.check_pages()
        s = llm.client.stats()
        assert s.state_slots_free == s.state_slots_total
        turn = prompt + failed.token_ids + [7, 8, 9]
        assert [run(llm.client, ids, params).token_ids for ids in (prompt, turn)] == hf_greedy(model_dir,
                                                                                                [prompt, turn], 8)
        llm.client.check_pages()


def test_an_uneven_tp_is_refused_in_one_line(hybrid_dirs):
    from minisgl_cli.distributed import TPInfo
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine

    with pytest.raises(ValueError) as err:  # 2 key heads do not split over 4 ranks
        Engine(EngineConfig(model=str(hybrid_dirs["qwen3_5"]), max_total_tokens=256), TPInfo(0, 4))
    assert "--tp 4 must divide the 2 linear-attention key heads" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("family,rollback", [("qwen3_next", True), ("qwen3_5_moe", True), ("qwen3_next", False)])
def test_ngram_speculation_gives_the_plain_greedy_answer(tmp_path_factory, tokenizer_dir, monkeypatch, family,
                                                         rollback):
    """Prompt lookup drafts (a 64-token vocabulary: the tiny model repeats itself, so some drafts are accepted and
    more rejected): verify steps run each request's drafts as extra rows; the linear layers' states advance over the
    accepted rows only (rejected drafts never enter them), so the answers equal transformers' greedy ones. The
    negative control (`rollback` off: the states advance over every row, drafts rejected or not) differs."""
    from minisgl_cli.attention import gated_delta

    if not rollback:
        for name in ("commit", "conv_commit"):
            orig = getattr(gated_delta, name)
            if name == "commit":
                monkeypatch.setattr(gated_delta, name, lambda x, ssm, slots, runs, accepted, fused, _o=orig:
                                    _o(x, ssm, slots, runs, runs, fused))
            else:
                monkeypatch.setattr(gated_delta, name, lambda conv, slots, seq, runs, accepted, _o=orig:
                                    _o(conv, slots, seq, runs, runs))
    model_dir = make_hybrid(family, tmp_path_factory.mktemp("spec") / family, tokenizer_dir, vocab_size=64)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 64, (n,), generator=g).tolist() for n in (4, 7, 10, 30, 50)]
    params = [SamplingParams(max_new_tokens=32, ignore_eos=True)] * len(prompts)
    with LLM(str(model_dir), attention_backend="torch", max_prefill_tokens=CHUNK, speculative_algorithm="ngram",
             num_speculative_tokens=3, **EXACT) as llm:
        ours = [r.token_ids for r in llm.generate(prompts, params)]
        s = llm.client.stats()
        llm.client.check_pages()
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens
    assert (ours == hf_greedy(model_dir, prompts, 32)) == rollback


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_tp_2_gives_the_tp_1_answers(hybrid_dirs, family):
    """TP 2 over gloo: each rank one key head of every linear layer (two value heads), one KV head of the full
    attention, half of every expert, its own state slots; cold and cached as transformers."""
    model_dir = hybrid_dirs[family]
    prompts = _prompts()
    cold, cached, _ = _ours(model_dir, prompts, tp_size=2, device="cpu")
    assert cold == cached == hf_greedy(model_dir, prompts, N_NEW)


def _switched_off(monkeypatch, feature: str) -> None:
    """Our engine with one feature dropped: `decay` (g = 0: the DeltaNet state never forgets), `gate` (the DeltaNet
    output's SiLU(z) gate), `attn_gate` (the full attention's sigmoid output gate)."""
    from minisgl_cli.attention import gated_delta
    from minisgl_cli.models import qwen3_next

    if feature == "decay":
        for name in ("prefill", "decode"):
            orig = getattr(gated_delta, name)
            monkeypatch.setattr(gated_delta, name,
                                lambda q, k, v, g, *a, _orig=orig: _orig(q, k, v, torch.zeros_like(g), *a))
    elif feature == "gate":
        norm = qwen3_next.GatedRMSNorm.forward
        monkeypatch.setattr(qwen3_next.GatedRMSNorm, "forward",
                            lambda self, x, z, dtype: norm(self, x, torch.full_like(z, 60.0), dtype) / 60.0)
    else:
        monkeypatch.setattr(torch, "sigmoid", lambda x: torch.ones_like(x))


@pytest.mark.parametrize("feature", ["decay", "gate", "attn_gate"])
def test_each_feature_switched_off_changes_the_answers(hybrid_dirs, monkeypatch, feature):
    """The negative control: the parity test above fails with the decay or either output gate dropped."""
    model_dir = hybrid_dirs["qwen3_5"]
    prompts = _prompts()[:4]
    theirs = hf_greedy(model_dir, prompts, N_NEW)
    _switched_off(monkeypatch, feature)
    params = [SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)] * len(prompts)
    with LLM(str(model_dir), attention_backend="torch", **EXACT) as llm:
        ours = [r.token_ids for r in llm.generate(prompts, params)]
    assert ours != theirs


def test_a_request_s_state_is_a_fraction_of_full_attention_kv_at_32k():
    """The engine's own accounting (kvcache/state.py's slot, kvcache/pool.py's KV per token) at 32k tokens: a
    hybrid's request holds a quarter of the KV layers plus one fixed state, far less than the same model with every
    layer attending."""
    from minisgl_cli.kvcache.pool import KVShape
    from minisgl_cli.loader.configs import builtin_config
    from minisgl_cli.models import ModelConfig
    from minisgl_cli.models.qwen3_next import state_shape

    tokens, dt = 32768, torch.bfloat16
    for name in ("qwen3.5-9b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"):
        mc = ModelConfig.from_hf(builtin_config(name))
        full = KVShape(mc.num_layers, mc.num_kv_heads, mc.head_dim, dt).bytes_per_token() * tokens
        kv = KVShape(len(mc.kv_layers), mc.num_kv_heads, mc.head_dim, dt).bytes_per_token() * tokens
        state = state_shape(mc, dt).bytes_per_slot()
        assert len(mc.kv_layers) * 4 == mc.num_layers
        assert kv * 4 == full and kv + state < full / 2
        print(f"{name}: full attention {full / 2**20:.0f} MiB, hybrid {kv / 2**20:.0f} MiB KV + "
              f"{state / 2**20:.1f} MiB state = {(kv + state) / full:.1%}")


def test_a_padded_decode_row_leaves_live_states_alone(hybrid_dirs):
    """A captured decode graph pads its batch with rows whose KV slot is the scratch slot 0, their page-table row
    whatever an earlier replay left there (a live request's): such a row updates the scratch state slot only, so the
    live request's logits and state are those of the batch without it."""
    from minisgl_cli.engine.batch import ForwardBatch
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(hybrid_dirs["qwen3_next"]), max_total_tokens=2048,
                                 attention_backend="torch", **EXACT))
    assert engine.state is not None
    row = engine.alloc_req_row()
    assert row is not None and engine.alloc_state_slot(row) is not None
    prompt = list(range(5, 25))
    n = len(prompt)
    engine.pool.page_table[row, : n + 1] = torch.arange(1, n + 2, dtype=torch.int32)
    engine.forward(ForwardBatch.build("prefill", prompt, [row], [0], [n], list(range(1, n + 1)), engine.device,
                                      engine.host))
    before = [t.clone() for t in engine.state.conv + engine.state.ssm]

    def decode(rows: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for t, b in zip(engine.state.conv + engine.state.ssm, before):
            t.copy_(b)
        fb = ForwardBatch.build("decode", [7] + [0] * (rows - 1), [row] * rows, [n] + [0] * (rows - 1), [1] * rows,
                                [n + 1] + [0] * (rows - 1), engine.device, engine.host)
        logits = engine.forward(fb)[0]
        slot = int(engine.state.slot_of_row[row])
        return logits, [t[slot].clone() for t in engine.state.conv + engine.state.ssm]

    alone, state_alone = decode(1)
    padded, state_padded = decode(3)  # equal up to a GEMM's rounding over 3 rows instead of 1
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-4)
    for a, b in zip(state_padded, state_alone):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert not all(torch.equal(a, b[int(engine.state.slot_of_row[row])]) for a, b in zip(state_alone, before))


def test_a_batched_prefill_equals_each_request_decoded_token_by_token():
    """The extend step's gated delta rule and causal conv run every request at once (chunks padded, the state carried
    over all of them together, one conv over the packed rows): on requests of 1, C, C + 1 and 3 C + 5 tokens (C the
    rule's chunk) from nonzero states in scattered slots, each request's outputs and final states are those of its
    tokens decoded one at a time (the one-step update, the definition), and those of a prefill of it alone."""
    from minisgl_cli.attention import gated_delta as gd

    c = gd.CHUNK
    lens, slots = [1, c, c + 1, 3 * c + 5], torch.tensor([5, 0, 3, 2])
    g = torch.Generator().manual_seed(3)
    T, Hk, H, K, V, C, W = sum(lens), 2, 4, 16, 8, 24, 3  # C conv channels, W = kernel - 1 conv state columns
    q, k, v = torch.randn(T, Hk, K, generator=g), torch.randn(T, Hk, K, generator=g), torch.randn(T, H, V, generator=g)
    decay, beta = -torch.rand(T, H, generator=g) * 0.5, torch.rand(T, H, generator=g)
    x, weight = torch.randn(T, C, generator=g), torch.randn(C, W + 1, generator=g) * 0.5
    ssm0, conv0 = torch.randn(6, H, K, V, generator=g) * 0.3, torch.randn(6, C, W, generator=g)

    ssm, conv = ssm0.clone(), conv0.clone()
    o, y = gd.prefill(q, k, v, decay, beta, ssm, slots, lens, batched=True), gd.conv_prefill(x, weight, conv, slots,
                                                                                               lens)
    ssm3 = ssm0.clone()  # the CPU's default: request after request
    torch.testing.assert_close(gd.prefill(q, k, v, decay, beta, ssm3, slots, lens), o, rtol=0, atol=1e-5)
    torch.testing.assert_close(ssm3, ssm, rtol=0, atol=1e-5)
    ssm1, conv1 = ssm0.clone(), conv0.clone()  # each request alone: one token at a time, then one prefill
    ssm2, conv2 = ssm0.clone(), conv0.clone()
    o1, y1, o2, y2 = torch.empty_like(o), torch.empty_like(y), torch.empty_like(o), torch.empty_like(y)
    at = 0
    for i, n in enumerate(lens):
        slot, rows = slots[i : i + 1], slice(at, at + n)
        for t in range(at, at + n):
            row = slice(t, t + 1)
            o1[row] = gd.decode(q[row], k[row], v[row], decay[row], beta[row], ssm1, slot)
            y1[row] = gd.conv_step(x[row], weight, conv1, slot)
        o2[rows] = gd.prefill(q[rows], k[rows], v[rows], decay[rows], beta[rows], ssm2, slot, [n])
        y2[rows] = gd.conv_prefill(x[rows], weight, conv2, slot, [n])
        at += n
    for ours, alone in ((o, o2), (ssm, ssm2), (y, y2), (conv, conv2), (o, o1), (ssm, ssm1), (y, y1), (conv, conv1)):
        torch.testing.assert_close(ours, alone, rtol=0, atol=1e-5)
    assert not torch.equal(ssm[slots], ssm0[slots]) and torch.equal(ssm[1], ssm0[1])  # a slot no request holds


def test_a_batched_verify_step_equals_decoding_its_rows_and_commits_the_accepted_only():
    """A verify step runs row j of every request at once: each row's output is that of decoding the request's rows
    one at a time, the slots stay as they were, and `commit` leaves each state after its accepted rows only."""
    from minisgl_cli.attention import gated_delta as gd

    runs, accepted, slots = [3, 1, 4, 3], [2, 1, 0, 3], torch.tensor([4, 0, 2, 5])
    g = torch.Generator().manual_seed(4)
    T, Hk, H, K, V = sum(runs), 2, 4, 16, 8
    q, k, v = torch.randn(T, Hk, K, generator=g), torch.randn(T, Hk, K, generator=g), torch.randn(T, H, V, generator=g)
    decay, beta = -torch.rand(T, H, generator=g), torch.rand(T, H, generator=g)
    ssm0 = torch.randn(6, H, K, V, generator=g) * 0.3
    ssm = ssm0.clone()
    o, inputs = gd.verify(q, k, v, decay, beta, ssm, slots, runs)
    assert torch.equal(ssm, ssm0)
    gd.commit(inputs, ssm, slots, runs, accepted)
    alone, want, at = ssm0.clone(), ssm0.clone(), 0
    for i, (n, a) in enumerate(zip(runs, accepted)):
        for t in range(at, at + n):
            row = slice(t, t + 1)
            torch.testing.assert_close(o[row], gd.decode(q[row], k[row], v[row], decay[row], beta[row], alone,
                                                         slots[i : i + 1]), rtol=0, atol=1e-6)
            if t == at + a - 1:
                want[slots[i]] = alone[slots[i]]
        at += n
    torch.testing.assert_close(ssm, want, rtol=0, atol=1e-6)
    assert torch.equal(ssm[2], ssm0[2]) and not torch.equal(ssm[5], ssm0[5])  # none accepted / three


def test_engine_holds_kv_for_full_attention_layers_only(hybrid_dirs):
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(hybrid_dirs["qwen3_next"]), max_total_tokens=512, max_running_requests=4))
    assert engine.pool.shape.num_layers == 1 and len(engine.pool.k) == 1  # layer 3 of 4
    assert engine.state is not None and engine.state.shape.num_layers == 3
    assert (engine.spec.num_state_slots, engine.spec.num_state_snapshots) == (4, 4)


@pytest.mark.parametrize("name", ["qwen3.5-9b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"])
def test_builtin_hybrid_configs_have_their_layer_patterns(name):
    from minisgl_cli.loader.configs import builtin_config
    from minisgl_cli.models import ModelConfig

    mc = ModelConfig.from_hf(builtin_config(name))
    assert mc.linear_attn is not None and mc.rotary_dim == 64 and mc.head_dim == 256
    assert mc.kv_layers == tuple(range(3, mc.num_layers, 4))
    assert bool(mc.num_experts) == (name != "qwen3.5-9b")
    assert mc.shared_expert_intermediate_size == (0 if name == "qwen3.5-9b" else 512)


def test_qwen3_5_vision_language_checkpoint_serves_its_language_model(tmp_path, tokenizer_dir):
    """Qwen3.5's hub checkpoints are Qwen3_5ForConditionalGeneration (a vision tower beside the language model, under
    model.language_model.): the language model loads (the tower is skipped) and answers text as transformers' does."""
    import transformers

    torch.manual_seed(0)
    text = {**TINY_HYBRID, "eos_token_id": 2, "bos_token_id": 1}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  num_position_embeddings=16, patch_size=4)
    model = transformers.Qwen3_5ForConditionalGeneration(transformers.Qwen3_5Config(text_config=text,
                                                                                   vision_config=vision)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "A_log" not in name:
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tmp_path / f.name)
    prompts = _prompts()[:4]
    with torch.no_grad():
        theirs = [model.generate(torch.tensor([p]), max_new_tokens=N_NEW, do_sample=False, min_new_tokens=N_NEW,
                                 eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    params = [SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)] * len(prompts)
    with LLM(str(tmp_path), attention_backend="torch", **EXACT) as llm:
        assert [r.token_ids for r in llm.generate(prompts, params)] == theirs


@pytest.mark.parametrize("mode", [dict(quantization="int8"), dict(quantization="int4"), dict(dtype="bfloat16")],
                         ids=["int8", "int4", "bf16"])
def test_the_cpu_modes_run_a_hybrid(hybrid_dirs, mode):
    """The int4 / int8 CPU modes (linears through their low-bit copies, decode eager: no stored compiled step covers
    linear-attention layers, so --torch-compile on is refused) and bf16: every request gets its tokens, and every
    page and slot comes back."""
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine

    model_dir = str(hybrid_dirs["qwen3_5"])
    with LLM(model_dir, max_total_tokens=1024, **mode) as llm:
        out = llm.generate(_prompts()[:4], SamplingParams(max_new_tokens=6, ignore_eos=True))
        llm.client.check_pages()
    assert [len(c.token_ids) for c in out] == [6] * 4
    if "quantization" in mode:
        with pytest.raises(ValueError, match="--torch-compile on"):
            Engine(EngineConfig(model=model_dir, torch_compile="on", max_total_tokens=256, **mode))


def test_smoke_runs_on_dummy_weights_of_a_tiny_hybrid(hybrid_dirs):
    from typer.testing import CliRunner

    from minisgl_cli.app import app

    result = CliRunner().invoke(app, ["smoke", "hi", "--model", str(hybrid_dirs["qwen3_5_moe"]), "--load-format",
                                      "dummy", "--max-new-tokens", "4", "--raw"])
    assert result.exit_code == 0, result.output
    assert "generated_tokens=4" in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: fla-core's Triton ops and CUDA graphs")
@pytest.mark.parametrize("path", ["fla", "torch"])
def test_hybrids_on_cuda_match_transformers(hybrid_dirs, monkeypatch, path):
    """The CUDA path in the exact mode, decode under CUDA graphs: the gated delta rule through the torch reference
    on the GPU (the default) gives transformers' fp32 tokens; fla-core's ops (`pip install .[fla]`, MINISGL_FLA=1)
    are not exact in fp32 (their chunk kernels round inside: on an H200 Qwen3-Next's answer left transformers' at its
    third token), so there the cached answer equals the cold one and each first token equals transformers'."""
    from minisgl_cli.attention import gated_delta

    if path == "fla" and gated_delta._fla() is None:
        pytest.skip("fla-core is not installed")
    monkeypatch.setenv("MINISGL_FLA", "1" if path == "fla" else "0")
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)] * len(prompts)
    for family in FAMILIES:
        model_dir = hybrid_dirs[family]
        with LLM(str(model_dir), max_prefill_tokens=CHUNK, device="cuda", **EXACT) as llm:
            cold = [r.token_ids for r in llm.generate(prompts, params)]
            cached = [r.token_ids for r in llm.generate(prompts, params)]
            llm.client.check_pages()
        with monkeypatch.context() as m:
            # The reference runs on the CPU in fp32: transformers would take fla-core's Triton kernels wherever fla
            # imports, CPU tensors included; its torch path is the one it takes while exporting.
            m.setattr("transformers.integrations.hub_kernels.is_torchdynamo_exporting", lambda: True)
            want = hf_greedy(model_dir, prompts, N_NEW)
        if path == "fla":
            assert cold == cached and [c[0] for c in cold] == [w[0] for w in want], family
        else:
            assert cold == cached == want, family
