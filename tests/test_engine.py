"""Engine pieces: batched prefill, sampling, stop conditions, detokenizer, built-in configs, loader errors."""

from __future__ import annotations

import asyncio

import pytest
import torch

from minisgl_cli import LLM, SamplingParams
from minisgl_cli.client.protocol import complete
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.engine.engine import Engine
from minisgl_cli.loader.configs import BUILTIN_CONFIGS
from minisgl_cli.loader.errors import ModelLoadError
from minisgl_cli.models import ModelConfig
from minisgl_cli.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from minisgl_cli.types import GenerateRequest


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["qwen3"])) as llm:
        yield llm


def _extend(engine: Engine, prompts: list[list[int]], first_row: int) -> torch.Tensor:
    pool = engine.pool
    locs, start = [], 1 + first_row * 512
    for i, ids in enumerate(prompts):
        slots = torch.arange(start, start + len(ids))
        pool.page_table[first_row + i, : len(ids)] = slots.int()
        locs.append(slots)
        start += 512
    flat = [t for ids in prompts for t in ids]
    rows = list(range(first_row, first_row + len(prompts)))
    batch = ForwardBatch.build("prefill", flat, rows, [0] * len(prompts), [len(p) for p in prompts],
                               torch.cat(locs), engine.device, engine.host)
    return engine.forward(batch)


def test_batched_prefill_of_different_lengths_equals_one_by_one(tiny_model_dirs):
    engine = Engine(EngineConfig(model=str(tiny_model_dirs["qwen2"]), max_total_tokens=8192))
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 17, 1)]
    together = _extend(engine, prompts, 0)
    alone = torch.cat([_extend(engine, [p], 4 + i) for i, p in enumerate(prompts)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    assert (together.argmax(-1) == alone.argmax(-1)).all()


def test_a_pool_sized_by_memory_holds_no_more_than_the_running_requests_can_fill(tiny_model_dirs):
    """4 GiB of a tiny model's KV would be ~10^7 pages (each listed on the host); the pool keeps what 3 requests at
    the longest context (100 tokens) can fill, and a pool given by --max-total-tokens stays as asked."""
    model = str(tiny_model_dirs["qwen2"])
    sized = Engine(EngineConfig(model=model, kv_cache_gib=4.0, max_running_requests=3, max_context_len=100))
    assert sized.pool.num_pages == -(-3 * 100 // sized.cfg.page_size) and sized.max_context_len == 100
    asked = Engine(EngineConfig(model=model, max_total_tokens=4096, max_running_requests=3, max_context_len=100))
    assert asked.pool.num_pages * asked.cfg.page_size == 4096


def test_two_engines_in_one_process_keep_their_own_kernel_choice(tiny_model_dirs):
    """An engine's kernels (and pinned buffers) are its own: a second engine on the fp16 CPU GEMM leaves the
    first one's fp32 logits bit for bit as they were (a process-wide switch used to flip both)."""
    model = str(tiny_model_dirs["qwen2"])
    prompts = [list(range(5, 25)), list(range(40, 47))]
    first = Engine(EngineConfig(model=model, max_total_tokens=2048, cpu_gemm="auto"))
    before = _extend(first, prompts, 0)
    second = Engine(EngineConfig(model=model, max_total_tokens=2048, cpu_gemm="fp16"))
    fp16 = _extend(second, prompts, 0)
    assert not torch.equal(fp16, before)  # the second engine really runs other kernels
    assert torch.equal(_extend(first, prompts, 0), before)
    assert first.host is not second.host


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    ids = [10, 20, 30, 40]
    p = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = llm.generate(ids, p)[0].token_ids
    # Same seed inside a batch of other sampled requests: same tokens.
    others = [SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True)] * 3
    b = llm.generate([ids, [1, 2], [3, 4, 5], [6]], [p, *others])[0].token_ids
    c = llm.generate(ids, SamplingParams(**{**p.__dict__, "seed": 99}))[0].token_ids
    assert a == b and a != c


def test_top_k_one_is_greedy(llm):
    ids = [11, 22, 33]
    greedy = llm.generate(ids, SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids
    topk1 = llm.generate(ids, SamplingParams(max_new_tokens=8, temperature=0.8, top_k=1, ignore_eos=True))[0]
    assert topk1.token_ids == greedy


def test_stop_token_ids_and_max_tokens(llm):
    ids = [11, 22, 33]
    free = llm.generate(ids, SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    stop_at = free.token_ids[3]
    cut = llm.generate(ids, SamplingParams(max_new_tokens=8, ignore_eos=True, stop_token_ids=[stop_at]))[0]
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1]


def test_stop_string_cuts_the_text_and_ends_the_request(llm):
    ids = [11, 22, 33]
    free = llm.generate(ids, SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    cut = llm.generate(ids, SamplingParams(max_new_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]
    llm.client.check_pages()


def test_zero_max_tokens_finishes_at_once(llm):
    out = llm.generate([1, 2, 3], SamplingParams(max_new_tokens=0))[0]
    assert out.token_ids == [] and out.finish_reason == "length"


def test_presence_penalty_changes_repetitive_output(llm):
    ids = [5, 5, 5, 5]
    plain = llm.generate(ids, SamplingParams(max_new_tokens=16, ignore_eos=True))[0].token_ids
    pen = llm.generate(ids, SamplingParams(max_new_tokens=16, ignore_eos=True, presence_penalty=50.0))[0].token_ids
    assert len(set(pen)) == len(pen) and pen != plain


def test_detokenizer_never_splits_utf8(default_model_dir):
    tok = Tokenizer(default_model_dir)
    text = "Größe: 東京 🚀👩‍👩‍👧 ok"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.feed([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_text_decoded_once_or_in_groups_equals_the_streamed_text(default_model_dir):
    """The same text whether a request's tokens are decoded one by one, in groups (serve --stream-interval) or once
    at the end (stream_text off: LLM.generate, the offline bench), on characters split across tokens."""
    from minisgl_cli.messages import TokenOutput
    from minisgl_cli.tokenizer import RequestDecoder

    tok = Tokenizer(default_model_dir)
    ids = tok.encode("Größe: 東京 🚀👩‍👩‍👧 ok")
    outs = [TokenOutput("r", i, "length" if k == len(ids) - 1 else None) for k, i in enumerate(ids)]

    def texts(params: SamplingParams, group: int) -> list[str]:
        decoder, out = RequestDecoder(tok, params), []
        for k in range(0, len(outs), group):
            piece = decoder.feed(outs[k : k + group])
            out.append(piece.text)
            if piece.finish_reason:  # a stop string ends it early
                break
        return out

    one = texts(SamplingParams(), 1)
    assert "".join(one) == tok.decode(ids) and len([t for t in one if t]) > 5
    for group in (2, 3, 7):
        assert "".join(texts(SamplingParams(), group)) == "".join(one)
    whole = texts(SamplingParams(stream_text=False), 1)
    assert whole[:-1] == [""] * (len(ids) - 1) and whole[-1] == "".join(one)
    stopped = texts(SamplingParams(stream_text=False, stop=["東"]), 1)  # stop strings: decoded as it grows
    assert "".join(stopped) == "Größe: " and any(stopped[:-1])


def test_a_steps_text_decoded_in_one_call_equals_each_request_decoded_alone(default_model_dir):
    """The detokenizer's bulk decode (decode_steps: one call per step) gives every request the pieces it would get
    alone: special tokens kept or skipped, text once at the end, stop strings, a character split across steps."""
    from minisgl_cli.messages import TokenOutput
    from minisgl_cli.tokenizer import RequestDecoder, decode_steps

    tok = Tokenizer(default_model_dir)
    ids = tok.encode("Größe: 東京 🚀 ok") + [tok.hf.eos_token_id] + tok.encode(" naïve")
    params = [SamplingParams(), SamplingParams(skip_special_tokens=False), SamplingParams(stream_text=False),
              SamplingParams(stop=["京"]), SamplingParams(logprobs=True)]
    alone = [RequestDecoder(tok, p) for p in params]
    bulk = [RequestDecoder(tok, p) for p in params]
    live, texts = list(range(len(params))), [""] * len(params)
    for k, token in enumerate(ids):
        reason = "length" if k == len(ids) - 1 else None
        outs = {r: [TokenOutput(f"r{r}", token, reason, logprob=-1.0 if params[r].logprobs else None)] for r in live}
        want = [alone[r].feed(outs[r]) for r in live]
        assert decode_steps(tok, [(bulk[r], outs[r]) for r in live]) == want, k
        for r, piece in zip(list(live), want):
            texts[r] += piece.text
            if piece.finish_reason:  # the stop string ended it
                live.remove(r)
    assert texts[0] == tok.decode(ids) and texts[2] == texts[0] and texts[3] == "Größe: 東"
    assert texts[1] == tok.decode(ids, skip_special_tokens=False) != texts[0]


def test_generate_gives_the_streamed_text_and_logprobs(llm):
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=True, top_logprobs=2)
    done = llm.generate([11, 22, 33], params)[0]

    async def stream():
        return [d async for d in llm.client.submit(GenerateRequest(input_ids=[11, 22, 33], params=params))]

    deltas = asyncio.run(stream())
    assert done.text == "".join(d.text for d in deltas)
    assert done.logprobs == [lp for d in deltas for lp in d.logprobs or []]


def test_stop_string_matcher_holds_back_partial_matches():
    m = StopStringMatcher(["<END>"])
    assert m.push("hello <E") == ("hello ", False)
    assert m.push("N") == ("", False)
    assert m.push("D> tail") == ("", True)
    m2 = StopStringMatcher(["<END>"])
    assert m2.push("a <") == ("a ", False)
    assert m2.push("b") == ("<b", False)


def test_chat_messages_use_the_template(default_model_dir):
    tok = Tokenizer(default_model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("name", sorted(BUILTIN_CONFIGS))
def test_builtin_configs_parse(name):
    cfg = ModelConfig.from_hf(BUILTIN_CONFIGS[name])
    assert cfg.num_heads % cfg.num_kv_heads == 0 and cfg.head_dim in (64, 128, 256)  # Gemma 3 12B: 256


def test_dummy_weights_run_and_stay_finite():
    engine = Engine(EngineConfig(model="smollm2-135m", load_format="dummy", max_total_tokens=256))
    logits = _extend(engine, [[1, 2, 3, 4]], 0)
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_unknown_dummy_config_and_missing_model_are_one_line_errors(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        Engine(EngineConfig(model=str(tmp_path / "nope"), load_format="dummy"))
    assert "\n" not in str(err.value) and "nope" in str(err.value)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError) as err2:
        Engine(EngineConfig(model=str(tmp_path)))
    assert "\n" not in str(err2.value) and str(tmp_path) in str(err2.value)


def test_local_client_builds_its_engine_on_the_scheduler_thread_and_raises_its_load_errors(tmp_path, monkeypatch):
    """One thread builds and steps the engine (so one CPU thread pool runs its ops); a build error reaches the caller
    and leaves no thread behind."""
    import threading

    from minisgl_cli.client.local import LocalClient

    threads = []
    real_init = Engine.__init__

    def init(self, *args, **kwargs):
        threads.append(threading.current_thread())
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "__init__", init)
    client = LocalClient(EngineConfig(model="smollm2-135m", load_format="dummy", max_total_tokens=256))
    try:
        assert threads == [client._thread] and threads[0] is not threading.main_thread()
    finally:
        client.close()
    before = threading.active_count()
    with pytest.raises(ModelLoadError, match="nope"):
        LocalClient(EngineConfig(model=str(tmp_path / "nope"), load_format="dummy"))
    assert threading.active_count() == before


def test_dummy_engine_has_no_tokenizer_and_takes_input_ids():
    with LLM("smollm2-135m", load_format="dummy", max_total_tokens=512) as llm:
        with pytest.raises(ValueError, match="input_ids"):
            asyncio.run(complete(llm.client, GenerateRequest(prompt="hi")))
        out = llm.generate([1, 2, 3], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3


def test_closing_a_client_frees_its_engine_and_hands_a_given_engine_back_empty(tiny_model_dirs):
    """A closed LLM may still be referenced: its engine (weights, KV pool) is freed anyway. A client over a given
    engine leaves that engine's pool whole (running requests and the prefix cache handed back), and a stream still
    open when it closes ends with an error rather than waiting forever."""
    import gc
    import weakref

    from minisgl_cli.client.local import LocalClient

    def engines() -> list[Engine]:
        return [o for o in gc.get_objects() if type(o) is Engine]

    before = {id(e) for e in engines()}
    llm = LLM(str(tiny_model_dirs["qwen3"]), max_total_tokens=512)
    llm.generate([1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))
    built = [weakref.ref(e) for e in engines() if id(e) not in before]
    assert len(built) == 1
    llm.close()
    assert built[0]() is None  # `llm` still holds its client

    engine = Engine(EngineConfig(model=str(tiny_model_dirs["qwen3"]), max_total_tokens=512))
    client = LocalClient(engine=engine)

    async def run() -> None:
        done = await complete(client, GenerateRequest(input_ids=list(range(1, 40)),
                                                      params=SamplingParams(max_new_tokens=4, ignore_eos=True)))
        assert len(done.token_ids) == 4  # its prefix now sits in the cache
        stream = client.submit(GenerateRequest(input_ids=list(range(1, 60)),
                                               params=SamplingParams(max_new_tokens=10_000, ignore_eos=True)))
        first = await stream.__anext__()  # running, holding pages
        assert first.error is None
        await asyncio.get_running_loop().run_in_executor(None, client.close)
        rest = [d async for d in stream]
        assert rest and "the client was closed" in (rest[-1].error or "")

    asyncio.run(run())
    assert engine.pool.num_free_pages == engine.pool.num_pages
