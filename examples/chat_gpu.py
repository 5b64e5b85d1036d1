"""`minisgl chat` against the engine: the status line's decode tok/s beside the engine's batch-1 figure (issue 50).

A user's chat is batch 1 through the whole product (the REPL's client, the scheduler thread, detokenizing, the rich
view); the engine's figure is the scheduler driven directly (examples/decode_host.py). Both run the same model here,
one after the other: a model dir of a built-in config with random weights (`--load-format dummy`) and the tokenizer
files of --tokenizer (its vocabulary must cover the config's: the default SmolLM2-135M's matches the test tokenizer).
Chat reads its prompts from a pipe (`echo hi | minisgl chat`: replies on stdout, one status line a turn on stderr).

    PYTHONPATH=. python examples/chat_gpu.py [--model smollm2-135m] [--tokenizer DIR] [--tokens 512] [--turns 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import safetensors.torch
import torch

from minisgl_cli.loader.configs import builtin_config

HERE = Path(__file__).resolve().parent


def model_dir(name: str, tokenizer: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**builtin_config(name), "torch_dtype": "bfloat16"}))
    for f in tokenizer.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    # A model dir holds weights: one placeholder tensor (--load-format dummy reads none of them).
    safetensors.torch.save_file({"placeholder": torch.zeros(1)}, str(out / "model.safetensors"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a built-in config")
    ap.add_argument("--tokenizer", default=os.environ.get("MINISGL_TEST_TOKENIZER_DIR", ""))
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if not args.tokenizer:
        sys.exit("give --tokenizer DIR (or set MINISGL_TEST_TOKENIZER_DIR)")
    work = Path(tempfile.mkdtemp(prefix="chat-gpu-"))
    path = model_dir(args.model, Path(args.tokenizer), work / "model")  # not the alias: that would name the built-in
    prompts = "\n".join(f"Tell me a long story about the number {i}." for i in range(args.turns)) + "\n"
    chat = subprocess.run([sys.executable, "-m", "minisgl_cli.app", "chat", "--model", str(path), "--load-format",
                           "dummy", "--device", args.device, "-n", str(args.tokens)],
                          input=prompts, capture_output=True, text=True, timeout=600)
    turns = [(float(m.group(1)), int(m.group(2))) for m in
             re.finditer(r"decode ([\d.]+) tok/s .*?(\d+) tok out", chat.stderr)]
    if chat.returncode or not turns:
        sys.exit(f"chat failed ({chat.returncode}):\n{chat.stderr[-3000:]}")
    engine = subprocess.run([sys.executable, str(HERE / "decode_host.py"), "--model", str(path), "--device",
                             args.device, "--tokens", str(args.tokens), "--profile-steps", "10"],
                            capture_output=True, text=True, timeout=600)
    rows = [json.loads(line[7:]) for line in engine.stdout.splitlines() if line.startswith("RESULT ")]
    if engine.returncode or not rows:
        sys.exit(f"engine run failed ({engine.returncode}):\n{engine.stderr[-3000:]}")
    chat_tok_s = statistics.median(t for t, _ in turns[1:] or turns)  # the first turn also warms up
    eng = rows[0]["tok_s"]
    print(f"chat turns (decode tok/s, tokens out): {turns}")
    print(f"{'model':14} {'chat tok/s':>11} {'engine tok/s':>13} {'chat / engine':>14}")
    print(f"{args.model:14} {chat_tok_s:11.1f} {eng:13.1f} {chat_tok_s / eng:14.3f}")
    print("RESULT " + json.dumps({"model": args.model, "chat_tok_s": chat_tok_s, "engine_tok_s": eng,
                                  "ratio": round(chat_tok_s / eng, 3), "turns": turns}))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
