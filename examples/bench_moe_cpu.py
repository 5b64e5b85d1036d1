"""One-stream decode of a small random Qwen3-MoE on the CPU: the dense bf16 mode against the int4 / int8 modes.

    python examples/bench_moe_cpu.py [--new-tokens 128] [--repeat 3] [--threads N] [--out DIR]

No MoE checkpoint fits this machine's offline store, so the model is made here: a Qwen3-MoE config with transformers'
random init (hidden 768, 6 layers, 16 experts of width 384, 2 a token, the default model's tokenizer), saved as bf16
safetensors under --out (default: a temp dir). Then, one engine at a time, `LLM(quantization=...)` answers one short
chat: once right after the start (the "first" column: packed weights are built on first use), then `--repeat` times
greedy and sampled (temperature 1, seed 1) in turn. The int4 / int8 modes hold every linear's low-bit copy for
decode, the experts' included (the LM head int8). Printed: decode tok/s (the request's tokens after the first over
the time after its first token; the best run of each kind), the experts' bytes a decode token reads, and where the
greedy tokens part from the dense engine's (random weights: a low-bit copy may part from them early, which says
nothing of quality). Through `LLM`, the in-process front; the HTTP front and the raw engine are not timed here.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

CONFIG = dict(vocab_size=49152, hidden_size=768, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=12,
              num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=384,
              norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
              eos_token_id=2)


def make_checkpoint(out: Path) -> Path:
    """The random Qwen3-MoE under `out`, with the default model's tokenizer files."""
    import transformers

    from minisgl_cli.loader import resolve_model

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**CONFIG)).eval().to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    for f in resolve_model(None).path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
            shutil.copy(f, out / f.name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="where the checkpoint is made (default: a temp dir, removed after)")
    args = ap.parse_args()
    from minisgl_cli import LLM, SamplingParams

    tmp = None if args.out else tempfile.mkdtemp(prefix="moe-cpu-")
    model_dir = make_checkpoint(Path(args.out or tmp))
    chat = [{"role": "user", "content": "Tell me about the sea."}]
    greedy = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=1.0, seed=1)
    e, h, i = CONFIG["num_experts_per_tok"], CONFIG["hidden_size"], CONFIG["moe_intermediate_size"]
    expert_mb = CONFIG["num_hidden_layers"] * e * 3 * h * i / 1e6  # million weights a decode token reads
    rows, answers = [], {}
    for quantization in ("none", "int8", "int4"):
        t0 = time.perf_counter()
        with LLM(str(model_dir), quantization=quantization, dtype="bfloat16", num_threads=args.threads) as llm:
            up = time.perf_counter() - t0
            first = llm.generate(chat, greedy)[0]  # right after the start: packs and caches built on first use
            rates: dict[str, list[float]] = {"greedy": [], "sampled": []}
            for _ in range(args.repeat):
                for kind, params in (("greedy", greedy), ("sampled", sampled)):
                    out = llm.generate(chat, params)[0]
                    rates[kind].append(out.stats.decode_tok_s)
                    if kind == "greedy":
                        answers[quantization] = out.token_ids
        bits = {"none": 16, "int8": 8, "int4": 4.5}[quantization]  # int4: 4 bits + a scale and a zero per 32
        same = next((k for k, (a, b) in enumerate(zip(answers[quantization], answers["none"])) if a != b), None)
        rows.append((quantization, first.stats.decode_tok_s, max(rates["greedy"]), max(rates["sampled"]),
                     expert_mb * bits / 8, up, "all" if same is None else f"first {same}"))
    print(f"torch threads {torch.get_num_threads()}, {args.new_tokens} tokens; decode tok/s: the first request after "
          f"the start, then the best of {args.repeat} greedy and sampled (temperature 1, seed 1)")
    print(f"{'experts':8}{'first':>8}{'greedy':>9}{'sampled':>9}{'x dense':>9}{'sampled/greedy':>16}"
          f"{'expert MB/token':>17}{'start s':>9}  greedy = dense")
    base = rows[0][2]
    for q, first_rate, rate, samp, mb, up, same in rows:
        print(f"{q:8}{first_rate:>8.1f}{rate:>9.1f}{samp:>9.1f}{rate / base:>9.2f}{samp / rate:>16.2f}{mb:>17.1f}"
              f"{up:>9.1f}  {same}")
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
