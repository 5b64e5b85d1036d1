"""The CUDA sampler (kernels/triton/sampling.py, both its paths: one program per row and a row split over many)
against the exact torch path: draws stay in the kept set and follow its distribution (chi-square), on a small and on
Qwen3's vocabulary; the split path draws the single-program path's tokens, in a CUDA graph too; and a seeded request
through CUDA graphs and overlap scheduling draws the same tokens whatever shares its batch. Skipped without CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minisgl_cli.engine.host import HostBuffers
from minisgl_cli.sampling.sampler import cpu_draw, cut, torch_draw
from minisgl_cli.sampling.state import SamplingState
from minisgl_cli.types import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = torch.device("cuda")
CHUNK = 4096
CASES = [
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=20),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.8),
    SamplingParams(temperature=1.2, min_p=0.05),
    SamplingParams(temperature=1.0, top_p=0.5, min_p=0.02),
    SamplingParams(temperature=0.9),
]


def _draws(logits: torch.Tensor, p: SamplingParams, n: int, triton: bool, draw=None,
           split: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """n draws of one row (a new position each) and the row's kept distribution. Drawn 4096 rows at a time: a
    batch of 40,000 rows of Qwen3's vocabulary would not fit the GPU. `split`: the Triton path's choice."""
    from minisgl_cli.sampling.sampler import triton_draw

    v = logits.shape[-1]
    state = SamplingState(1, v, DEV, HostBuffers())
    state.set_row(0, p, [1], [])
    ids = []
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        batch = state.batch([0] * m, torch.zeros(m, dtype=torch.int64, device=DEV),
                            torch.arange(start, start + m, dtype=torch.int32, device=DEV), [True] * m)
        rows = logits.expand(m, v).contiguous()
        if draw is None and triton:
            ids.append(triton_draw(rows, state.params(batch.req_rows), batch, split))
        else:
            ids.append((draw or torch_draw)(rows, state.params(batch.req_rows), batch))
    kept = cut(logits[:1].float() / p.temperature, state.params(batch.req_rows[:1]), batch)[0]
    return torch.cat(ids), kept.softmax(-1)


def _chi2(ids: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    counts = torch.bincount(ids, minlength=probs.shape[0]).double()
    expected = probs.double() * ids.shape[0]
    big = expected >= 5  # the usual validity rule; the rest pooled into one cell
    cells = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    return float(((cells[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("vocab", [64, 151936])
@pytest.mark.parametrize("p", CASES, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_triton_draws_follow_the_kept_distribution(vocab, p):
    g = torch.Generator(DEV).manual_seed(vocab)
    logits = (torch.randn(1, vocab, device=DEV, generator=g) * (2.0 if vocab < 1000 else 4.0)).to(torch.bfloat16)
    n = 40000
    for triton, split in ((True, False), (True, True), (False, None)):
        ids, probs = _draws(logits, p, n, triton, split=split)
        assert (probs[ids] > 0).all(), "a draw outside the kept set"
        chi2, df = _chi2(ids, probs)
        # mean df, sd sqrt(2 df): 6 sd above the mean fails only a wrong distribution
        assert chi2 < df + 6 * (2 * df) ** 0.5 + 10, (triton, split, chi2, df)
        # every kept token of probability >= 1e-3 shows up (40 draws expected: missing one is a e^-40 event)
        assert set((probs >= 1e-3).nonzero()[:, 0].tolist()) <= set(ids.unique().tolist())


def test_triton_without_a_cut_draws_the_torch_paths_tokens():
    """No top-k / top-p cut: the same uniform and the same CDF order, so the same tokens (up to summation order:
    on a flat distribution over 151,936 tokens the fp32 sums differ by more than a token's weight, so a model-like
    spread of logits)."""
    g = torch.Generator(DEV).manual_seed(1)
    logits = (torch.randn(1, 151936, device=DEV, generator=g) * 4).to(torch.bfloat16)
    p = SamplingParams(temperature=0.8, seed=11)
    b, _ = _draws(logits, p, 4096, False)
    for split in (False, True):
        a, _ = _draws(logits, p, 4096, True, split=split)
        assert (a == b).double().mean() > 0.99, split


@pytest.mark.parametrize("p", [c for c in CASES if c.top_k < 0], ids=lambda p: f"p{p.top_p}-m{p.min_p}")
def test_triton_draws_the_cpu_rejection_paths_tokens(p):
    """Without a top-k (the CPU draws top-k rows from their candidates instead) the kernel and the CPU's torch path
    run one rejection scheme on the same uniforms: the same tokens, up to summation order."""
    g = torch.Generator(DEV).manual_seed(2)
    logits = (torch.randn(1, 151936, device=DEV, generator=g) * 4).to(torch.bfloat16)
    p = dataclasses.replace(p, seed=5)
    b, _ = _draws(logits, p, 2048, False, draw=cpu_draw)
    for split in (False, True):
        a, _ = _draws(logits, p, 2048, True, split=split)
        assert (a == b).double().mean() > 0.99, split


@pytest.mark.parametrize("b", [1, 7, 64, 300])
def test_the_split_path_draws_the_single_programs_tokens(b):
    """A mixed batch (every CASES row, greedy rows, a min-p row beside cut rows) at several sizes: split and single
    draw the same tokens up to summation order, greedy rows exactly their argmax; and a CUDA graph of the split call
    replays to the eager call's tokens (its per-row counters start from zero at every launch), on new logits too."""
    from minisgl_cli.sampling.sampler import triton_draw

    v = 151936
    params = [dataclasses.replace(CASES[i % len(CASES)], seed=i) if i % 4 else SamplingParams() for i in range(b)]
    state = SamplingState(b, v, DEV, HostBuffers())
    for i, p in enumerate(params):
        state.set_row(i, p, [1], [])
    batch = state.batch(list(range(b)), torch.arange(b, device=DEV), torch.arange(b, dtype=torch.int32, device=DEV) + 5,
                        [True] * b)
    rp = state.params(batch.req_rows)
    g = torch.Generator(DEV).manual_seed(b)
    logits = (torch.randn(b, v, device=DEV, generator=g) * 4).to(torch.bfloat16)
    one = triton_draw(logits, rp, batch, split=False)
    split = triton_draw(logits, rp, batch, split=True)
    greedy = torch.tensor([p.greedy for p in params], device=DEV)
    assert (split[greedy] == logits[greedy].argmax(-1)).all()
    kept = cut(logits.float() / rp.temperature[:, None], rp, batch)
    assert (kept.gather(1, split[:, None]) > float("-inf")).all(), "a draw outside its row's kept set"
    assert int((one != split).sum()) <= max(1, b // 50)  # summation order moves a boundary draw rarely
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        triton_draw(logits, rp, batch, split=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_draw(logits, rp, batch, split=True)
    for _ in range(3):
        graph.replay()
        assert torch.equal(captured, split)
    logits.copy_((torch.randn(b, v, device=DEV, generator=g) * 4).to(torch.bfloat16))
    graph.replay()
    assert torch.equal(captured, triton_draw(logits, rp, batch, split=True))


def test_seeded_request_ignores_its_batch_through_graphs_and_overlap():
    """The same seeded request beside greedy requests and beside sampled / penalized ones: the same tokens. The
    batch keeps its size and prompt lengths (the GEMMs' rounding depends on them, not on the rows' contents)."""
    from minisgl_cli import LLM

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 30000, (12 + 3 * i,), generator=g).tolist() for i in range(4)]
    others_b = [torch.randint(3, 30000, (len(p),), generator=g).tolist() for p in prompts[1:]]
    seeded = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, top_k=40, seed=1234)
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    sampled = [SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, min_p=0.05),
               SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.7, top_p=0.9,
                              repetition_penalty=1.3, presence_penalty=0.5),
               SamplingParams(max_new_tokens=24, ignore_eos=True, frequency_penalty=1.0, logit_bias={5: 3.0})]
    # No prefix cache: a cached prompt would prefill fewer rows, and the GEMMs would round differently.
    with LLM("qwen3-0.6b", load_format="dummy", max_total_tokens=16384, cache="naive") as llm:
        assert llm.client.info.sampler == "triton"
        a = llm.generate(prompts, [seeded] + [greedy] * 3)[0].token_ids
        b = llm.generate([prompts[0]] + others_b, [seeded] + sampled)[0].token_ids
        c = llm.generate(prompts, [seeded] + [greedy] * 3)[0].token_ids
        llm.client.check_pages()
    assert a == b == c and len(set(a)) > 3


def test_small_sampled_batches_draw_by_replay_the_eager_samplers_tokens(monkeypatch):
    """sampling/graphs.py: a decode batch of plain sampled rows draws by replaying a captured graph -- each of
    its four variants (no cut, a cut, min-p, both), greedy rows beside -- and every row's tokens equal those of the
    same run with the eager sampler; a penalized batch does not replay."""
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.messages import AddRequest
    from minisgl_cli.scheduler.scheduler import Scheduler, SchedulerConfig

    engine = Engine(EngineConfig(model="qwen3-0.6b", load_format="dummy", max_total_tokens=16384,
                                 max_running_requests=16, cuda_graph_max_bs=16))
    sg = engine.sampler_graphs
    assert sg is not None and len(sg.graphs) == 4 * len(sg.sizes)
    replays = [0]
    draw = sg.draw

    def counted(n, needs):
        replays[0] += 1
        return draw(n, needs)

    monkeypatch.setattr(sg, "draw", counted)
    g = torch.Generator().manual_seed(3)
    steps = 16

    def run(params: list[SamplingParams]) -> list[list[int]]:
        prompts = [torch.randint(3, 30000, (20 + 7 * i,), generator=g).tolist() for i in range(len(params))]
        got: dict[str, list[int]] = {}
        left = [len(params)]

        def sink(msg):
            for it in msg.outputs:
                if it.token_id is not None:
                    got.setdefault(it.rid, []).append(it.token_id)
                if it.finish_reason is not None or it.error:
                    left[0] -= 1

        sched = Scheduler(engine, SchedulerConfig(cache="naive"), sink)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            sched.handle(AddRequest(f"r{i}", p, dataclasses.replace(sp, max_new_tokens=steps, ignore_eos=True)))
        while left[0] > 0:
            sched.step()
        while sched._inflight is not None:
            sched.step()
        sched.check_pages()
        return [got[f"r{i}"] for i in range(len(params))]

    seeded = [dataclasses.replace(p, seed=100 + i) for i, p in enumerate(CASES)]
    groups = [seeded + [SamplingParams()], [seeded[5]], [seeded[0]], [seeded[3]], [seeded[4]]]
    penalized = [dataclasses.replace(seeded[0], presence_penalty=0.5)]
    for params in groups + [penalized]:
        state = g.get_state()
        before = replays[0]
        replayed = run(params)
        taken = replays[0] - before
        g.set_state(state)  # the same prompts
        engine.sampler_graphs = None
        eager = run(params)
        engine.sampler_graphs = sg
        assert replayed == eager, params
        # every decode step after the prefill replays (overlap may launch one more), none with a penalized row
        assert taken == 0 if params is penalized else steps - 1 <= taken <= steps, (params, taken)
    assert len({t for row in replayed for t in row}) > 3
