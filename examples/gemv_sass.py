"""The MoE GEMV form's loop as an H100 / H200 runs it, without a GPU: instructions a weight value, by opcode.

Compiles kernels/triton/moe.py's `_expert_gemv_kernel` for sm_90 on this machine (Triton's `ASTSource`; the wheel
carries ptxas and cuobjdump), finds the K loop in the SASS (the last backward branch) and prints its instruction mix
over the weight values one thread covers an iteration. A proxy for where an ALU-bound GEMV's time goes, to compare
variants of the kernel before a GPU times them.

    PYTHONPATH=. python examples/gemv_sass.py [--block-n 8] [--block-k 512] [--warps 4] [--gated] [--dense]
        [--model gpt-oss-20b|qwen3-30b-a3b] [--sweep]

The arguments are specialized as Triton's JIT would for that model's experts (16-byte divisibility where it holds).

Needs triton importable (the CPU machines: PYTHONPATH=$PWD:$PWD/.venv/triton-interpreter, without TRITON_INTERPRET).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from minisgl_cli.kernels.triton import moe

# (hidden, expert intermediate, experts, top-k) of the models whose expert GEMVs these are
SHAPES = {"gpt-oss-20b": (2880, 2880, 32, 4), "qwen3-30b-a3b": (2048, 768, 128, 8)}


def launch_ints(shape: tuple[int, int, int, int], gated: bool, mxfp4: bool) -> dict[str, int]:
    """The integer arguments `moe._expert_gemv` passes for a model's contiguous expert weights (strides in the
    kernel's units: 32-bit words of codes and activation pairs for MXFP4, elements else)."""
    hidden, inter, n_exp, top_k = shape
    n, k = (inter, hidden) if gated else (hidden, inter)
    rows = 2 * n if gated else n
    per_word = 8 if mxfp4 else 1  # weight values a unit of w's stride
    return dict(N=n, K=k, E=n_exp, stride_a=k // (2 if mxfp4 else 1), stride_we=rows * k // per_word,
                stride_wn=k // per_word, stride_c=n, stride_se=rows * k // 32 if mxfp4 else rows,
                stride_sn=k // 32 if mxfp4 else 0, stride_be=rows, stride_l=n_exp)


def compile_cubin(block_n: int, block_k: int, warps: int, gated: bool, mxfp4: bool,
                  shape: tuple[int, int, int, int] = SHAPES["gpt-oss-20b"]) -> bytes:
    """The kernel for sm_90 as the JIT specializes it for `shape`: pointers 16-byte aligned (torch's allocations),
    each integer argument divisible by 16 marked so where it is (Triton's `tt.divisibility`), as a launch would."""
    ints = launch_ints(shape, gated, mxfp4)
    sig = {"a_ptr": "*i32" if mxfp4 else "*bf16", "w_ptr": "*i32" if mxfp4 else "*bf16", "s_ptr": "*u8",
           "b_ptr": "*bf16", "c_ptr": "*bf16", "rw_ptr": "*fp32", "block_expert_ptr": "*i32", "logits_ptr": "*bf16",
           **{name: "i32" for name in ints}, "limit": "fp32", "alpha": "fp32"}
    const = dict(A_DIV=shape[3] if gated else 1, GATED=gated, ROUTE=gated, HAS_SCALE=False, MXFP4=mxfp4, A_BF16=True,
                 HAS_BIAS=True, SWIGLU=True, BLOCK_N=block_n, BLOCK_K=block_k, K_P2=shape[3],
                 E_P2=shape[2], RENORMALIZE=True, USE_PDL=False)
    names = moe._expert_gemv_kernel.arg_names
    if "ASM" in names:  # (a tree before the inline PTX has none)
        const["ASM"] = True
    sig.update({name: "constexpr" for name in const})
    aligned = [name for name, ty in sig.items() if ty.startswith("*") or ints.get(name, 1) % 16 == 0]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    kernel = triton.compile(ASTSource(moe._expert_gemv_kernel, sig, constexprs=const, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))
    return kernel.asm["cubin"]


def cuobjdump(cubin: bytes, flag: str) -> str:
    """`cuobjdump FLAG` of a cubin (the wheel's own binary): -sass, -res-usage."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def compile_sass(block_n: int, block_k: int, warps: int, gated: bool, mxfp4: bool,
                 shape: tuple[int, int, int, int] = SHAPES["gpt-oss-20b"]) -> str:
    """`compile_cubin`'s SASS."""
    return cuobjdump(compile_cubin(block_n, block_k, warps, gated, mxfp4, shape), "-sass")


def loop_opcodes(sass: str) -> list[str]:
    """The opcodes between the last backward branch's target and the branch (the K loop)."""
    ins, loop = [], None
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4})\*/\s*(?:@!?U?P\w+\s+)?(\S+)(.*?);", line)
        if not m:
            continue
        addr, op = int(m.group(1), 16), m.group(2)
        ins.append((addr, op))
        branch = re.match(r"\s*0x([0-9a-f]+)", m.group(3)) if op.startswith("BRA") else None
        if branch and int(branch.group(1), 16) < addr:
            loop = (int(branch.group(1), 16), addr)
    if loop is None:
        raise SystemExit("no loop found in the SASS")
    return [op for addr, op in ins if loop[0] <= addr <= loop[1]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-n", type=int, default=8)
    ap.add_argument("--block-k", type=int, default=512)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--gated", action="store_true", help="the gate/up GEMM (two accumulators), else down")
    ap.add_argument("--dense", action="store_true", help="16-bit weights, else packed MXFP4")
    ap.add_argument("--model", choices=sorted(SHAPES), default="gpt-oss-20b", help="whose expert shapes (strides)")
    ap.add_argument("--sweep", action="store_true",
                    help="every tile of moe_tiles.GEMV_SWEEP, gate/up and down: instructions a value, registers and "
                         "stack bytes a thread (a stack frame: registers spilled)")
    args = ap.parse_args()
    if args.sweep:
        for gated in (True, False):
            for n, k, warps, _ in moe.GEMV_SWEEP:
                cubin = compile_cubin(n, k, warps, gated, not args.dense, SHAPES[args.model])
                per = len(loop_opcodes(cuobjdump(cubin, "-sass"))) / (n * k * (2 if gated else 1) / (32 * warps))
                use = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(cubin, "-res-usage"))
                assert use is not None, "cuobjdump printed no resource usage"
                print(f"{'gate/up' if gated else 'down':7s} {n:2d} rows {k:4d} deep {warps} warps: "
                      f"{per:4.1f} a value, {use[1]} registers, stack {use[2]} bytes")
        return
    ops = loop_opcodes(compile_sass(args.block_n, args.block_k, args.warps, args.gated, not args.dense,
                                    SHAPES[args.model]))
    values = args.block_n * args.block_k * (2 if args.gated else 1) // (32 * args.warps)  # a thread's, an iteration
    print(f"loop: {len(ops)} instructions for {values} weight values a thread: {len(ops) / values:.1f} a value")
    for op, n in collections.Counter(op.split(".")[0] for op in ops).most_common(12):
        print(f"  {op:8s} {n:4d}  {n / values:.2f} a value")


if __name__ == "__main__":
    main()
