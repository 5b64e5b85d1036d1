"""Speculative decoding's verify steps (scheduler/speculative.py): a decode step carrying draft tokens gives exactly the
tokens decoding gives without them -- greedy and seeded sampled, with penalties, logit bias, logprobs, stop strings,
max_tokens and a JSON-schema grammar -- in the default CPU mode (int4) and the exact one, and holds no page of a
rejected draft afterwards. The drafts here come from an oracle that replays the answer without speculation and spoils
some of it, so every step accepts a part of what it proposes."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from minisgl_cli import LLM, SamplingParams
from minisgl_cli.bench.workloads import CHAT_PROMPTS
from minisgl_cli.engine.host import HostBuffers
from minisgl_cli.sampling.sampler import create_sampler, sample
from minisgl_cli.sampling.state import SamplingState
from minisgl_cli.scheduler import speculative
from minisgl_cli.scheduler.ngram import NgramIndex
from minisgl_cli.scheduler.request import MAX_WAIT, DraftBudget
from minisgl_cli.scheduler.speculative import accepted_run
from minisgl_cli.types import GenerateRequest

CHATS = [[{"role": "user", "content": p}] for p in (
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
    "Explain what a KV cache is in one sentence.")]
EXACT = dict(dtype="float32", quantization="none", deterministic=True)


class Oracle:
    """Proposes what the answer without speculation said next, every `spoil`-th proposal with one token wrong."""

    name = "oracle"
    free = True

    def __init__(self, answers: dict[tuple[int, ...], list[int]], spoil: int = 3):
        self.answers, self.spoil, self.calls, self.released = answers, spoil, 0, 0

    def propose(self, reqs, budgets):
        out = []
        for req, n in zip(reqs, budgets):
            done = len(req.output_ids)
            d = list(self.answers.get(tuple(req.input_ids), [])[done : done + n])
            self.calls += 1
            if d and self.calls % self.spoil == 0:
                d[len(d) // 2] = (d[len(d) // 2] + 1) % 1000
            out.append(d)
        return out

    def release(self, req) -> None:
        self.released += 1

    def close(self) -> None:
        pass


def _with_oracle(monkeypatch, llm_kw: dict, prompts, params, k: int = 3):
    """(answers without speculation, answers with the oracle's drafts, the speculating engine's stats)."""
    with LLM(**llm_kw) as llm:
        plain = llm.generate(prompts, params)
        ids = [asyncio.run(llm.client.prompt(GenerateRequest(messages=p))).ids for p in prompts]
    oracle = Oracle({tuple(i): c.token_ids for i, c in zip(ids, plain)})
    monkeypatch.setattr(speculative, "create_proposer", lambda cfg, engine: oracle)
    with LLM(**llm_kw, speculative_algorithm="ngram", num_speculative_tokens=k) as llm:
        spec = llm.generate(prompts, params)
        llm.client.check_pages()
        stats = llm.client.stats()
    assert oracle.released == len(prompts)
    return plain, spec, stats


def _same(plain, spec) -> None:
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert [c.text for c in spec] == [c.text for c in plain]
    assert [c.finish_reason for c in spec] == [c.finish_reason for c in plain]
    for a, b in zip(spec, plain):  # logprobs: the same up to log_softmax's rounding at another row count
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.token_id == y.token_id and math.isclose(x.logprob, y.logprob, abs_tol=1e-4)
            assert [t.token_id for t in x.top] == [t.token_id for t in y.top]


@pytest.fixture
def invariant():
    """What keeps the default mode's plain answers themselves from depending on the timing of a concurrent run (the
    README's Models section): torch on one thread (where SDPA attends, its threads may round a row by the rows beside
    it) and no prefix reuse (a prompt whose system prompt another request cached runs its rest as another extend)."""
    threads = torch.get_num_threads()
    yield {"num_threads": 1, "cache": "naive"}
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_greedy_and_seeded_sampling_with_drafts_equal_plain_decode_in_the_default_mode(monkeypatch, invariant):
    """The int4 default: greedy rows, and sampled rows with a seed, penalties and a logit bias, draw the same tokens
    (a verify row is a decode row: same kernels, same attention, same uniform at its position)."""
    params = [
        SamplingParams(max_new_tokens=24, ignore_eos=True),
        SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, seed=5, presence_penalty=0.5, logprobs=True,
                       top_logprobs=2),
        SamplingParams(max_new_tokens=24, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.2),
        SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, top_p=0.9, seed=3, logit_bias={11: 3.0}),
    ]
    plain, spec, stats = _with_oracle(monkeypatch, invariant, CHATS, params)
    _same(plain, spec)
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # some drafts kept, some rejected
    assert stats.decode_tokens == sum(len(c.token_ids) - 1 for c in spec)
    assert stats.steps < sum(len(c.token_ids) for c in spec) // len(CHATS)  # fewer steps than tokens per request


SCHEMA = json.dumps({"type": "object", "required": ["city", "population"],
                     "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}})
PARAGRAPH = ("The lighthouse keeper climbed the stairs every evening at six, lit the lamp, and wrote the weather in "
             "his log before he ate his supper by the window.")
# Prompts whose answers repeat what they hold (prompt lookup proposes from it), with stop strings, a max_tokens cut
# inside a run, logprobs and a JSON schema.
LOOKUP = [
    ([{"role": "user", "content": f"Repeat this paragraph word for word: {PARAGRAPH}"}],
     SamplingParams(max_new_tokens=40, stop=[" supper"])),
    ([{"role": "user", "content": f"Copy this text exactly: {PARAGRAPH}"}],
     SamplingParams(max_new_tokens=13, ignore_eos=True, logprobs=True, top_logprobs=3)),
    ([{"role": "user", "content": "Give the capital of France and its population as JSON with keys city and "
                                  "population, like {\"city\": \"Paris\", \"population\": 2100000}."}],
     SamplingParams(max_new_tokens=30, json_schema=SCHEMA)),
    ([{"role": "user", "content": "Write the numbers from one to twenty in words, separated by commas."}],
     SamplingParams(max_new_tokens=40, stop=["twelve"])),
]


@pytest.fixture(scope="module")
def lookup_plain():
    with LLM(**EXACT, cache="naive") as llm:  # naive: see `invariant` below
        return llm.generate([c for c, _ in LOOKUP], [p for _, p in LOOKUP])


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 5])
def test_exact_mode_greedy_with_ngram_drafts_equals_plain_decode(lookup_plain, k):
    """--deterministic fp32, prompt lookup's drafts: token for token the plain answers, stop strings and a
    max_tokens cut inside accepted runs, logprobs at every position, the JSON schema's mask on every verify row."""
    with LLM(**EXACT, cache="naive", speculative_algorithm="ngram", num_speculative_tokens=k) as llm:
        spec = llm.generate([c for c, _ in LOOKUP], [p for _, p in LOOKUP])
        llm.client.check_pages()
        stats = llm.client.stats()
    _same(lookup_plain, spec)
    assert lookup_plain[0].finish_reason == "stop" and "supper" not in lookup_plain[0].text
    assert len(lookup_plain[1].token_ids) == 13
    assert json.loads(lookup_plain[2].text)["city"] == "Paris"
    assert lookup_plain[3].finish_reason == "stop"
    assert stats.spec_accepted_tokens > 0 and stats.spec_accept_length > 1.5


@pytest.mark.slow
def test_a_long_default_mode_answer_with_prompt_lookup_equals_plain_decode():
    """The int4 default on torch's threads, the real proposer, a 256-token code edit: every verify row attends as a
    decode row (minisgl::decode_attn; SDPA over a step's padded keys rounded them otherwise, and this answer parted
    from the plain one at its 198th token)."""
    chat = [{"role": "user", "content": CHAT_PROMPTS["code-edit"]}]
    params = SamplingParams(max_new_tokens=256, logprobs=True)
    with LLM(torch_compile="off") as llm:
        plain = llm.generate([chat], params)
    with LLM(torch_compile="off", speculative_algorithm="ngram", num_speculative_tokens=3) as llm:
        spec = llm.generate([chat], params)
        llm.client.check_pages()
        stats = llm.client.stats()
    _same(plain, spec)
    assert len(plain[0].token_ids) > 150 and stats.spec_accept_length > 2


@pytest.mark.slow
def test_overlap_scheduling_with_drafts_and_aborts_leaves_no_page_held(monkeypatch, tiny_model_dirs):
    """Overlap on (forced on the CPU): verify steps run non-overlapped, plain steps around them overlapped; 24
    concurrent requests, a third aborted midway, give the plain answers and leave every page accounted for."""
    from test_scheduler import run_concurrently, settle, workload

    work = workload(24, seed=3)
    kw = dict(model=str(tiny_model_dirs["llama"]), overlap_on_cpu=True, max_running_requests=8)
    with LLM(**kw) as llm:
        alone = asyncio.run(run_concurrently(llm, work))
    oracle = Oracle({tuple(ids): out for (ids, _), out in zip(work, alone)}, spoil=2)
    monkeypatch.setattr(speculative, "create_proposer", lambda cfg, engine: oracle)
    with LLM(**kw, speculative_algorithm="ngram", num_speculative_tokens=3) as llm:
        got = asyncio.run(run_concurrently(llm, work, abort_every=3))
        settle(llm)
        stats = llm.client.stats()
    assert sum(g is None for g in got) == 8
    assert all(g == a for g, a in zip(got, alone) if g is not None)
    assert stats.spec_accepted_tokens > 0 and stats.tokens_in_use == 0


def test_a_request_with_nothing_to_copy_asks_for_drafts_rarely(monkeypatch, tiny_model_dirs):
    """Asking for drafts reads the step in flight first (that step loses its overlap): a request whose proposer
    finds nothing backs off as after a rejected verify, so 64 tokens ask ~log2(64) times, not 64."""

    class Nothing:
        name, free, calls = "nothing", True, 0

        def propose(self, reqs, budgets):
            self.calls += 1
            return [[] for _ in reqs]

        def release(self, req) -> None:
            pass

        def close(self) -> None:
            pass

    none = Nothing()
    monkeypatch.setattr(speculative, "create_proposer", lambda cfg, engine: none)
    with LLM(model=str(tiny_model_dirs["llama"]), overlap_on_cpu=True, speculative_algorithm="ngram",
             num_speculative_tokens=3) as llm:
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=64, ignore_eos=True))[0]
        llm.client.check_pages()
    assert len(out.token_ids) == 64
    assert 1 <= none.calls <= 8, none.calls


def test_image_requests_verify_drafts_at_their_m_rope_positions(monkeypatch, tiny_vlms):
    """Qwen2-VL on the engine: a verify row turns by its request's M-RoPE delta, as a decode row does, so image chats
    (one image; two of different sizes) answer with the plain greedy ids under the oracle's drafts. The draft model,
    which would not see the images, is refused in one line."""
    from test_vlm_engine import CHATS as IMAGE_CHATS
    from test_vlm_engine import EXACT as VLM_EXACT

    kw = dict(model=str(tiny_vlms["qwen2-vl"]), **VLM_EXACT)
    plain, spec, stats = _with_oracle(monkeypatch, kw, IMAGE_CHATS, SamplingParams(max_new_tokens=16, ignore_eos=True))
    _same(plain, spec)
    assert stats.images_encoded >= 3 and 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    monkeypatch.undo()  # the real proposers again
    with pytest.raises(ValueError, match="a draft model would not see"):
        LLM(**kw, speculative_algorithm="draft", speculative_draft_model=str(tiny_vlms["qwen2-vl"]))


def test_the_step_profiler_profiles_verify_steps(tiny_model_dirs, tmp_path, monkeypatch):
    """MINISGL_TORCH_PROFILER_DIR with prompt lookup on: its window holds verify steps, its table is written."""
    monkeypatch.setenv("MINISGL_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("MINISGL_PROFILE_SKIP", "1")
    monkeypatch.setenv("MINISGL_PROFILE_STEPS", "4")
    with LLM(str(tiny_model_dirs["llama"]), speculative_algorithm="ngram") as llm:
        llm.generate([5, 6, 7, 8] * 8, SamplingParams(max_new_tokens=16, ignore_eos=True))
        stats = llm.client.stats()
    assert stats.spec_verifies > 0
    assert (tmp_path / "rank0-steps.txt").read_text().startswith("rank0: 4 busy steps after 1: wall ")


def test_a_verify_step_draws_from_the_target_distribution():
    """The acceptance rule on a synthetic distribution (8 tokens): a row whose draft d has p(d) = 0.3 keeps it with
    probability 0.3, and the token it outputs is distributed as p (chi-square over 20,000 seeded rows), the rejected
    ones as p without d, renormalised."""
    vocab, n = 8, 20_000
    p = torch.tensor([0.05, 0.3, 0.15, 0.1, 0.2, 0.05, 0.1, 0.05])
    draft = 1
    state = SamplingState(n, vocab, torch.device("cpu"), HostBuffers())
    for slot in range(n):
        state.set_row(slot, SamplingParams(temperature=1.0, seed=slot), [3], [])
    slots = list(range(n))
    # Each request: rows [x, d]: row 0 draws the token d stands for, row 1 the one after (unused here).
    rows = state.batch([s for s in slots for _ in (0, 1)], torch.tensor([s for s in slots for _ in (0, 1)]),
                       torch.tensor([1, 2] * n), [True] * 2 * n, drafts=[[draft]] * n)
    logits = p.log().repeat(2 * n, 1)
    drawn = sample(logits, rows, state, create_sampler(torch.device("cpu"), vocab)).next_ids.view(n, 2)[:, 0]
    kept = torch.tensor([accepted_run([draft], [t]) for t in drawn.tolist()])
    assert abs(kept.float().mean().item() - 0.3) < 4 * math.sqrt(0.3 * 0.7 / n)
    out = torch.bincount(drawn, minlength=vocab).float()
    chi2 = ((out - n * p) ** 2 / (n * p)).sum().item()
    assert chi2 < 24.3  # 7 degrees of freedom, p = 0.001
    residual = p.clone()
    residual[draft] = 0
    residual /= residual.sum()
    rejected = drawn[kept == 0]
    got = torch.bincount(rejected, minlength=vocab).float()
    expected = rejected.numel() * residual
    mask = expected > 0
    assert got[draft] == 0
    assert ((got[mask] - expected[mask]) ** 2 / expected[mask]).sum().item() < 22.5  # 6 degrees of freedom


def test_draft_budget_follows_acceptance_and_backs_off_when_nothing_is_accepted():
    b = DraftBudget(3)
    assert b.wants(0) == 3  # optimistic at first
    b.update(3, 1, outputs=2)  # one of three: fewer next time
    assert b.wants(2) == 2
    b.update(1, 0, outputs=3)  # none: a pause of 1, 2, 4 .. MAX_WAIT plain steps, doubling
    assert b.wants(3) == 0 and b.wants(4) == 1
    outputs = 4
    for _ in range(8):
        b.update(1, 0, outputs=outputs)
        outputs = b.resume_at
    assert b.backoff == MAX_WAIT and b.wants(outputs - 1) == 0 and b.wants(outputs) == 1
    for _ in range(4):  # the drafts come true (a copied passage): back to k
        d = b.wants(outputs)
        outputs += d + 1
        b.update(d, d, outputs)
    assert b.wants(outputs) == 3
    b.found_none(outputs)  # asked, nothing to copy: the same pause, the rate untouched
    assert b.wants(outputs) == 0 and b.wants(outputs + 1) == 3
    b.found_none(outputs + 1)
    assert b.wants(outputs + 2) == 0 and b.wants(outputs + 3) == 3


def test_a_budget_that_does_not_pause_keeps_drafting_at_its_acceptance_rate():
    """Prompt lookup on the CPU (no overlap to lose): a rejected draft costs only its row, so no pause."""
    b = DraftBudget(3, pauses=False)
    for outputs in range(10):
        b.update(1, 0, outputs)
        assert b.wants(outputs + 1) == 1  # still one draft a step, at a low rate
    b.found_none(11)
    assert b.wants(11) == 1
    for outputs in range(12, 20):  # a copied passage: back up to k
        b.update(b.wants(outputs), b.wants(outputs), outputs)
    assert b.wants(20) == 3


def test_ngram_index_proposes_what_followed_the_longest_latest_match():
    index = NgramIndex(min_n=1, max_n=4)
    index.extend([1, 2, 3, 9, 5, 2, 3, 7, 8])
    index.extend([1, 2, 3])  # incremental: the same as one build
    assert index.propose(3) == [9, 5, 2]  # "1 2 3" (3 long) beats the later "2 3" -> 7
    rebuilt = NgramIndex(1, 4)
    rebuilt.extend(index.tokens)
    assert rebuilt.prev == index.prev and rebuilt.propose(3) == [9, 5, 2]
    index.extend([4])
    assert index.propose(2) == []  # 4 never came before
    periodic = NgramIndex(2, 8)
    periodic.extend([6, 1, 2, 1, 2])
    assert periodic.propose(5) == [1, 2, 1, 2, 1]  # the match runs into the end: its period repeats
    short = NgramIndex(3, 8)
    short.extend([1, 2, 5, 1, 2])
    assert short.propose(2) == []  # only 2 tokens match: under min_n


def test_speculative_options_that_contradict_each_other_are_refused():
    from typer.testing import CliRunner

    from minisgl_cli.app import app
    from minisgl_cli.scheduler.config import SchedulerConfig

    with pytest.raises(ValueError, match="--speculative-draft-model"):
        SchedulerConfig(speculative_algorithm="draft")
    with pytest.raises(ValueError, match="--speculative-draft-model"):
        SchedulerConfig(speculative_draft_model="smollm2")  # a draft model without the draft algorithm: refused
    with pytest.raises(ValueError, match="must be one of none, ngram, draft"):
        SchedulerConfig(speculative_algorithm="eagle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="drop --num-speculative-tokens or use --speculative-algorithm ngram or draft"):
        SchedulerConfig(num_speculative_tokens=5)  # a knob without speculation changes nothing: refused
    with pytest.raises(ValueError, match=r"drop --prompt-lookup-min or use --speculative-algorithm ngram \(draft"):
        SchedulerConfig(speculative_algorithm="draft", speculative_draft_model="smollm2", prompt_lookup_min=2)
    result = CliRunner().invoke(app, ["chat", "--speculative-algorithm", "ngram", "--prompt-lookup-min", "5",
                                      "--prompt-lookup-max", "2"])
    assert result.exit_code != 0 and "--prompt-lookup-min is above --prompt-lookup-max" in result.output


@pytest.mark.slow
def test_acceptance_shows_in_the_request_stats_metrics_status_line_and_bench_figures():
    """A copy prompt with prompt lookup in the default mode: the reply's tokens per step and drafted tokens (chat's
    status line), the scheduler's counters (/metrics, JSON and Prometheus), and the bench's accept length."""
    from minisgl_cli.bench.metrics import RequestTiming, compute_metrics
    from minisgl_cli.repl.view import status_line
    from minisgl_cli.server.metrics import ServerMetrics

    with LLM(speculative_algorithm="ngram") as llm:
        assert llm.client.info.speculative == "ngram k=3"
        out = llm.generate(LOOKUP[0][0], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
        stats = llm.client.stats()
    s = out.stats
    assert 0 < s.drafted_tokens == stats.spec_accepted_tokens < s.completion_tokens
    assert s.accept_length == s.completion_tokens / (s.completion_tokens - s.drafted_tokens) > 1.5
    assert stats.spec_accept_length == (stats.spec_accepted_tokens + stats.spec_verifies) / stats.spec_verifies
    assert f"accept {s.accept_length:.2f} tok/step" in status_line(s, "length", "radix", speculative=True)
    assert "accept" not in status_line(s, "length", "radix")
    metrics = ServerMetrics()
    text = metrics.to_prometheus(stats, "m", llm.client.info)
    assert f"minisgl_spec_accepted_tokens_total{{model_name=\"m\"}} {stats.spec_accepted_tokens}" in text
    assert 'speculative="ngram k=3"' in text and "minisgl_spec_accept_length" in text
    assert metrics.to_json(stats, "m", None)["scheduler"]["spec_accept_length"] == round(stats.spec_accept_length, 3)
    m = compute_metrics([RequestTiming(5, s.completion_tokens, 0.1, 1.0, drafted_tokens=s.drafted_tokens)], 1.0)
    assert m.accept_length == s.accept_length


@pytest.mark.slow
def test_a_draft_model_equal_to_the_target_accepts_every_draft():
    """--speculative-algorithm draft with the target itself as the draft (exact mode): every draft is the target's own
    greedy token, so every one is accepted, and the answers are the plain ones."""
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    with LLM(**EXACT) as llm:
        plain = llm.generate(CHATS[:3], params)
    with LLM(**EXACT, speculative_algorithm="draft", speculative_draft_model="smollm2") as llm:
        assert llm.client.info.speculative == "draft k=3"
        spec = llm.generate(CHATS[:3], params)
        llm.client.check_pages()
        stats = llm.client.stats()
    _same(plain, spec)
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens


def test_a_draft_model_with_another_tokenizer_is_refused_in_one_line(tiny_model_dirs, tmp_path):
    """A draft model must share the target's tokenizer (a tiny Llama whose tokenizer swaps two tokens: refused), and
    runs at --tp 1."""
    import shutil

    from typer.testing import CliRunner

    from minisgl_cli.app import app

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dirs["llama"], other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="has another tokenizer than the model"):
        LLM(str(tiny_model_dirs["llama"]), speculative_algorithm="draft", speculative_draft_model=str(other))
    result = CliRunner().invoke(app, ["chat", "--speculative-algorithm", "draft", "--speculative-draft-model",
                                      str(other), "--tp", "2"])
    assert result.exit_code != 0 and "runs at --tp 1" in result.output


@pytest.mark.slow
def test_serve_with_prompt_lookup_stops_at_a_stop_string_and_reports_acceptance(default_model_dir, tmp_path):
    """`minisgl serve --speculative-algorithm ngram` (the multi-process runtime, compile off): a streamed completion
    with a stop string in an accepted run ends where it would without speculation (the detokenizer decodes the run a
    token at a time), and /metrics counts the accepted drafts."""
    import httpx
    from serve_process import Serve

    body = {"messages": LOOKUP[0][0], "max_tokens": 40, "temperature": 0, "stop": [" supper"]}
    with LLM(cache="naive") as llm:
        plain = llm.generate(LOOKUP[0][0], SamplingParams(max_new_tokens=40, stop=[" supper"]))[0]
    server = Serve(default_model_dir, tmp_path, "--speculative-algorithm", "ngram", "--torch-compile", "off",
                   "--cache", "naive")
    try:
        server.wait_healthy()
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).json()
    finally:
        server.stop()
    choice = reply["choices"][0]
    assert choice["message"]["content"] == plain.text and choice["finish_reason"] == "stop"
    assert reply["usage"]["completion_tokens"] == len(plain.token_ids)
    assert metrics["engine"]["speculative"] == "ngram k=3" and metrics["scheduler"]["spec_accepted_tokens"] > 0
