"""VisionState: one engine's images — the pixels requests bring, each page-table row's M-RoPE positions and delta,
the vision tower's runs for a step's image rows, and an LRU cache of image embeddings by content hash.

A request's pixels are read when the scheduler takes the request in (every TP rank at the same point of the
same message batch), from the tensor itself in process or from shared memory (vision/pixels.py). Rank 0 unlinks a
segment once every rank has read it: after the next forward (its collectives mean every rank got that far), or
when the request ends. The tower runs at prefill, for the images whose rows the step holds and whose embeddings
are not cached, all of them in one call; a chunked prefill that cuts an image takes the rest of its rows from
the cache the next step (or runs the tower again if the cache let it go).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from minisgl_cli.distributed import TPInfo
from minisgl_cli.engine.batch import ImageChunk, StepImages
from minisgl_cli.engine.host import HostBuffers
from minisgl_cli.models.qwen2_vl import Qwen2VLForConditionalGeneration
from minisgl_cli.types import ImageInput
from minisgl_cli.vision import pixels

EMBED_CACHE_BYTES = 512 << 20  # image embeddings kept for reuse (a 448x448 image on a 7B model: 1.8 MB in bf16)


def mrope_positions(length: int, images: list[ImageInput], merge: int) -> tuple[torch.Tensor, int]:
    """A prompt's M-RoPE positions [3, length] (time, height, width) and its delta, Qwen2-VL's rule: text tokens
    count on from the last position on all three axes; an image's tokens sit on its merged grid, starting where
    the text before it stopped, and the text after it starts past its larger side. The delta (last position + 1
    - length) is what decode positions add."""
    parts, cur, at = [], 0, 0
    for img in sorted(images, key=lambda i: i.offset):
        n = img.offset - at
        parts.append(torch.arange(cur, cur + n).expand(3, n))
        cur += n
        t, gh, gw = img.grid[0], img.grid[1] // merge, img.grid[2] // merge
        if t * gh * gw != img.tokens:
            raise ValueError(f"an image's grid {img.grid} does not give its {img.tokens} placeholder tokens")
        parts.append(torch.stack((torch.arange(t).repeat_interleave(gh * gw), torch.arange(gh).repeat_interleave(gw)
                                  .repeat(t), torch.arange(gw).repeat(t * gh))) + cur)
        cur += max(gh, gw)
        at = img.offset + img.tokens
    parts.append(torch.arange(cur, cur + length - at).expand(3, length - at))
    positions = torch.cat(parts, dim=1)
    return positions, int(positions.max()) + 1 - length if length else 0


@dataclass
class _Row:
    """One page-table row's request: its images and its prompt's positions."""

    images: list[ImageInput]
    positions: torch.Tensor  # [3, prompt length] int64, on the host
    delta: int


class VisionState:
    def __init__(self, model: Qwen2VLForConditionalGeneration, max_requests: int, device: torch.device,
                 host: HostBuffers, tp: TPInfo, cache_bytes: int = EMBED_CACHE_BYTES):
        self.tower = model.visual
        self.merge = model.visual.vc.spatial_merge_size
        self.deltas = model.bind_slots(max_requests)  # the model reads them at decode
        self.device, self.host, self.tp = device, host, tp
        self.rows: dict[int, _Row] = {}
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.cache_bytes, self.cache_limit = 0, cache_bytes
        self.unconfirmed: list[str] = []  # segments rank 0 read that another rank may not have read yet
        self.encoded = self.hits = 0
        self.seconds = 0.0
        self._timing: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA runs not yet finished

    # --- requests ------------------------------------------------------------------------------
    def load(self, images: list[ImageInput]) -> None:
        """A request arrived: hold its pixels (ValueError when its shared memory is gone or not the right size)."""
        for img in images:
            if img.pixels is not None:
                continue
            if img.data is not None:  # a rank on another host than the tokenizer's: rank 0 sent the bytes
                img.pixels, img.data = pixels.from_bytes(img.data, img.shape), None
                continue
            if img.shm is None:
                raise ValueError("an image came without its pixels")
            img.pixels = pixels.read(img.shm, img.shape)
            if self.tp.rank == 0:
                if self.tp.size == 1:
                    pixels.unlink(img.shm)
                else:
                    self.unconfirmed.append(img.shm)

    def set_row(self, req_row: int, input_ids: list[int], images: list[ImageInput]) -> None:
        """A request took page-table row `req_row`: its positions there, its delta in the table decode steps read."""
        if not images:
            if self.rows.pop(req_row, None) is not None:
                self.deltas[req_row] = 0
            return
        positions, delta = mrope_positions(len(input_ids), images, self.merge)
        self.rows[req_row] = _Row(images, positions, delta)
        self.deltas[req_row] = delta

    def drop(self, images: list[ImageInput]) -> None:
        """A request ended: rank 0 unlinks its segments (read by every rank by now, or never to be read)."""
        if self.tp.rank == 0:
            for img in images:
                if img.shm is not None:
                    pixels.unlink(img.shm)

    # --- steps ---------------------------------------------------------------------------------
    def step(self, req_rows: list[int], starts: list[int], lens: list[int]) -> StepImages | None:
        """A prefill step's M-RoPE positions and image rows; None when no request in it has images (text
        positions are plain RoPE's)."""
        if not any(s in self.rows for s in req_rows):
            return None
        parts, chunks, row = [], [], 0
        for req_row, start, n in zip(req_rows, starts, lens):
            end, r = start + n, self.rows.get(req_row)
            prompt = r.positions.shape[1] if r is not None else 0
            if r is not None and start < prompt:
                parts.append(r.positions[:, start : min(end, prompt)])
                for img in r.images:
                    lo, hi = max(start, img.offset), min(end, img.offset + img.tokens)
                    if lo < hi:
                        chunks.append(ImageChunk(img, row + lo - start, lo - img.offset, hi - lo))
            tail = max(start, prompt)  # past the prompt (or no images): text, shifted by the delta
            if tail < end:
                shift = r.delta if r is not None else 0
                parts.append(torch.arange(tail + shift, end + shift).expand(3, end - tail))
            row += n
        flat = torch.cat(parts, dim=1).reshape(-1).tolist()
        return StepImages(self.host.to_device(flat, torch.int64, self.device).view(3, -1), chunks)

    def encode(self, step: StepImages) -> None:
        """The step's image embeddings and the rows they go to (the tower runs for the images not cached)."""
        if not step.chunks:
            return
        embeds: dict[str, torch.Tensor] = {}
        todo: dict[str, ImageInput] = {}
        for c in step.chunks:
            h = c.image.hash
            if h in embeds or h in todo:
                continue
            cached = self.cache.get(h)
            if cached is not None:
                self.cache.move_to_end(h)
                embeds[h] = cached
                self.hits += 1
            else:
                todo[h] = c.image
        if todo:
            embeds.update(self._run(list(todo.values())))
        rows = [torch.arange(c.row, c.row + c.count) for c in step.chunks]
        step.rows = self.host.to_device(torch.cat(rows).tolist(), torch.int64, self.device)
        step.embeds = torch.cat([embeds[c.image.hash][c.first : c.first + c.count] for c in step.chunks])

    def _run(self, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        """The tower over `images` in one call; each one's embeddings, cached."""
        timed = self._start_timing()
        grids = [(g[0], g[1], g[2]) for g in (img.grid for img in images)]
        with torch.inference_mode():
            out = self.tower(torch.cat([img.pixels for img in images]), grids)
        self._stop_timing(timed)
        self.encoded += len(images)
        result = {}
        for img, emb in zip(images, out.split([img.tokens for img in images])):
            result[img.hash] = emb
            self._remember(img.hash, emb)
        return result

    def _remember(self, key: str, emb: torch.Tensor) -> None:
        size = emb.numel() * emb.element_size()
        if size > self.cache_limit:
            return
        self.cache[key] = emb
        self.cache_bytes += size
        while self.cache_bytes > self.cache_limit:
            _, old = self.cache.popitem(last=False)
            self.cache_bytes -= old.numel() * old.element_size()

    def confirm(self) -> None:
        """A forward ran: every rank has read the segments read before it; rank 0 unlinks them."""
        for name in self.unconfirmed:
            pixels.unlink(name)
        self.unconfirmed.clear()

    # --- figures -------------------------------------------------------------------------------
    def _start_timing(self) -> object:
        if self.device.type != "cuda":
            return time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def _stop_timing(self, started: object) -> None:
        if isinstance(started, float):
            self.seconds += time.perf_counter() - started
            return
        assert isinstance(started, torch.cuda.Event)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._timing.append((started, end))

    def stats(self) -> tuple[int, int, float]:
        """(images encoded, images whose embeddings came from the cache, the tower's seconds so far)."""
        while self._timing and self._timing[0][1].query():  # finished CUDA runs: their time is known now
            start, end = self._timing.pop(0)
            self.seconds += start.elapsed_time(end) / 1000
        return self.encoded, self.hits, self.seconds
