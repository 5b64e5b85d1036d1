"""The KV pool: per-layer K/V slot tensors (16-bit, or FP8 codes with per-head scales), the page table, and
the page allocator with exact accounting.

An FP8 pool (`--kv-cache-dtype fp8_e4m3`) stores e4m3 codes of x - mean with one fp32 scale per (layer, KV
head) and one fp32 mean per (layer, KV head, channel), for K and for V apart (kernels/fp8.py's KVQuant: x ~
code * scale + mean). Both are set from the first prefill that reaches each layer: the mean is that batch's
per-channel mean, and the scale puts the head's largest |x - mean| at 448 / KV_SCALE_HEADROOM, so later
tokens up to that many times larger still fit before they saturate. Taking the mean out first (SageAttention's
"smooth K", and the same for V) leaves the channels that carry a large constant offset with small residuals,
so their rounding errors shrink with them; attention needs no K mean back at all (it adds q . mean to every
logit of a query row alike) and gets the V mean back by adding it to its output once (the weights sum to 1).
Alternatively one scale is given for every head (`kv_scale`) and the means stay zero.
Once set they never change (the stored codes depend on them); the kernels read them from device memory,
so CUDA graphs captured before the first prefill see the final values.

An MLA pool (`KVShape.latent`: DeepSeek's Multi-head Latent Attention) keeps one row a token and layer, [the
normalized latent (kv_lora_rank) | the rotated rope key (qk_rope_head_dim)], as K of one head; there is no V half:
`v` is a view of K's first `latent` columns (the absorbed decode's values are the latent itself), and
`bytes_per_token` counts K alone, so the same memory budget holds that many more tokens. In FP8 the row is K alone
too: codes of row - mean with K's scale (one per layer: its one head) and K's means; its values, the latent columns,
are those columns' code * scale + mean (the V scale and means stay unused).

A pool with window layers (`window_layers`: a model mixing sliding-window and full layers, Gemma 3 / 4, gpt-oss)
keeps those layers' K/V in pages of their own, fewer than the full pages: every full page a request or the prefix
cache holds may have one window page linked to it (the same positions), given back once no query reads those
positions through the window any more (scheduler/cache.py decides when). The page table keeps full slots; a window
layer finds its slot through `slot_map` (full slot -> window slot, on the device: the kernels read it), which
the scheduler writes with each step's new tokens; the host keeps `window_of` (full page -> window page, 0: none).
An entry whose window page was given back goes stale on the device: only positions behind the window, which
attention masks, ever read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl_cli.kernels.fp8 import FP8, FP8_MAX, KVQuant, dequantize, quantize

KV_SCALE_HEADROOM = 4.0  # calibrated amax lands at 448 / 4 = 112: 4x margin for later, larger K/V values
_MIN_AMAX = 1e-4  # a head that is all zeros in the first prefill still gets a usable scale


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    latent: int = 0  # MLA: each row's latent columns (kv_lora_rank), the rest its rope key; no V half (see above)
    # (KV heads, head dim) of each layer where layers differ (Gemma 4: wider global heads; 0 heads for a layer that
    # reads another's KV and stores none); () = every layer (num_kv_heads, head_dim)
    per_layer: tuple[tuple[int, int], ...] = ()

    def of(self, layer_id: int) -> tuple[int, int]:
        """Layer `layer_id`'s (KV heads, head dim)."""
        return self.per_layer[layer_id] if self.per_layer else (self.num_kv_heads, self.head_dim)

    def bytes_per_token(self, layers: tuple[int, ...] | None = None) -> int:
        """KV bytes of one token in `layers` (None: every layer)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        halves = 1 if self.latent else 2
        return halves * itemsize * sum(h * d for h, d in map(self.of, range(self.num_layers) if layers is None
                                                               else layers))


class KVPool:
    """Pages of `page_size` token slots; slot s of page p is `p * page_size + s`.

    Page 0 is reserved as a scratch page (padded CUDA-graph rows write there), so `num_pages`
    usable pages are 1..num_pages. The page table maps (request slot, position) -> KV slot.
    """

    def __init__(
        self,
        shape: KVShape,
        num_pages: int,
        page_size: int,
        max_reqs: int,
        max_context_len: int,
        device: torch.device | str,
        kv_scale: float | None = None,
        window_layers: tuple[int, ...] = (),
        num_window_pages: int = 0,
    ):
        """kv_scale: FP8 pools only: one fixed scale for every head's K and V instead of calibrating.
        window_layers: layers whose KV lives in `num_window_pages` window pages (see the module docstring)."""
        if num_pages < 1 or page_size < 1:
            raise ValueError("KV pool needs at least one page of at least one slot")
        self.shape = shape
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        num_slots = (num_pages + 1) * page_size
        if window_layers and num_window_pages < 1:
            raise ValueError("window layers need at least one window page")
        self.window_layers = frozenset(window_layers)
        self.num_window_pages = num_window_pages if window_layers else 0
        rows = [(self.num_window_pages + 1) * page_size if i in self.window_layers else num_slots
                for i in range(shape.num_layers)]
        layers = [shape.of(i) for i in range(shape.num_layers)]
        self.k = [torch.zeros((n, h, d), dtype=shape.dtype, device=device) for n, (h, d) in zip(rows, layers)]
        self.v = ([k[..., : shape.latent] for k in self.k] if shape.latent else  # MLA: views, no memory
                  [torch.zeros((n, h, d), dtype=shape.dtype, device=device) for n, (h, d) in zip(rows, layers)])
        # Window pages: full slot -> window slot on the device, full page -> window page on the host (0: none)
        self.slot_map = torch.zeros(num_slots if window_layers else 0, dtype=torch.int64, device=device)
        self.window_of = [0] * (num_pages + 1) if window_layers else []
        self._free_window_pages: list[int] = list(range(self.num_window_pages, 0, -1))
        self.quantized = shape.dtype == FP8
        # FP8: scales per (layer, KV head) and means per (layer, KV head, channel), fp32, updated in place only (sized
        # by the widest layer; a narrower layer's are the leading entries, its means contiguous [Hkv, D] as the
        # kernels read them: `_quant`).
        hmax, dmax = max(h for h, _ in layers), max(d for _, d in layers)
        heads, dims = (shape.num_layers, hmax), (shape.num_layers, hmax, dmax)
        self.k_scale = torch.full(heads, kv_scale or 1.0, dtype=torch.float32, device=device)
        self.v_scale = torch.full(heads, kv_scale or 1.0, dtype=torch.float32, device=device)
        self.k_mean = torch.zeros(dims, dtype=torch.float32, device=device)
        self.v_mean = torch.zeros(dims, dtype=torch.float32, device=device)
        self._uncalibrated = [self.quantized and kv_scale is None] * shape.num_layers
        self.max_context_len = max_context_len
        self.page_table = torch.zeros((max_reqs, max_context_len), dtype=torch.int32, device=device)
        self._free_pages: list[int] = list(range(num_pages, 0, -1))  # pop() hands out low pages first
        self._free_req_rows: list[int] = list(range(max_reqs - 1, -1, -1))

    @staticmethod
    def pages_for_budget(shape: KVShape, budget_bytes: int, page_size: int) -> int:
        return max(1, budget_bytes // (shape.bytes_per_token() * page_size))

    @staticmethod
    def split_budget(shape: KVShape, window_layers: tuple[int, ...], budget_bytes: int, page_size: int,
                     window_tokens: int) -> tuple[int, int]:
        """(full pages, window pages) of a pool with window layers in `budget_bytes`: window pages for
        `window_tokens` (what the running requests' windows need), the rest full pages; both alike where the
        budget holds no more full pages than that (short of memory, every token may as well keep its window)."""
        full = tuple(i for i in range(shape.num_layers) if i not in window_layers)
        per_full, per_window = shape.bytes_per_token(full) * page_size, shape.bytes_per_token(window_layers) * page_size
        alike = budget_bytes // (per_full + per_window)
        window = -(-window_tokens // page_size)
        if alike <= window:
            return max(1, alike), max(1, alike)
        return max(1, (budget_bytes - window * per_window) // max(per_full, 1)), window

    def nbytes(self) -> tuple[int, int]:
        """(bytes of a full page, bytes of a window page): what each page of each kind holds, every layer's."""
        full = tuple(i for i in range(self.shape.num_layers) if i not in self.window_layers)
        p = self.page_size
        return self.shape.bytes_per_token(full) * p, self.shape.bytes_per_token(tuple(self.window_layers)) * p

    # --- pages ---------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def alloc_pages(self, n: int) -> list[int] | None:
        """Take n pages (each with a window page linked, in a pool with window layers), or None (and take nothing)
        when fewer are free."""
        if n > len(self._free_pages) or (self.window_layers and n > len(self._free_window_pages)):
            return None
        taken = self._free_pages[-n:] if n else []
        del self._free_pages[len(self._free_pages) - n :]
        if self.window_layers:
            for page in taken:
                self.window_of[page] = self._free_window_pages.pop()
        return taken

    def free_pages(self, pages: list[int]) -> None:
        if self.window_layers:
            self.drop_windows(pages)
        self._free_pages.extend(pages)

    # --- window pages (a pool with window layers) ------------------------------------------------
    @property
    def num_free_window_pages(self) -> int:
        return len(self._free_window_pages)

    def drop_windows(self, pages: list[int]) -> int:
        """Give back the window pages linked to these full pages (those that have one); returns how many."""
        n = 0
        for page in pages:
            w = self.window_of[page]
            if w:
                self._free_window_pages.append(w)
                self.window_of[page] = 0
                n += 1
        return n

    def adopt_windows(self, pages: list[int], donors: list[int]) -> list[int]:
        """Each of `pages` without a window page takes its donor's (a page of the same positions and KV), where the
        donor has one; returns the pages that took one (their slot_map entries are the caller's to write)."""
        took = []
        for page, donor in zip(pages, donors):
            if not self.window_of[page] and self.window_of[donor]:
                self.window_of[page], self.window_of[donor] = self.window_of[donor], 0
                took.append(page)
        return took

    def window_slots(self, slots: list[int]) -> list[int]:
        """The window slot of each full slot (host side: `window_of`; a page with none gives scratch slot 0)."""
        p, of = self.page_size, self.window_of
        return [of[s // p] * p + s % p for s in slots]

    def loc_of(self, layer_id: int, loc: torch.Tensor) -> torch.Tensor:
        """Where layer `layer_id` stores the tokens of full slots `loc`: the slots, or a window layer's through
        `slot_map`."""
        return self.slot_map[loc] if layer_id in self.window_layers else loc

    def slot_map_of(self, layer_id: int) -> torch.Tensor | None:
        """The full -> window slot map a kernel reads for layer `layer_id`, or None (its slots are the full ones)."""
        return self.slot_map if layer_id in self.window_layers else None

    def slots_of_pages(self, pages: list[int]) -> torch.Tensor:
        """All token slots of the given pages, in order."""
        p = torch.tensor(pages, dtype=torch.int64)
        return (p[:, None] * self.page_size + torch.arange(self.page_size)[None, :]).reshape(-1)

    # --- request slots (rows of the page table) ------------------------------------------------
    @property
    def num_free_req_rows(self) -> int:
        return len(self._free_req_rows)

    def alloc_req_row(self) -> int | None:
        return self._free_req_rows.pop() if self._free_req_rows else None

    def free_req_row(self, slot: int) -> None:
        self._free_req_rows.append(slot)

    # --- KV reads and writes -------------------------------------------------------------------
    def needs_scales(self, layer_id: int) -> bool:
        """An FP8 layer whose scales the next prefill sets (see `calibrate`)."""
        return self._uncalibrated[layer_id]

    def calibrate(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Set this layer's FP8 means and scales from a prefill's K/V [T, Hkv, D] (see the module docstring)."""
        q = self._quant(layer_id)
        for mean, scale, x in ((q.k_mean, q.k_scale, k), (q.v_mean, q.v_scale, v))[: self._halves]:
            xf = x.float()
            mean.copy_(xf.mean(0))
            amax = (xf - mean).abs().amax(dim=(0, 2)).clamp_(min=_MIN_AMAX)
            scale.copy_(amax * (KV_SCALE_HEADROOM / FP8_MAX))
        self._uncalibrated[layer_id] = False

    @property
    def _halves(self) -> int:
        """The halves a row is stored in: K and V, or K alone (MLA: V is a view of it)."""
        return 1 if self.shape.latent else 2

    def _quant(self, layer_id: int) -> KVQuant:
        """Views of this layer's FP8 scales and means (its own heads and channels)."""
        h, d = self.shape.of(layer_id)
        k_mean, v_mean = (m[layer_id].view(-1)[: h * d].view(h, d) for m in (self.k_mean, self.v_mean))
        return KVQuant(self.k_scale[layer_id, :h], self.v_scale[layer_id, :h], k_mean, v_mean)

    def layer_quant(self, layer_id: int) -> KVQuant | None:
        """This layer's FP8 scales and means for a kernel, or None for a 16-bit pool."""
        return self._quant(layer_id) if self.quantized else None

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k/v [T, Hkv, D] into slots `loc` (as FP8 codes of this layer's means and scales in an FP8 pool)."""
        if not self.quantized:
            self.k[layer_id][loc] = k
            if not self.shape.latent:  # MLA: v is a view of k
                self.v[layer_id][loc] = v
            return
        q = self._quant(layer_id)
        for cache, mean, scale, x in ((self.k, q.k_mean, q.k_scale, k), (self.v, q.v_mean, q.v_scale, v))[
                : self._halves]:
            codes = quantize(x.float() - mean, scale[:, None])
            cache[layer_id].view(torch.uint8)[loc] = codes.view(torch.uint8)  # byte views: index_put on any torch

    def read(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [len(slots), Hkv, D] of these slots in `dtype` (FP8: code * scale + mean, in fp32 first)."""
        if not self.quantized:
            out = [self.k[layer_id].index_select(0, slots).to(dtype)]
            if not self.shape.latent:
                out.append(self.v[layer_id].index_select(0, slots).to(dtype))
        else:
            out = []
            q = self._quant(layer_id)
            for cache, mean, scale in ((self.k, q.k_mean, q.k_scale), (self.v, q.v_mean, q.v_scale))[: self._halves]:
                codes = cache[layer_id].view(torch.uint8).index_select(0, slots).view(FP8)
                out.append((dequantize(codes, scale[:, None]) + mean).to(dtype))
        if self.shape.latent:  # MLA: V is K's latent columns, so the rows are gathered once
            return out[0], out[0][..., : self.shape.latent]
        return out[0], out[1]
