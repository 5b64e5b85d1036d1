"""Engine: one rank's executor — model weights, KV pool, attention backend; runs a ForwardBatch.

What a scheduler uses of it is the seam below, nothing else: `spec` (the fixed facts it plans with), `model_info`,
the KV-memory verbs its CacheManager calls (pages, page-table rows, page-table writes), the host-buffer uploads and
read-backs of a step (`build_batch`, `upload`, `readback`), `forward` / `sample` / `step`, and `start_serving` /
`compiling` / `decode_step`. Its fields (model, pool, host buffers, configs) are the engine's own and the layers below
it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from minisgl_cli.attention import create_backend
from minisgl_cli.attention.mla import create_mla_backend
from minisgl_cli.attention.torch_backend import TorchBackend
from minisgl_cli.cpu_step.compiled import CompiledDecode, StepKey
from minisgl_cli.distributed import TPInfo
from minisgl_cli.distributed.comm import broadcast_from_rank0, min_over_ranks, setup_all_reduce
from minisgl_cli.distributed.one_shot import buffer_bytes
from minisgl_cli.distributed.push_rows import FUSED_NORM_ROWS
from minisgl_cli.engine import kv_budget
from minisgl_cli.engine.batch import ForwardBatch, Mode
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.engine.graph import MAX_DEFAULT_BS, DecodeGraphs, default_max_bs
from minisgl_cli.engine.host import HostBuffers
from minisgl_cli.kvcache.pool import KVPool, KVShape
from minisgl_cli.kvcache.state import StatePool
from minisgl_cli.layers import cpu_gemm
from minisgl_cli.layers.kernel_choice import Kernels, load_sgl_kernel
from minisgl_cli.layers.quant import METHODS, Fp8BlockMethod
from minisgl_cli.loader import mxfp4
from minisgl_cli.loader.blocks import blocks_file, iter_blocks, native_quantization
from minisgl_cli.loader.configs import builtin_config
from minisgl_cli.loader.errors import ModelLoadError
from minisgl_cli.loader.hf import Weight, fp8_block_size, iter_safetensors, read_hf_config, with_fp8_blocks
from minisgl_cli.models import ModelConfig, create_model
from minisgl_cli.models.dummy import dummy_checkpoint
from minisgl_cli.models.mtp import MtpHead, create_mtp_model, dummy_extras, mtp_config, mtp_weights
from minisgl_cli.models.qwen2_vl import Qwen2VLForConditionalGeneration
from minisgl_cli.models.qwen3_next import Qwen3NextForCausalLM, state_shape
from minisgl_cli.sampling.graphs import SamplerGraphs
from minisgl_cli.sampling.sampler import Sampled, create_sampler, sample
from minisgl_cli.sampling.state import Need, SamplingBatch, SamplingState
from minisgl_cli.types import ImageInput, ModelInfo, SamplingParams
from minisgl_cli.vision.state import VisionState

log = logging.getLogger("minisgl.engine")

STATE_SHARE = 0.25  # of the memory budget, the most a linear-attention model's state slots take
WINDOW_HEADROOM = 4096  # window-pool tokens for prefill chunks beyond the running requests' windows


@dataclass(frozen=True)
class LoadedModel:
    """Where the weights came from: what the fronts report at start-up."""

    name: str
    model_dir: Path | None  # None for dummy weights (no tokenizer either)
    source: str
    load_s: float
    quantization: str = "none"  # the linear method (layers/quant.py): none, int4, int8


@dataclass(frozen=True)
class EngineSpec:
    """What a scheduler plans with: one engine's facts, fixed once it is built."""

    device: torch.device
    vocab_size: int
    max_context_len: int  # tokens one request may hold (prompt + output)
    page_size: int  # token slots per KV page
    num_pages: int  # usable KV pages
    max_requests: int  # page-table rows: requests that can hold KV at once
    eos_token_ids: frozenset[int]  # the model config's (a tokenizer may add more)
    model_dir: Path | None  # tokenizer and config files; None for dummy weights of a built-in config
    num_state_slots: int = 0  # recurrent-state slots (linear-attention models; 0: the model keeps none)
    num_state_snapshots: int = 0  # slots for the prefix cache's state snapshots (kvcache/hybrid.py)
    # Every layer attends through a sliding window (Mistral): the widest, past which a request's KV is never read
    # again (its pages behind it are given back: scheduler/cache.py); 0 where some layer attends fully
    kv_window: int = 0
    # Sliding and full layers mixed (Gemma 3 / 4, gpt-oss): the sliding layers' widest window and their window pages
    # (kvcache/pool.py; each full page a request or the cache holds may have one linked), 0 and 0 otherwise
    window: int = 0
    num_window_pages: int = 0
    page_bytes: tuple[int, int] = (0, 0)  # bytes of a full page and of a window page (for the KV byte figures)


def _kv_shape(mc: ModelConfig, rank: int, tp_size: int, dtype: torch.dtype) -> KVShape:
    """Rank `rank`'s KV pool shape: its KV heads of each layer that keeps KV (a hybrid's full-attention layers only;
    none for a layer reading another's KV: Gemma 4); MLA's one latent row a token, the same on every rank."""
    if mc.mla is not None:  # attention/mla.py
        return KVShape(mc.num_layers, 1, mc.mla.latent_dim, dtype, latent=mc.mla.kv_lora_rank)
    heads = mc.heads_of(rank, tp_size)
    per_layer = tuple((mc.heads_of(rank, tp_size, i).n_kv if mc.kv_source_of(i) == i else 0, mc.head_dim_of(i))
                      for i in range(mc.num_layers)) if mc.mixed_heads else ()
    return KVShape(len(mc.kv_layers), heads.n_kv, mc.head_dim, dtype, per_layer=per_layer)


def window_layers(mc: ModelConfig) -> tuple[int, ...]:
    """The pool layers whose KV lives in window pages: the sliding ones, where the model mixes sliding and full layers
    (where every layer slides, Mistral, all pages follow the window instead: EngineSpec.kv_window)."""
    windows = [mc.window_of(i) for i in mc.kv_layers]
    if mc.mla is not None or all(windows) or not any(windows):
        return ()
    return tuple(i for i, w in enumerate(windows) if w)


def window_tokens(window: int, page_size: int, max_requests: int) -> int:
    """Window-pool tokens an engine sizes for: each running request's window twice over (its own, and its prompt's
    last window kept in the prefix cache for a repeat), a page of slack each, and WINDOW_HEADROOM for prefill chunks
    (the scheduler cuts a chunk to what the window pages can hold)."""
    per_request = 2 * (-(-window // page_size) + 2) * page_size
    return max_requests * per_request + WINDOW_HEADROOM


def _locate(cfg: EngineConfig) -> tuple[dict, Path | None, str, str]:
    """(hf config dict, model dir or None, served name, source) for the configured model."""
    if cfg.load_format == "dummy":
        name = cfg.model or "smollm2-135m"
        try:
            return builtin_config(name), None, name, "dummy"
        except KeyError:
            pass  # not built in: use the config of a real model dir, with random weights
    from minisgl_cli.loader.resolve import resolve_model

    resolved = resolve_model(cfg.model)
    source = "dummy" if cfg.load_format == "dummy" else resolved.source
    return read_hf_config(resolved.path), resolved.path, resolved.name, source


class Engine:
    def __init__(self, cfg: EngineConfig, tp: TPInfo = TPInfo(), own_process: bool = False,
                 mtp_of: Engine | None = None):
        """`own_process`: a scheduler process's engine, whose exit the runtime makes (see --torch-compile). `mtp_of`:
        this engine runs that engine's model's MTP module (models/mtp.py; see `mtp_engine`)."""
        t0 = time.perf_counter()
        self.cfg = cfg
        self.tp = tp
        self.device = cfg.resolved_device()
        self.host = HostBuffers()  # pinned staging for this engine's batches and sampled ids
        self.keep_hidden = mtp_of is not None  # forwards keep every row's hidden state (keep_hidden_states)
        # This engine's kernels, shared by its model and attention backend (and no other engine's).
        sgl, why_not = load_sgl_kernel(self.device) if cfg.engine == "sgl" else (None, None)
        if why_not is not None and tp.rank == 0:
            log.warning("--engine sgl: %s; running the torch engine", why_not)
        self.kernels = Kernels(fused=not cfg.disable_fused_ops, pdl=not cfg.disable_pdl, cpu_gemm=cfg.cpu_gemm,
                               sgl=sgl, fused_decode=cfg.fused_decode)
        if self.device.type == "cpu" and cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        hf_cfg, model_dir, name, source = _locate(cfg)
        target_cfg = hf_cfg
        if mtp_of is not None:
            hf_cfg = mtp_config(hf_cfg)
        # A converted GGUF carries its own int4 / int8 blocks: auto keeps them on CPU (layers/quant.py).
        blocks = blocks_file(model_dir) if model_dir is not None and source != "dummy" else None
        # A block-wise FP8 checkpoint (DeepSeek-V3's): auto keeps its blocks where the GPU runs FP8, else dequantizes.
        try:
            fp8_block = fp8_block_size(hf_cfg)
        except ValueError as exc:
            raise ModelLoadError(f"model weights not usable ({exc})", model_dir or name) from None
        # An MXFP4 checkpoint (gpt-oss's): auto keeps its experts packed on CUDA where each rank's share of an
        # expert stays whole blocks, else dequantizes them as they load.
        native = (native_quantization(blocks) if blocks else "fp8-block" if fp8_block
                  else "mxfp4" if mxfp4.packs(hf_cfg, tp.size) else None)
        self.quantization = cfg.resolved_quantization(native)
        self.dtype = cfg.resolved_dtype(quantized=self.quantization != "none")
        # The modes whose decode may run compiled normalize as the compiled step does, compiled or not (layers/norm.py).
        quantized_cpu = self.device.type == "cpu" and self.quantization in ("int4", "int8")
        self.kernels.ordered_sums = quantized_cpu
        if quantized_cpu:  # they promise a row's result whatever the rows beside it (layers/cpu_gemm.py)
            self.kernels.cpu_gemm = cpu_gemm.for_quantized(self.kernels.cpu_gemm)
        self.kv_dtype = cfg.resolved_kv_dtype(self.dtype)
        try:
            self.model_cfg = ModelConfig.from_hf(hf_cfg)
        except (KeyError, ValueError) as exc:
            raise ModelLoadError(
                f"model config not usable ({exc})", model_dir or name,
                "a Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, gpt-oss, Gemma 3 / 4 (text), DeepSeek-V2 / V3, "
                "Qwen3-Next, Qwen3.5 (text), Qwen2-VL or Qwen2.5-VL config",
            ) from None
        mc = self.model_cfg
        if tp.size > 1 and self.device.type == "cuda":
            # The one-shot all-reduce takes messages up to the largest decode batch the graphs may capture.
            rows = min(cfg.cuda_graph_max_bs or MAX_DEFAULT_BS, cfg.max_running_requests)
            nbytes = buffer_bytes(rows * mc.hidden_size * self.dtype.itemsize, tp.size)
            # The fused all-reduce + RMSNorm: small decode batches, where kernel latency is the step's cost.
            push = (min(rows, FUSED_NORM_ROWS), mc.hidden_size)
            self.tp = tp = setup_all_reduce(tp, self.device, self.dtype, nbytes, push)

        # Allocate parameters straight on the device in the engine dtype (no fp32 CPU copy of an 8B model).
        with torch.device(self.device):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                method = Fp8BlockMethod(fp8_block) if fp8_block and self.quantization == "fp8-block" else (
                    METHODS[self.quantization]())
                self.model = (create_model(mc, tp, self.kernels, method) if mtp_of is None else
                              create_mtp_model(mc, tp, self.kernels, method)).eval()
            finally:
                torch.set_default_dtype(prev)
        weights: Iterable[tuple[str, Weight]]
        gguf_blocks = blocks is not None and METHODS[self.quantization].takes_blocks
        if source == "dummy":  # an MXFP4 config's experts as random bytes and exponents, as its checkpoints ship them
            weights = dummy_checkpoint(mc, self.device, self.dtype, seed=cfg.seed, mxfp4=mxfp4.is_mxfp4(hf_cfg))
        elif gguf_blocks:
            assert blocks is not None
            weights = iter_blocks(blocks)  # the GGUF's blocks as shipped, no fp32 round trip
        else:
            assert model_dir is not None  # _locate gives a dir for every source but built-in dummies
            weights = iter_safetensors(model_dir)
            weights = with_fp8_blocks(weights, fp8_block) if fp8_block else weights
        if mxfp4.is_mxfp4(hf_cfg) and not gguf_blocks:  # gpt-oss's experts: packed, or dequantized as they stream in
            e, h, i = mc.num_experts, mc.hidden_size, mc.moe_intermediate_size
            weights = mxfp4.expert_weights(weights, self.dtype, self.device,
                                           {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}, model_dir or name,
                                           packed=self.quantization == "mxfp4")
        if mtp_of is not None:
            weights = (itertools.chain(weights, dummy_extras(mc.hidden_size, self.device, self.dtype, cfg.seed))
                       if source == "dummy" else mtp_weights(weights, target_cfg))
        self.model.load_weights(weights)
        if isinstance(self.model, MtpHead):
            assert mtp_of is not None  # the one way it is built
            self.model.share(mtp_of.model)

        # A linear-attention model's state slots come first (kvcache/state.py): the KV pool takes what is left.
        self.state = self._state_pool() if mc.linear_attn is not None and mc.linear_attn.layers else None
        if self.state is not None:
            assert isinstance(self.model, Qwen3NextForCausalLM)  # the one family with linear-attention layers
            self.model.bind_state(self.state)
        heads = mc.heads_of(tp.rank, tp.size)
        shape = _kv_shape(mc, tp.rank, tp.size, self.kv_dtype)
        # Every rank must hold the same number of pages (they schedule alike): size by the rank with
        # the most KV bytes, then take the smallest count any rank can afford.
        widest = max((_kv_shape(mc, r, tp.size, self.kv_dtype) for r in range(tp.size)),
                     key=KVShape.bytes_per_token)
        windowed = window_layers(mc)
        window = max(mc.window_of(mc.kv_layers[i]) for i in windowed) if windowed else 0
        self.split: kv_budget.Split | None = None  # CUDA: the free memory's split (_kv_pages)
        num_pages, num_window_pages = self._kv_pages(widest, windowed, window)
        num_pages, num_window_pages = min_over_ranks(num_pages, tp), min_over_ranks(num_window_pages, tp)
        capacity = num_pages * cfg.page_size
        self.max_context_len = min(self._longest_context(), capacity)
        self.pool = KVPool(shape, num_pages, cfg.page_size, cfg.max_running_requests, self.max_context_len, self.device,
                           kv_scale=cfg.kv_cache_scale, window_layers=windowed, num_window_pages=num_window_pages)
        if self.split is not None:
            full_page, window_page = self.pool.nbytes()
            self.split.report(capacity, full_page * num_pages + window_page * num_window_pages)
        self.attn = create_backend(
            cfg.attention_backend, self.pool, heads.n_q, heads.n_kv,
            mc.head_dim, mc.attn_scale, self.device, self.kernels, variants=mc.attention_variants,
            layer_heads=tuple(mc.heads_of(tp.rank, tp.size, i).n_q for i in range(mc.num_layers)) if mc.mixed_heads
            else (),
        ) if mc.mla is None else create_mla_backend(cfg.attention_backend, self.pool, heads.n_q, mc.mla.kv_lora_rank,
                                                    mc.mla.qk_rope_head_dim, mc.attn_scale, self.kernels)
        # Every request's sampling parameters on the device, by page-table row (written when a request takes its row).
        self.sampling = SamplingState(cfg.max_running_requests, mc.vocab_size, self.device, self.host, cfg.seed)
        self.sampler = create_sampler(self.device, mc.vocab_size, cfg.sampler)
        # A vision-language model's images: pixels, M-RoPE positions, the tower's runs (vision/state.py).
        self.vision = (VisionState(self.model, cfg.max_running_requests, self.device, self.host, tp)
                       if isinstance(self.model, Qwen2VLForConditionalGeneration) else None)
        self.graphs: DecodeGraphs | None = None
        self.sampler_graphs: SamplerGraphs | None = None
        if self.device.type == "cuda":
            if not cfg.disable_cuda_graph and getattr(self.attn, "supports_cuda_graph", False):
                if self.model.graph_safe(self.device, self.dtype):
                    self.capture_graphs()
                elif tp.rank == 0:
                    log.warning("decode runs without CUDA graphs: the MoE experts need the fused Triton ops (16-bit) "
                                "or torch's grouped GEMM (bf16, SM 9.x / 10.x, torch 2.8+); elsewhere they read "
                                "expert row counts back each step")
        self.compiled: CompiledDecode | None = None
        step = cfg.decode_step(self.quantization, self.kv_dtype, tp.size, own_process,
                               eager_only=bool(mc.num_experts) or mc.attention_variants or mc.mla is not None
                               or self.state is not None)
        if step != "off" and isinstance(self.attn, TorchBackend):
            key = StepKey.of(cfg, mc, model_dir, source, self.dtype, self.kv_dtype, self.quantization)
            self.compiled = CompiledDecode(cfg, self.attn, key, builds=step == "build")  # builds from start_serving
        self.loaded = LoadedModel(name, model_dir, source, time.perf_counter() - t0, self.quantization)
        self.spec = EngineSpec(self.device, mc.vocab_size, self.max_context_len, cfg.page_size, num_pages,
                               cfg.max_running_requests, frozenset(mc.eos_token_ids), model_dir,
                               self.state.num_slots if self.state is not None else 0,
                               self.state.num_snapshots if self.state is not None else 0,
                               kv_window=max(mc.layer_windows) if all(mc.layer_windows or (0,)) else 0,
                               window=window, num_window_pages=self.pool.num_window_pages,
                               page_bytes=self.pool.nbytes())
        log.info(
            "engine ready: model=%s source=%s device=%s dtype=%s quantization=%s kv_cache_dtype=%s backend=%s "
            "sampler=%s kv_tokens=%d window_tokens=%d page_size=%d eos=%s (%.1fs)",
            name, source, self.device, str(self.dtype).removeprefix("torch."), self.quantization,
            str(self.kv_dtype).removeprefix("torch."), self.attn.name, self.sampler.name, capacity,
            num_window_pages * cfg.page_size, cfg.page_size, list(mc.eos_token_ids), self.loaded.load_s,
        )

    def model_info(self, *, overlap: bool, eos_token_ids: Iterable[int], prefix_cache: str | None,
                   speculative: str = "") -> ModelInfo:
        """What a front may know of this engine, under a scheduler that runs with `overlap`, stops on
        `eos_token_ids`, reuses prefixes through `prefix_cache` (None: no reuse) and speculates as `speculative`
        says ("": not)."""
        spec, loaded = self.spec, self.loaded
        return ModelInfo(
            loaded.name, loaded.source, str(self.device), str(self.dtype).removeprefix("torch."), self.attn.name,
            str(spec.model_dir) if spec.model_dir is not None else None, spec.vocab_size, spec.page_size,
            spec.max_requests, spec.max_context_len, spec.num_pages * spec.page_size, loaded.load_s, overlap,
            tuple(sorted(eos_token_ids)), self.tp.size, "sgl" if self.kernels.sgl is not None else "torch",
            quantization=self.quantization, kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            prefix_cache=prefix_cache, sampler=self.sampler.name, speculative=speculative,
            images=self.vision is not None,
        )

    def draft_engine(self, model: str) -> Engine:
        """An engine for a speculative draft model beside this one (scheduler/draft_model.py): the same device and
        modes, TP 1, a KV pool of as many tokens as this one's, no compiled decode."""
        cfg = dataclasses.replace(self.cfg, model=model, max_total_tokens=self.spec.num_pages * self.spec.page_size,
                                  device=str(self.device), torch_compile="off", keep_free=None)
        return Engine(cfg)

    def mtp_engine(self) -> Engine:
        """An engine for this model's MTP module (models/mtp.py; scheduler/mtp.py), like `draft_engine`'s: the same
        device and modes; a one-layer KV pool, on the CPU of as many tokens as this one's, on CUDA of what the memory
        this one left holds (its --mem-fraction of it: a pool of all this one's tokens need not fit beside it; a
        request its pool has no room for gets no drafts); on CUDA its chained decode rows replay graphs that take each
        row's input state beside its token. ValueError where the model ships no MTP layer."""
        tokens = self.spec.num_pages * self.spec.page_size if self.device.type == "cpu" else None
        cfg = dataclasses.replace(self.cfg, max_total_tokens=tokens, device=str(self.device), torch_compile="off",
                                  keep_free=None)
        return Engine(cfg, mtp_of=self)

    def keep_hidden_states(self) -> None:
        """Every forward from now on keeps each row's last hidden state in its batch's `hidden` (an MTP proposer reads
        them): the decode graphs are captured again with a buffer for them."""
        self.keep_hidden = True
        if self.graphs is not None:
            self.capture_graphs(self.graphs.max_bs)

    def start_serving(self) -> None:
        """The scheduler starts stepping: start what runs beside serving (the CPU decode's compile)."""
        if self.compiled is not None:
            self.compiled.start()

    @property
    def compiling(self) -> bool:
        """Whether the CPU decode's compiled step is being built in the background (cpu_step/compiled.py)."""
        return self.compiled is not None and self.compiled.compiling

    @property
    def decode_step(self) -> str:
        """What runs a decode step on the CPU: compiled, building (eager meanwhile) or eager (cpu_step/compiled.py)."""
        return self.compiled.state if self.compiled is not None else "eager"

    def _state_pool(self) -> StatePool:
        """Recurrent-state slots for a linear-attention model: one per running request (--max-running-requests) and
        as many for the prefix cache's snapshots, within STATE_SHARE of the memory budget the KV pool is sized by (on
        CUDA the pool then sizes itself from what is left; on the CPU --kv-cache-gib stays the KV pool's own)."""
        cfg = self.cfg
        shape = state_shape(self.model_cfg, self.dtype, self.tp)
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            budget = kv_budget.split(free, kv_budget.shares_device(cfg.keep_free, self.device),
                                     mem_fraction=cfg.mem_fraction).kv_bytes
        else:
            budget = int(cfg.kv_cache_gib * (1 << 30))
        # every rank the same count (they schedule alike)
        slots = min_over_ranks(min(cfg.max_running_requests, int(budget * STATE_SHARE) // (2 * shape.bytes_per_slot())),
                               self.tp)
        if slots < 1:
            raise ValueError(f"one request's recurrent state takes {shape.bytes_per_slot() / 2**20:.1f} MiB: two "
                             f"(its slot and a snapshot) exceed {STATE_SHARE:.0%} of the {budget / 2**30:.1f} GiB "
                             "memory budget")
        return StatePool(shape, slots, cfg.max_running_requests, self.device, num_snapshots=slots)

    def _kv_pages(self, shape: KVShape, windowed: tuple[int, ...] = (), window: int = 0) -> tuple[int, int]:
        """(full pages, window pages) of the KV pool: by --max-total-tokens (full pages, and window pages for the
        running requests' windows, `window_tokens`, at most as many), else by the memory budget (`KVPool.split_budget`
        with window layers); on CUDA, beside what `keep_free` keeps (engine/kv_budget.py)."""
        cfg = self.cfg
        cuda = self.device.type == "cuda"
        if cuda:  # the loading's temporaries (dequantized experts, say) back to the device first
            torch.cuda.empty_cache()
        self._free_after_weights = free = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        keep = kv_budget.shares_device(cfg.keep_free, self.device) if cuda else None
        want = window_tokens(window, cfg.page_size, cfg.max_running_requests) if windowed else 0
        if cfg.max_total_tokens:
            pages = max(1, cfg.max_total_tokens // cfg.page_size)
            win = min(pages, -(-want // cfg.page_size)) if windowed else 0
            full = tuple(i for i in range(shape.num_layers) if i not in windowed)
            need = ((pages + 1) * cfg.page_size * shape.bytes_per_token(full)  # + the scratch pages
                    + (win + 1) * cfg.page_size * shape.bytes_per_token(windowed))
            if cuda and need > free:  # refused, not a CUDA OOM traceback
                raise ValueError(f"--max-total-tokens {cfg.max_total_tokens:,} needs a {need / 2**30:.1f} GiB KV pool "
                                 f"and {free / 2**30:.1f} GiB of {self.device} is free after the "
                                 "weights: lower it, or leave it out to size the pool by --mem-fraction")
            if cuda:
                self.split = kv_budget.split(free, keep, pool_bytes=need, device=str(self.device))
            return pages, win
        if cuda:
            self.split = kv_budget.split(free, keep, mem_fraction=cfg.mem_fraction, device=str(self.device),
                                         min_pool=kv_budget.MIN_KV_TOKENS * shape.bytes_per_token())
            budget = self.split.kv_bytes
        else:
            budget = int(cfg.kv_cache_gib * (1 << 30))
        # No more pages than the running requests can fill, each at its longest context: past that a budget only
        # lengthens the host's free-page list (a tiny model on a 141 GB card listed ~10^8 pages, minutes at start).
        most = -(-cfg.max_running_requests * self._longest_context() // cfg.page_size)
        if windowed:
            full_pages, window_pages = KVPool.split_budget(shape, windowed, budget, cfg.page_size, want)
            return min(full_pages, most), min(window_pages, most)
        return min(KVPool.pages_for_budget(shape, budget, cfg.page_size), most), 0

    def _longest_context(self) -> int:
        """Tokens one request may hold before the pool's size caps it: --max-context-len within the model's."""
        mpe = self.model_cfg.max_position_embeddings
        return min(self.cfg.max_context_len or mpe, mpe)

    def capture_graphs(self, max_bs: int | None = None) -> None:
        """(Re)capture the decode CUDA graphs, e.g. after flipping a field of `self.kernels`."""
        if max_bs is None:
            max_bs = self.cfg.cuda_graph_max_bs
        if max_bs is None:
            max_bs = default_max_bs(self._free_after_weights, self.cfg.max_running_requests)
        # Every rank captures the same sizes (free memory may differ): a batch pads alike on all, so their
        # collectives meet with the same shapes.
        max_bs = min_over_ranks(max_bs, self.tp)
        self.graphs = self.sampler_graphs = None
        torch.cuda.empty_cache()
        graphs = DecodeGraphs(self.model, self.attn, max_bs, self.model_cfg.vocab_size, self.device, self.dtype,
                              hidden=self.model_cfg.hidden_size if self.keep_hidden else 0,
                              takes_hidden=isinstance(self.model, MtpHead))
        graphs.capture()
        self.graphs = graphs
        if self.sampler.name == "triton":  # small sampled batches draw by replay too (sampling/graphs.py)
            self.sampler_graphs = SamplerGraphs(graphs, self.sampling, self.sampler.draw)
            self.sampler_graphs.capture()

    def decode_rows(self, rows: int) -> None:
        """Decode steps will run up to `rows` rows (speculative decoding's verify steps: k + 1 per request): on CUDA,
        capture graphs that far, within the memory-based cap (an explicit --cuda-graph-max-bs stays as it is)."""
        if self.graphs is None or self.cfg.cuda_graph_max_bs is not None:
            return
        want = default_max_bs(self._free_after_weights, rows)
        if want > self.graphs.max_bs:
            self.capture_graphs(want)

    # --- KV memory: the pool's pages and page-table rows (the scheduler's CacheManager alone calls these) ----------
    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free_pages

    def alloc_pages(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer are free."""
        return self.pool.alloc_pages(n)

    def free_pages(self, pages: list[int]) -> None:
        self.pool.free_pages(pages)

    @property
    def num_free_window_pages(self) -> int:
        return self.pool.num_free_window_pages

    def drop_windows(self, pages: list[int]) -> int:
        """Give back the window pages linked to these full pages (kvcache/pool.py); how many there were."""
        return self.pool.drop_windows(pages)

    def window_pages(self, pages: list[int]) -> list[int]:
        """The window page linked to each full page (0: none)."""
        return [self.pool.window_of[pg] for pg in pages]

    def adopt_windows(self, pages: list[int], donors: list[int]) -> None:
        """Each of `pages` (the prefix cache's) without a window page takes the one of its donor (a request's page of
        the same positions, about to be freed), where that has one: slot_map follows (one device op)."""
        took = self.pool.adopt_windows(pages, donors)
        if took:
            p = self.pool.page_size
            slots = [pg * p + i for pg in took for i in range(p)]
            self.write_slot_map(self.upload(slots, torch.int64), self.upload(self.window_slots(slots), torch.int64))

    def window_slots(self, slots: list[int]) -> list[int]:
        """The window slot of each full slot (host side)."""
        return self.pool.window_slots(slots)

    def write_slot_map(self, loc: torch.Tensor, window_loc: torch.Tensor) -> None:
        """slot_map[loc] = window_loc (int64, on the device): where the window layers keep a step's new tokens."""
        self.pool.slot_map[loc] = window_loc

    def alloc_req_row(self) -> int | None:
        """A free page-table row, or None when every row is taken."""
        return self.pool.alloc_req_row()

    def free_req_row(self, req_row: int) -> None:
        self.pool.free_req_row(req_row)

    # --- recurrent-state slots of a linear-attention model (kvcache/state.py; the CacheManager alone calls these) -
    @property
    def num_free_state_slots(self) -> int:
        return self.state.num_free if self.state is not None else 0

    def alloc_state_slot(self, req_row: int) -> int | None:
        """A zeroed state slot for the request in page-table row `req_row`, or None (nothing taken) if none is free."""
        assert self.state is not None  # only asked of a linear-attention model
        return self.state.alloc(req_row)

    def free_state_slot(self, slot: int, req_row: int) -> None:
        assert self.state is not None
        self.state.free(slot, req_row)

    @property
    def num_free_state_snapshots(self) -> int:
        return self.state.num_free_snapshots if self.state is not None else 0

    def alloc_state_snapshot(self) -> int | None:
        """A snapshot slot for the prefix cache, or None when none is free."""
        assert self.state is not None
        return self.state.alloc_snapshot()

    def free_state_snapshot(self, slot: int) -> None:
        assert self.state is not None
        self.state.free_snapshot(slot)

    def copy_state(self, src: int, dst: int) -> None:
        """State slot `dst` takes slot `src`'s state (queued on the device after the steps launched before)."""
        assert self.state is not None
        self.state.copy(src, dst)

    def write_step_rows(self, fb: ForwardBatch) -> None:
        """page_table[row of each new token of the step, its position] = its KV slot: left to the forward where a
        decode graph will take the step (its replay writes them in its input launch: `fb.page_write`), else now."""
        if self._graph_takes(fb) and fb.decode_rows is not None and fb.out_cache_loc32 is not None:
            fb.page_write = True
            return
        loc = fb.out_cache_loc32 if fb.out_cache_loc32 is not None else fb.out_cache_loc.to(torch.int32)
        if fb.is_decode:
            rows = fb.req_rows
        else:
            rows = torch.repeat_interleave(fb.req_rows, fb.extend_lens, output_size=fb.num_tokens)
        self.write_page_table(rows, fb.positions, loc)

    def _graph_takes(self, batch: ForwardBatch) -> bool:
        """Whether `forward` replays a decode graph for `batch` (a linear-attention model's verify step runs eagerly:
        its layers run each request's rows in order)."""
        return (self.graphs is not None and self.graphs.can_run(batch)
                and (batch.runs is None or self.state is None))

    def write_page_table(self, rows: int | torch.Tensor, positions: slice | torch.Tensor,
                         slots: torch.Tensor) -> None:
        """page_table[rows, positions] = slots (int32, on the device): one device op."""
        self.pool.page_table[rows, positions] = slots

    def commit_verify(self, accepted: list[int]) -> None:
        """After a verify step, each request's rows accepted (1 + its accepted drafts), in the step's order: a
        linear-attention model's states advance over those only (a no-op for other models)."""
        if self.state is not None:
            assert isinstance(self.model, Qwen3NextForCausalLM)
            self.model.commit_verify(accepted)

    # --- a request's images (a vision-language model's; vision/state.py) ------------------------------------------
    def load_images(self, images: list[ImageInput]) -> None:
        """A request arrived with images: hold their pixels (ValueError, the request's fault, when it cannot)."""
        if images and self.vision is None:
            raise ValueError(f"{self.loaded.name} takes no images (a Qwen2-VL / Qwen2.5-VL model does)")
        if images and self.vision is not None:
            self.vision.load(images)

    def set_image_row(self, req_row: int, input_ids: list[int], images: list[ImageInput]) -> None:
        """A request took page-table row `req_row` (as set_sampling_row): its images' positions go there."""
        if self.vision is not None:
            self.vision.set_row(req_row, input_ids, images)

    def drop_images(self, images: list[ImageInput]) -> None:
        """A request ended: what shared memory its images still hold goes."""
        if images and self.vision is not None:
            self.vision.drop(images)

    def vision_stats(self) -> tuple[int, int, float]:
        """(images the tower encoded, images served from its cache, the tower's seconds)."""
        return self.vision.stats() if self.vision is not None else (0, 0, 0.0)

    # --- a step's host <-> device traffic, through this engine's pinned buffers -----------------------------------
    def build_batch(self, mode: Mode, input_ids: list[int], req_rows: list[int], prefix_lens: list[int],
                    extend_lens: list[int], out_cache_loc: list[int]) -> ForwardBatch:
        """A ForwardBatch on this engine's device (see `ForwardBatch.build`: never waits on the step in flight)."""
        fb = ForwardBatch.build(mode, input_ids, req_rows, prefix_lens, extend_lens, out_cache_loc, self.device,
                                self.host)
        if mode == "prefill" and self.vision is not None:
            fb.images = self.vision.step(req_rows, prefix_lens, extend_lens)
        return fb

    def upload(self, data: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A host int list on this engine's device, asynchronously on CUDA (see `HostBuffers.to_device`)."""
        return self.host.to_device(data, dtype, self.device)

    def readback(self, n: int) -> torch.Tensor:
        """A pinned int64 host buffer of n entries for sampled ids (valid until 3 more calls)."""
        return self.host.readback(n)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] (engine dtype) of each request's last token (decode through a CUDA graph when one fits)."""
        batch.keep_hidden = self.keep_hidden
        if self._graph_takes(batch):
            assert self.graphs is not None
            logits = self.graphs.replay(batch, self.pool.page_table if batch.page_write else None)
            batch.page_write = False
            if self.keep_hidden:  # a copy: the static buffer is the next replay's
                batch.hidden = self.graphs.hidden[: batch.batch_size].clone()
            return logits
        if batch.page_write:  # deferred, but no graph takes the step (its eligibility changed since): write now
            batch.page_write = False
            self.write_step_rows(batch)
        if self.compiled is not None and self.compiled.can_run(batch):
            hidden = self.compiled.run(batch)
            if hidden is not None:  # a decode step's: one row a request
                batch.hidden = hidden if self.keep_hidden else None
                return self.model.logits(hidden)
        if batch.images is not None:
            assert self.vision is not None  # only its build_batch sets them
            self.vision.encode(batch.images)
        self.attn.prepare(batch)
        logits = self.model.logits(self.model(batch, self.attn))
        if self.vision is not None:
            self.vision.confirm()
        return logits

    def set_sampling_row(self, req_row: int, params: SamplingParams, input_ids: list[int],
                         output_ids: list[int]) -> None:
        """A request took page-table row `req_row`: its sampling state goes there (on the device with the next step)."""
        self.sampling.set_row(req_row, params, input_ids, output_ids)

    def sampling_batch(self, batch: ForwardBatch, req_rows: list[int], produces: list[bool],
                       drafts: list[list[int]] | None = None) -> SamplingBatch:
        """The step's rows for the sampler (`req_rows`: the batch's page-table rows; `produces`: which rows draw a real
        token -- a chunk of a long prompt does not; `drafts`: a verify step's, per request, see SamplingState)."""
        return self.sampling.batch(req_rows, batch.req_rows, batch.seq_lens, produces, logprobs=self.tp.rank == 0,
                                   drafts=drafts)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: SamplingBatch, bitmask: torch.Tensor | None = None) -> Sampled:
        """The next token per request (left on the device); logprobs on rank 0 only, the one that reports them."""
        sg = self.sampler_graphs
        drawn = self.graphs.greedy_of(logits) if self.graphs is not None and rows.plain and bitmask is None else None
        if drawn is not None:  # the decode graph took the argmax already
            out = Sampled(drawn)
        elif sg is not None and bitmask is None and sg.takes(logits, rows):
            out = Sampled(sg.draw(logits.shape[0], rows.needs))
        else:
            out = sample(logits, rows, self.sampling, self.sampler, bitmask)
        if self.tp.size > 1 and rows.needs & Need.SAMPLED:
            broadcast_from_rank0(out.next_ids, self.tp)  # random draws: every rank feeds rank 0's tokens next
        self.sampling.record(rows, out.next_ids)
        return out

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, rows: SamplingBatch, bitmask: torch.Tensor | None = None) -> Sampled:
        """Forward and sample (`bitmask`: the grammar's allowed tokens per row, xgrammar's layout)."""
        return self.sample(self.forward(batch), rows, bitmask)
