"""`--speculative-algorithm mtp`: DeepSeek-V3's MTP layer as the draft source (models/mtp.py, scheduler/mtp.py), on a
tiny random V3 checkpoint that ships one MTP layer the way DeepSeek's do (decoder layer num_hidden_layers with enorm,
hnorm, eh_proj, shared_head and copies of the embedding and head).

The drafts are checked against a plain reference built from transformers' own decoder layer; the answers against
transformers' greedy ones (the verify rule keeps them whatever the drafts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_deepseek import N_NEW, _prompts, make_tiny_deepseek
from test_hf_parity import EXACT, cold_and_cached, hf_greedy

from minisgl_cli import LLM, SamplingParams
from minisgl_cli.scheduler.config import SchedulerConfig

LAYERS = 3  # the target's; the MTP layer is layer 3


def make_mtp_checkpoint(out: Path, tokenizer_dir: Path) -> Path:
    """A tiny V3 of LAYERS layers plus one MTP layer: transformers builds LAYERS + 1 layers (the last a MoE block, as
    DeepSeek's MTP block is); its config then says LAYERS and num_nextn_predict_layers 1, and the MTP layer's own
    tensors are added as DeepSeek ships them."""
    from safetensors.torch import load_file, save_file

    make_tiny_deepseek("v3", out, tokenizer_dir, num_hidden_layers=LAYERS + 1)
    [file] = out.glob("*.safetensors")
    sd = load_file(file)
    g = torch.Generator().manual_seed(7)
    h = sd["model.embed_tokens.weight"].shape[1]
    p = f"model.layers.{LAYERS}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        sd[f"{p}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    sd[f"{p}eh_proj.weight"] = 0.08 * torch.randn(h, 2 * h, generator=g)
    sd[f"{p}embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()
    sd[f"{p}shared_head.head.weight"] = sd["lm_head.weight"].clone()
    save_file(sd, file, metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return make_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "v3", tokenizer_dir)


def make_hybrid_mtp_checkpoint(family: str, out: Path, tokenizer_dir: Path) -> Path:
    """A tiny Qwen3-Next / Qwen3.5 hybrid (test_hybrid's: 3 linear layers, one full) plus one MTP layer as those ship
    it: transformers builds a fifth, full-attention layer, saved as mtp.layers.0 beside mtp.fc, the two pre-fc norms
    and mtp.norm. The five-layer checkpoint stays beside it (`<out>-whole`), for the reference's block."""
    from safetensors.torch import load_file, save_file
    from test_hybrid import make_hybrid

    types = ["linear_attention"] * 3 + ["full_attention"] * 2
    make_hybrid(family, out, tokenizer_dir, num_hidden_layers=5, layer_types=types)
    shutil.copytree(out, out.with_name(f"{out.name}-whole"))
    [file] = out.glob("*.safetensors")
    sd = {(f"mtp.layers.0.{k.removeprefix('model.layers.4.')}" if k.startswith("model.layers.4.") else k): v
          for k, v in load_file(file).items()}
    g = torch.Generator().manual_seed(7)
    h = sd["model.embed_tokens.weight"].shape[1]
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sd[f"mtp.{norm}.weight"] = 0.3 * torch.randn(h, generator=g)  # (1 + w) norms
    sd["mtp.fc.weight"] = 0.08 * torch.randn(h, 2 * h, generator=g)
    save_file(sd, file, metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(num_hidden_layers=4, layer_types=types[:4], mtp_num_hidden_layers=1)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def hybrid_mtp_dirs(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid-mtp")
    return {f: make_hybrid_mtp_checkpoint(f, root / f, tokenizer_dir) for f in ("qwen3_next", "qwen3_5")}


@pytest.fixture(scope="module")
def narrow_mtp_dir(mtp_dir, tmp_path_factory) -> Path:
    """The MTP checkpoint with a head that names 4 tokens (the other rows zero): the target's answers and the MTP
    layer's guesses then come from one small alphabet, so drafts are accepted often (runs of several), by chance."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("narrow") / "v3"
    shutil.copytree(mtp_dir, out)
    [file] = out.glob("*.safetensors")
    sd = load_file(file)
    for name in ("lm_head.weight", f"model.layers.{LAYERS}.shared_head.head.weight"):
        sd[name][4:] = 0
    save_file(sd, file, metadata={"format": "pt"})
    return out


class Reference:
    """The MTP layer in plain torch around transformers' decoder layer: row q takes token q + 1 and state h_q. DeepSeek
    (`model.layers.LAYERS.*`, plain norms, the block's output chained) or a Qwen hybrid (`mtp.*`, (1 + w) norms, the
    normed output chained)."""

    def __init__(self, model_dir: Path):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        [file] = model_dir.glob("*.safetensors")
        sd = {k: v.float() for k, v in load_file(file).items()}
        self.qwen = "mtp.fc.weight" in sd
        if self.qwen:  # the MTP block as transformers' fifth layer (make_hybrid_mtp_checkpoint)
            whole = AutoModelForCausalLM.from_pretrained(model_dir.with_name(f"{model_dir.name}-whole"),
                                                         dtype=torch.float32).eval()
            block = whole.model.layers[4]
            names = {"fc": "mtp.fc", "enorm": "mtp.pre_fc_norm_embedding", "hnorm": "mtp.pre_fc_norm_hidden",
                     "norm": "mtp.norm"}
        else:
            whole = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                         num_hidden_layers=LAYERS + 1).eval()
            block = whole.model.layers[LAYERS]
            p = f"model.layers.{LAYERS}."
            names = {"fc": f"{p}eh_proj", "enorm": f"{p}enorm", "hnorm": f"{p}hnorm", "norm": f"{p}shared_head.norm"}
        self.block, self.rotary = block, whole.model.rotary_emb
        self.w = {ours: sd[f"{theirs}.weight"] for ours, theirs in names.items()}
        self.eps = self.target.config.rms_norm_eps

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * (1 + self.w[name] if self.qwen else self.w[name])

    @torch.no_grad()
    def states(self, ids: list[int]) -> torch.Tensor:
        """The target's final (normed) hidden state at each position of `ids`."""
        return self.target.model(torch.tensor([ids])).last_hidden_state[0]

    @torch.no_grad()
    def rows(self, tokens: list[int], states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(what the next row takes, logits) of MTP rows at positions 0.. with these tokens and states, causally."""
        e = self._norm(self.target.model.embed_tokens(torch.tensor([tokens])), "enorm")
        x = torch.cat((e, self._norm(states[None], "hnorm")), -1) @ self.w["fc"].T
        n = len(tokens)
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        # Qwen3.5's rotary is multimodal: transformers releases differ on whether it takes (bs, n) ids or (3, bs, n)
        rot_pos = pos.expand(3, -1, -1) if hasattr(self.rotary, "mrope_section") else pos
        out = self.block(x, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(x, rot_pos))
        out = (out[0] if isinstance(out, tuple) else out)[0]
        normed = self._norm(out, "norm")
        return (normed if self.qwen else out), self.target.lm_head(normed)

    def drafts(self, ids: list[int], k: int) -> list[int]:
        """The k greedy drafts after `ids` (its last token not yet in the target's cache), chained as the proposer
        chains them: each draft and the last row's output become the next row."""
        states, tokens = self.states(ids[:-1]), ids[1:]
        out: list[int] = []
        for _ in range(k):
            o, logits = self.rows(tokens, states)
            out.append(int(logits[-1].argmax()))
            tokens, states = tokens + [out[-1]], torch.cat((states, o[-1:]))
        return out


def _recorded_drafts(model_dir: Path, prompts: list[list[int]], monkeypatch, **kw) -> list[tuple[list[int], list[int]]]:
    """Every non-empty proposal (the request's tokens then, the drafts) of greedy runs of `prompts` with mtp."""
    from minisgl_cli.scheduler.mtp import MtpProposer

    seen: list[tuple[list[int], list[int]]] = []
    propose = MtpProposer.propose

    def recording(self, reqs, budgets):
        out = propose(self, reqs, budgets)
        seen.extend((list(r.all_ids), d) for r, d in zip(reqs, out) if d)
        return out

    monkeypatch.setattr(MtpProposer, "propose", recording)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with LLM(str(model_dir), speculative_algorithm="mtp", num_speculative_tokens=3, **{**EXACT, **kw}) as llm:
        llm.generate(prompts, [params] * len(prompts))
        llm.client.check_pages()
    assert len(seen) >= len(prompts)
    return seen


@pytest.mark.parametrize("flush", [512, 3])
def test_the_proposers_drafts_are_the_mtp_layers_as_a_reference_computes_them(mtp_dir, monkeypatch, flush):
    """Every proposal a request got (from its prompt's rows, then from the rows of the decode and verify steps) equals
    the reference's chain over the same tokens; `flush` 3: a prompt's rows written as its chunks come, in several
    extends before its first proposal."""
    from minisgl_cli.scheduler import mtp

    monkeypatch.setattr(mtp, "FLUSH_ROWS", flush)
    ref = Reference(mtp_dir)
    for ids, drafts in _recorded_drafts(mtp_dir, _prompts()[:4], monkeypatch, attention_backend="torch",
                                        max_prefill_tokens=12):
        assert drafts == ref.drafts(ids, len(drafts)), ids


def test_accepted_drafts_hand_over_their_rows_and_the_next_drafts_follow_from_them(narrow_mtp_dir, monkeypatch):
    """Drafts accepted (8 of 30 here): the verify step's kept rows become MTP rows, and every later proposal is
    still the reference's chain; the answers are transformers'."""
    prompts = _prompts()[:4]
    ref = Reference(narrow_mtp_dir)
    seen = _recorded_drafts(narrow_mtp_dir, prompts, monkeypatch, attention_backend="torch", max_prefill_tokens=12)
    for ids, drafts in seen:
        assert drafts == ref.drafts(ids, len(drafts)), ids
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    with LLM(str(narrow_mtp_dir), attention_backend="torch", speculative_algorithm="mtp", num_speculative_tokens=3,
             **EXACT) as llm:
        got = [r.token_ids for r in llm.generate(prompts, [params] * len(prompts))]
        stats = llm.client.stats()
    assert got == hf_greedy(narrow_mtp_dir, prompts, N_NEW)
    assert stats.spec_accepted_tokens >= len(prompts), stats


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_hybrid_mtp_drafts_as_the_reference_and_keeps_the_greedy_answers(hybrid_mtp_dirs, monkeypatch, family):
    """Qwen3-Next (MoE) and Qwen3.5 (dense): the mtp.* layer drafts as the reference computes it (the normed output
    chained), and the answers stay transformers', cold and cached (the linear layers' states over accepted drafts
    only)."""
    from test_hybrid import CHUNK
    from test_hybrid import _prompts as hybrid_prompts

    model_dir = hybrid_mtp_dirs[family]
    prompts = hybrid_prompts()
    ref = Reference(model_dir)
    for ids, drafts in _recorded_drafts(model_dir, prompts[1:4], monkeypatch, attention_backend="torch"):
        assert drafts == ref.drafts(ids, len(drafts)), ids
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    with LLM(str(model_dir), attention_backend="torch", max_prefill_tokens=CHUNK, speculative_algorithm="mtp",
             **EXACT) as llm:
        cold = [r.token_ids for r in llm.generate(prompts, [params] * len(prompts))]
        cached = [r.token_ids for r in llm.generate(prompts, [params] * len(prompts))]
        llm.client.check_pages()
    assert cold == cached == hf_greedy(model_dir, prompts, N_NEW)


@pytest.mark.parametrize("overlap", [False, True])
def test_mtp_speculation_keeps_the_greedy_answers_cold_and_cached(mtp_dir, overlap):
    """Greedy answers equal transformers' (the target alone), cold and from the radix cache (a cached prefix's MTP rows
    start after it), chunked prompts included; with overlap scheduling (forced on the CPU) too, whose plain steps
    between paused drafts hand their rows over a step late."""
    prompts = _prompts()
    theirs = hf_greedy(mtp_dir, prompts, N_NEW)
    cold, cached = cold_and_cached(mtp_dir, prompts, N_NEW, speculative_algorithm="mtp", num_speculative_tokens=2,
                                   overlap_on_cpu=overlap)
    assert cold == theirs
    assert cached == theirs


def test_mtp_sampled_and_forked_requests_draw_what_they_draw_without_it(mtp_dir):
    """A seeded sampled request draws the very tokens it draws without speculation; n = 2 copies of a prompt (the
    second's prefix from the cache) both answer; the stats count the drafts."""
    prompts = _prompts()[:2]
    sampled = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, temperature=0.8, seed=11)
    greedy = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    results = []
    for kw in ({}, dict(speculative_algorithm="mtp")):
        with LLM(str(mtp_dir), attention_backend="torch", **EXACT, **kw) as llm:
            out = llm.generate([*prompts, prompts[1], prompts[1]], [sampled, sampled, greedy, greedy])
            stats = llm.client.stats()
            llm.client.check_pages()
        results.append(([r.token_ids for r in out], stats))
    (plain, _), (spec, stats) = results
    assert spec == plain
    assert spec[2] == spec[3]
    assert stats.spec_draft_tokens > 0 and stats.spec_verifies > 0


def test_models_without_an_mtp_layer_and_misused_flags_are_refused_in_one_line(tokenizer_dir, tmp_path):
    """A config without num_nextn_predict_layers; one that names an MTP layer its weights lack (transformers' own
    DeepseekV3Config says 1 by default); the draft model's and n-gram's flags beside mtp."""
    none = make_tiny_deepseek("v3", tmp_path / "none", tokenizer_dir, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="no MTP layer to draft with: its config has no num_nextn_predict_layers"):
        LLM(str(none), attention_backend="torch", speculative_algorithm="mtp", **EXACT)
    unshipped = make_tiny_deepseek("v3", tmp_path / "unshipped", tokenizer_dir)
    assert json.loads((unshipped / "config.json").read_text()).get("num_nextn_predict_layers") == 1
    with pytest.raises(ValueError, match="the checkpoint lacks its MTP layer's weights"):
        LLM(str(unshipped), attention_backend="torch", speculative_algorithm="mtp", **EXACT)
    with pytest.raises(ValueError, match="--speculative-draft-model"):
        SchedulerConfig(speculative_algorithm="mtp", speculative_draft_model="x")
    with pytest.raises(ValueError, match="ngram does not use them|drop --prompt-lookup-min"):
        SchedulerConfig(speculative_algorithm="mtp", prompt_lookup_min=2)


@pytest.mark.parametrize("name", ["deepseek-v3-5layer", "qwen3.5-9b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b"])
def test_the_builtin_configs_dummy_mtp_layer_has_the_shapes_the_layer_takes(name):
    """`--load-format dummy` with mtp on a built-in config (the GPU benchmarks' way): the layer's random tensors load
    into the module of its one-layer config (shapes only, on the meta device): a Qwen hybrid's attention keeps its
    gate though that config has no linear layer."""
    import itertools

    from minisgl_cli.distributed import TPInfo
    from minisgl_cli.layers.kernel_choice import Kernels
    from minisgl_cli.layers.quant import METHODS
    from minisgl_cli.loader.configs import builtin_config
    from minisgl_cli.models import ModelConfig
    from minisgl_cli.models.dummy import dummy_checkpoint
    from minisgl_cli.models.mtp import create_mtp_model, dummy_extras, mtp_config

    mc = ModelConfig.from_hf(mtp_config(builtin_config(name)))
    meta = torch.device("meta")
    with meta:
        model = create_mtp_model(mc, TPInfo(), Kernels(), METHODS["none"]())
    model.load_weights(itertools.chain(dummy_checkpoint(mc, meta, torch.bfloat16),
                                       dummy_extras(mc.hidden_size, meta, torch.bfloat16, seed=0)))
    assert model.eh_proj.weight.shape == (mc.hidden_size, 2 * mc.hidden_size)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["deepseek", "qwen3_5"])
def test_mtp_on_cuda_answers_as_transformers_and_drafts_as_the_reference(mtp_dir, hybrid_mtp_dirs, monkeypatch,
                                                                         family):
    """The CUDA path in the exact mode (fp32). DeepSeek: its experts run eagerly there, outside graphs; the MTP
    engine's decode rows go through the Triton MLA kernel. Qwen3.5 (dense): the target's decode graphs copy out each
    row's hidden state, and the MTP engine's chained rows replay graphs that take one. Answers and drafts as on the
    CPU."""
    model_dir = mtp_dir if family == "deepseek" else hybrid_mtp_dirs[family]
    prompts = _prompts()
    ref = Reference(model_dir)
    for ids, drafts in _recorded_drafts(model_dir, prompts[:3], monkeypatch, device="cuda")[:8]:
        assert drafts == ref.drafts(ids, len(drafts)), ids
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    with LLM(str(model_dir), max_prefill_tokens=12, device="cuda", speculative_algorithm="mtp", **EXACT) as llm:
        got = [r.token_ids for r in llm.generate(prompts, [params] * len(prompts))]
        llm.client.check_pages()
    assert got == hf_greedy(model_dir, prompts, N_NEW)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_graphs_keep_the_hidden_states_the_eager_forward_keeps(tiny_model_dirs):
    """keep_hidden_states: a decode step replayed from the graphs hands back each row's hidden state (a copy: the next
    replay leaves it), the same the eager forward keeps for the same rows."""
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.scheduler.cache import CacheManager
    from minisgl_cli.scheduler.request import Req

    engine = Engine(EngineConfig(model=str(tiny_model_dirs["llama"]), dtype="float32", device="cuda",
                                 max_running_requests=4))
    assert engine.graphs is not None
    engine.keep_hidden_states()
    cache = CacheManager(engine, "naive")
    reqs = [Req(f"r{i}", [5 + i, 9, 11, 13], SamplingParams()) for i in range(3)]

    def step(mode: str, graphs: bool) -> torch.Tensor:
        ids, rows, starts, lens, locs = [], [], [], [], []
        for r in reqs:
            new = r.input_ids if mode == "prefill" else [17]
            assert cache.reserve(r, len(new))
            start = r.kv_len
            r.kv_len += len(new)
            ids += new
            rows.append(r.req_row)
            starts.append(start)
            lens.append(len(new))
            locs += cache.slots(r, start, r.kv_len)
        batch = engine.build_batch(mode, ids, rows, starts, lens, locs)
        cache.write_rows(batch, locs)
        saved, engine.graphs = engine.graphs, engine.graphs if graphs else None
        try:
            engine.forward(batch)
        finally:
            engine.graphs = saved
        assert batch.hidden is not None and batch.hidden.shape[0] == len(ids)
        return batch.hidden

    for r in reqs:
        assert cache.attach(r)
    prefill = step("prefill", graphs=False)
    assert prefill.shape[0] == 12  # every prompt row, not only each request's last
    replayed = step("decode", graphs=True).clone()
    for r in reqs:  # the same decode rows again, eagerly (their KV slots rewritten with the same values)
        r.kv_len -= 1
        cache.rewind(r)
    eager = step("decode", graphs=False)
    torch.testing.assert_close(replayed, eager)


def test_the_cli_refuses_mtp_in_one_line_at_tp_2_and_on_a_model_without_it(tiny_model_dirs):
    """`chat --speculative-algorithm mtp`: at --tp 2 (each rank would draft alone), and on a Llama (no MTP layer): a
    one-line message, a non-zero exit."""
    from typer.testing import CliRunner

    from minisgl_cli.app import app

    runner = CliRunner()
    result = runner.invoke(app, ["chat", "--model", "deepseek-tiny", "--load-format", "dummy",
                                 "--speculative-algorithm", "mtp", "--tp", "2", "--device", "cpu"])
    assert result.exit_code != 0 and "--speculative-algorithm mtp runs at --tp 1" in result.output
    result = runner.invoke(app, ["chat", "--model", str(tiny_model_dirs["llama"]), "--speculative-algorithm", "mtp",
                                 "--device", "cpu"])
    assert result.exit_code != 0 and "has no MTP layer to draft with" in result.output
    assert "Traceback" not in result.output
