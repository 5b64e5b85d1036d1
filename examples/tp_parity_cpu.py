"""TP parity on the CPU: `--tp 2`'s greedy answers and logits against `--tp 1`'s, step by step and layer by layer.

    python examples/tp_parity_cpu.py                                      # the default mode (the GGUF's int4)
    python examples/tp_parity_cpu.py --dtype float32 --quantization none  # the exact mode
    python examples/tp_parity_cpu.py --quantization int8 --prompt "Name three uses of a paperclip."

Each configuration runs the real default model (SmolLM2-135M-Instruct from the bundled GGUF) in its own processes:
TP 1 in one, TP 2 in two gloo ranks (as `minisgl serve --tp 2` on the CPU; the decode runs eagerly in both, as
serve's TP 2 does). Every prompt goes through the chat template and is decoded greedily for `--max-new-tokens`.

TP 1 decodes freely; TP 2 decodes freely (its own answer) and again fed TP 1's tokens, so every step's logits of
the two sit over the same context. Per prompt it prints whether the answers agree and, per step, TP 1's token, the
largest |logit difference| over the vocabulary, TP 1's top-2 gap and TP 2's choice. At the first step where TP 2
would choose otherwise it prints, layer by layer, how far the residual stream (a layer's output plus its residual:
what the next norm reads) of TP 2 is from TP 1's, against the stream's size: where the two part.

`--dense-row-split` decodes o_proj and down_proj through their dense weight at both TP sizes (the column-split
linears keep their low-bit copy): the int4 / int8 kernels return bf16, so at TP 2 each rank's share of a row-split
product is rounded to bf16 before the ranks sum it, where TP 1 rounds the whole sum once; without that rounding the
two differ after the first layer by the order of fp32 sums alone, and the layers after show how far the low-bit
kernels' bf16 activations carry that. `--json PATH` writes each prompt's summary (tests/test_tp_parity.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

PROMPTS = [
    "What are some creative uses for a paperclip?",
    "用中文介绍一下长城。",
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about autumn rain.",
    "List three tips for staying focused while studying.",
    "What is the difference between a virus and a bacterium?",
    "Translate 'Good morning, how are you?' into French and Spanish.",
    "Give me a short recipe for pancakes.",
]
TIE = 0.5  # a top-2 logit gap under this is a near tie (logit units: SmolLM2's logits run to ~30)


def _engine_cfg(args: argparse.Namespace):
    from minisgl_cli.engine.config import EngineConfig

    return EngineConfig(device="cpu", dtype=args.dtype, quantization=args.quantization, max_total_tokens=4096,
                        max_running_requests=1, torch_compile="off", num_threads=args.threads)


class _Streams:
    """Forward hooks that keep each decoder layer's residual stream (output + residual) of the step's last row."""

    def __init__(self, model: torch.nn.Module):
        self.rows: list[torch.Tensor] = []
        for layer in model.layers:
            layer.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        h, residual = output
        self.rows.append((h + residual)[-1].float().clone())

    def take(self) -> torch.Tensor:
        out, self.rows = torch.stack(self.rows), []
        return out


def _dense_row_split(model: torch.nn.Module) -> None:
    """Decode the row-split linears (o_proj, down_proj) through their dense weight in the engine dtype, at every TP
    size: no low-bit kernel rounds a rank's share to bf16 before the all-reduce, so TP 1 and TP 2 then differ by the
    order of fp32 sums alone (the column-split linears keep their low-bit copy: each output row is the same there)."""
    from minisgl_cli.layers.linear import RowParallelLinear
    from minisgl_cli.layers.quant import LinearMethod

    for layer in model.modules():
        if isinstance(layer, RowParallelLinear) and layer.method.decode_copy:
            layer.method = LinearMethod()


def _greedy(engine, ids: list[int], steps: int, forced: list[int] | None, streams: _Streams):
    """Prefill `ids`, then decode `steps` tokens (TP 1's `forced` ones fed where given): (tokens, logits [steps,
    vocab] fp32, residual streams [steps, layers, hidden])."""
    from minisgl_cli.engine.batch import ForwardBatch

    n = len(ids) + steps
    row, pages = engine.alloc_req_row(), engine.alloc_pages(-(-n // engine.spec.page_size))
    slots = engine.pool.slots_of_pages(pages)[:n]
    engine.write_page_table(row, slice(0, n), slots.to(torch.int32))
    tokens, logits, rows = [], [], []
    fb = ForwardBatch.build("prefill", ids, [row], [0], [len(ids)], slots[: len(ids)].tolist(), engine.device,
                            engine.host)
    for i in range(steps):
        out = engine.forward(fb)[0].float()
        logits.append(out)
        rows.append(streams.take())
        tok = int(out.argmax()) if forced is None else forced[i]
        tokens.append(tok)
        pos = len(ids) + i
        fb = ForwardBatch.build("decode", [tok], [row], [pos], [1], [int(slots[pos])], engine.device, engine.host)
    engine.free_pages(pages)
    engine.free_req_row(row)
    return tokens, torch.stack(logits), torch.stack(rows)


def _run(rank: int, addr: str, tp_size: int, args: argparse.Namespace, prompts: list[list[int]],
         forced: list[list[int]] | None, path: str | None) -> None:
    """One rank: build the engine, decode every prompt freely (and fed `forced` where given); rank 0 saves it."""
    from minisgl_cli.distributed import DistConfig, comm
    from minisgl_cli.engine.engine import Engine

    torch.set_num_threads(args.threads)
    tp = comm.init_tp(rank, DistConfig(tp_size=tp_size, init_addr=addr), torch.device("cpu"))
    try:
        engine = Engine(_engine_cfg(args), tp)
        if args.dense_row_split:
            _dense_row_split(engine.model)
        streams = _Streams(engine.model)
        result: dict = {"quantization": engine.quantization, "dtype": str(engine.dtype), "free": [], "forced": []}
        with torch.inference_mode():
            for i, ids in enumerate(prompts):
                result["free"].append(_greedy(engine, ids, args.max_new_tokens, None, streams))
                if forced is not None:
                    result["forced"].append(_greedy(engine, ids, args.max_new_tokens, forced[i], streams))
        if rank == 0 and path is not None:
            torch.save(result, path)
    finally:
        comm.close_tp()


def _child(rank: int, addr: str, out, *a) -> None:
    try:
        _run(rank, addr, *a)
        out.put((rank, None))
    except BaseException:  # noqa: BLE001 - the parent prints it
        out.put((rank, traceback.format_exc()))


def run_config(tp_size: int, args: argparse.Namespace, prompts: list[list[int]],
               forced: list[list[int]] | None, path: str) -> dict:
    """Run `tp_size` ranks (spawned processes meeting at a free loopback port) and return rank 0's result."""
    import multiprocessing as mp

    from minisgl_cli.api.http_server import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_child, args=(r, addr, out, tp_size, args, prompts, forced, path if r == 0 else None))
             for r in range(tp_size)]
    for p in procs:
        p.start()
    try:
        errors = [err for _, err in (out.get(timeout=args.timeout) for _ in procs) if err]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError(f"TP {tp_size} failed:\n" + "\n".join(errors))
    return torch.load(path)


def compare(tok, text: str, one, two_free, two_forced, out=print) -> dict:
    """Print one prompt's comparison; its summary: whether TP 2's free answer is TP 1's, the largest |logit
    difference| of any step, and per step where TP 2 (fed TP 1's tokens) chooses otherwise, TP 1's top-2 gap."""
    t1, l1, s1 = one
    t2, _, _ = two_free
    _, l2, s2 = two_forced
    same = t1 == t2
    out(f"\n=== {text!r}: {'SAME' if same else 'DIFFERENT'}")
    out(f"  TP 1: {tok.decode(t1)!r}")
    if not same:
        out(f"  TP 2: {tok.decode(t2)!r}")
    out(f"  {'step':>4} {'TP 1 token':<16} {'max|dlogit|':>11} {'top-2 gap':>9} {'TP 2 margin':>11}  TP 2's choice")
    first, splits, worst = None, [], 0.0
    for i in range(len(t1)):
        a, b = l1[i], l2[i]
        top = a.topk(2)
        gap = float(top.values[0] - top.values[1])
        pick2 = int(b.argmax())
        margin = float(b[t1[i]] - b[top.indices[1]])  # TP 2's logit of TP 1's token minus of TP 1's runner-up
        mark = ""
        worst = max(worst, float((a - b).abs().max()))
        if pick2 != t1[i]:
            mark = f"{tok.token_text(pick2)!r} ({'near tie' if gap < TIE else 'NOT a tie'})"
            first = i if first is None else first
            splits.append({"step": i, "gap": gap})
        out(f"  {i:>4} {tok.token_text(t1[i])!r:<16} {float((a - b).abs().max()):>11.4f} {gap:>9.4f} {margin:>11.4f}"
            f"  {mark}")
    step = first if first is not None else 0
    rel = (s1[step] - s2[step]).norm(dim=-1) / s1[step].norm(dim=-1)
    absd = (s1[step] - s2[step]).abs().amax(dim=-1)
    out(f"  residual stream at step {step} ({'the first that differs' if first is not None else 'the prompt'}),"
        " layer: max|d|, |d|/|h|")
    out("   " + "  ".join(f"L{j}: {float(absd[j]):.3g}, {float(rel[j]):.2e}" for j in range(len(rel))))
    return {"prompt": text, "same": same, "max_dlogit": worst, "splits": splits}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--prompt", action="append", help="a user message (repeatable; default: 8 built in)")
    parser.add_argument("--threads", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 2)),
                        help="torch threads per rank")
    parser.add_argument("--dense-row-split", action="store_true",
                        help="decode o_proj and down_proj through their dense weight (see the docstring)")
    parser.add_argument("--json", help="write each prompt's summary here")
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()

    from minisgl_cli.loader import resolve_model
    from minisgl_cli.tokenizer import Tokenizer

    tok = Tokenizer(resolve_model(None).path)
    texts = args.prompt or PROMPTS
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    with tempfile.TemporaryDirectory() as tmp:
        one = run_config(1, args, prompts, None, str(Path(tmp) / "tp1.pt"))
        two = run_config(2, args, prompts, [t for t, _, _ in one["free"]], str(Path(tmp) / "tp2.pt"))
    print(f"mode: quantization={one['quantization']} dtype={one['dtype']}"
          f"{' (o_proj and down_proj decode dense)' if args.dense_row_split else ''}")
    rows = [compare(tok, t, o, f, g) for t, o, f, g in zip(texts, one["free"], two["free"], two["forced"])]
    print(f"\n{sum(r['same'] for r in rows)}/{len(texts)} answers of --tp 2 are --tp 1's; largest |logit difference| "
          f"of any step {max(r['max_dlogit'] for r in rows):.4g}")
    if args.json:
        Path(args.json).write_text(json.dumps({"quantization": one["quantization"], "dtype": one["dtype"],
                                               "prompts": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
