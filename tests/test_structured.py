"""Structured output and logprobs through `LLM.generate`: grammars hold with and without overlap scheduling,
and logprobs equal HF transformers' log-softmax of the same weights."""

from __future__ import annotations

import json
import re

import pytest
import torch

from minisgl_cli import LLM, SamplingParams

pytestmark = pytest.mark.slow

# Small enough that even a tiny random model finishes each within its token budget.
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}
REGEX = r"(yes|no), [a-c]{1,5}\."
CHAT = [{"role": "user", "content": "Answer yes or no."}]


def _structured(llm: LLM) -> list:
    params = [
        SamplingParams(max_new_tokens=24, json_schema=json.dumps(ANSWER), logprobs=True, top_logprobs=2),
        SamplingParams(max_new_tokens=16, regex=REGEX, temperature=0.9, seed=7),
        SamplingParams(max_new_tokens=16, ebnf='root ::= "The answer is " ("A" | "B" | "C") "."'),
        SamplingParams(max_new_tokens=24, json_schema=json.dumps(ANSWER), presence_penalty=0.5,
                       frequency_penalty=0.5),
        SamplingParams(max_new_tokens=8),  # a free request in the same batch
    ]
    return llm.generate([CHAT] * len(params), params)


def test_grammars_hold_with_and_without_overlap(tiny_model_dirs):
    runs = []
    for overlap in (False, True):
        with LLM(str(tiny_model_dirs["llama"]), overlap_on_cpu=overlap) as llm:
            runs.append(_structured(llm))
            if overlap:  # a grammar that does not compile fails its request only
                with pytest.raises(ValueError, match="invalid regex"):
                    llm.generate("hi", SamplingParams(max_new_tokens=4, regex="((("))
                assert re.fullmatch(REGEX, llm.generate("hi", SamplingParams(max_new_tokens=16, regex=REGEX))[0].text)
            llm.client.check_pages()
    plain, overlapped = runs
    assert [r.token_ids for r in plain] == [r.token_ids for r in overlapped]
    answer, regex, ebnf, penalized, _ = plain
    for out in (answer, penalized):  # penalties and the grammar both follow the in-flight token
        assert out.finish_reason == "stop" and set(json.loads(out.text)) == {"answer", "n"}
    assert re.fullmatch(REGEX, regex.text) and re.fullmatch(r"The answer is [ABC]\.", ebnf.text)
    assert [lp.token_id for lp in answer.logprobs] == answer.token_ids
    assert all(len(lp.top) == 2 for lp in answer.logprobs)


def test_logprobs_equal_hf_log_softmax(tiny_model_dirs):
    """The chosen token's logprob is what the sampler drew from: HF's log-softmax, greedy and tempered."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs["qwen2"]
    prompt = torch.randint(3, 49152, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3)
    tempered = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True, temperature=0.7, seed=1)
    with LLM(str(model_dir), attention_backend="torch") as llm:
        outs = llm.generate([prompt, prompt], [greedy, tempered])
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for out, temp in zip(outs, (1.0, 0.7)):
        ids = prompt + out.token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1]
        want = (logits / temp).log_softmax(-1)
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        assert torch.allclose(got, want.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0], atol=1e-4)
    top = outs[0].logprobs
    assert all(t.top[0].token_id == t.token_id and t.top[0].logprob == t.logprob for t in top)
    assert all(len(t.top) == 3 and t.top[0].logprob >= t.top[1].logprob >= t.top[2].logprob for t in top)
    assert outs[1].logprobs[0].top == []


def test_closing_at_once_waits_for_the_grammar_build(tiny_model_dirs):
    """A quick start-and-quit must not leave xgrammar's native build running into interpreter exit (that aborts
    the process: "terminate called without an active exception", seen with `chat` under load)."""
    import threading

    with LLM(str(tiny_model_dirs["llama"])):
        pass
    assert not [t.name for t in threading.enumerate() if t.name == "minisgl-grammar"]
