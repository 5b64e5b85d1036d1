"""The text encoder's work cut to the prompt's own tokens: Z-Image's prompt embeddings without its 512-token padding.

diffusers' Z-Image pads every prompt to `max_sequence_length` (512) tokens, encodes them under a padding mask and keeps
each prompt's own rows of the second-to-last layer. Its Qwen3 encoder is causal and a prompt's tokens come first, so
no kept row ever attends to a pad: encoding only as far as the batch's longest prompt (shorter ones padded on the
right, their pad rows dropped as before) gives the same rows in exact arithmetic, at a short prompt for a fifteenth of
the work. (Kernels chosen for another row count may round the last bit differently, as any batch change does.)

On CUDA the pass is a CUDA graph (`EncoderGraphs`), one per prompt count and length rounded up to `BUCKET` tokens
(more right pads, the same rows): the eager pass of a 36-layer encoder at batch 1 is ~500 small launches, 35-50 ms
of host time an image for ~3 ms of device work.
"""

from __future__ import annotations

import inspect
import logging
from collections import OrderedDict
from typing import Any

log = logging.getLogger(__name__)

BUCKET = 32  # graphed passes pad a prompt's tokens up to a multiple of this
MAX_GRAPHS = 16  # (prompts, padded length) pairs kept captured, least recently used dropped


def _hidden(encoder: Any, ids: Any) -> Any:
    """The second-to-last layer's hidden states of `ids` (prompts x tokens), as diffusers' Z-Image keeps them."""
    return encoder(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states[-2]


class EncoderGraphs:
    """The text encoder's pass as CUDA graphs, one per (prompts, padded length), captured at its first use. A capture
    that fails (an op a graph cannot hold) turns the graphs off for good: the eager pass from then on."""

    def __init__(self, encoder: Any):
        self.encoder = encoder
        self.graphs: OrderedDict[tuple[int, ...], tuple[Any, Any, Any]] = OrderedDict()  # shape: graph, ids, states
        self.pool: Any = None  # one memory pool for all: one pass runs at a time
        self.failed = False

    def run(self, ids: Any) -> Any:
        """`_hidden(encoder, ids)`, replayed; the result is the graph's own buffer, valid until the next call."""
        if self.failed:
            return _hidden(self.encoder, ids)
        key = tuple(ids.shape)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(ids)
            except Exception as exc:  # noqa: BLE001 - the eager pass computes the same rows
                log.warning("text encoder: CUDA graph capture failed, running it eagerly (%s)", exc)
                self.failed, self.graphs = True, OrderedDict()
                return _hidden(self.encoder, ids)
            self.graphs[key] = entry
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        graph, static_ids, states = entry
        static_ids.copy_(ids)
        graph.replay()
        return states

    def _capture(self, ids: Any) -> tuple[Any, Any, Any]:
        import torch

        static_ids = ids.clone()
        side = torch.cuda.Stream(ids.device)
        side.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(side):  # an eager pass first: lazy state (cuBLAS handles, caches) outside the graph
            _hidden(self.encoder, static_ids)
        torch.cuda.current_stream(ids.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            states = _hidden(self.encoder, static_ids)
        return graph, static_ids, states


def install(pipe: Any, graphs: bool = False) -> bool:
    """Replace a Z-Image pipeline's `_encode_prompt` with `prompt_rows` (its pass CUDA-graphed where `graphs`); False
    (nothing done) for any other pipeline, or a Z-Image whose method no longer takes the arguments this one reads."""
    original = getattr(pipe, "_encode_prompt", None)
    if type(pipe).__name__ != "ZImagePipeline" or original is None:
        return False
    if list(inspect.signature(original).parameters) != ["prompt", "device", "prompt_embeds", "max_sequence_length"]:
        return False

    graphed = EncoderGraphs(pipe.text_encoder) if graphs else None

    def encode(prompt: str | list[str], device: Any = None, prompt_embeds: Any = None,
               max_sequence_length: int = 512) -> Any:
        if prompt_embeds is not None:
            return prompt_embeds
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        return prompt_rows(pipe, prompts, device or pipe._execution_device, max_sequence_length, graphed)

    pipe._encode_prompt = encode
    return True


def prompt_rows(pipe: Any, prompts: list[str], device: Any, max_tokens: int,
                graphs: EncoderGraphs | None = None) -> list[Any]:
    """Each prompt's embedding rows (its tokens x the encoder's width), as diffusers' Z-Image makes them: the chat
    template with thinking on, cut at `max_tokens`, the second-to-last layer's hidden states; through `graphs`'
    replays when given (the rows copied out of the graph's buffer)."""
    import torch

    tok = pipe.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                     enable_thinking=True) for p in prompts]
    ids = tok(texts, truncation=True, max_length=max_tokens)["input_ids"]
    longest = max(len(row) for row in ids)
    if graphs is not None:
        longest = -(-longest // BUCKET) * BUCKET
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    batch = torch.tensor([row + [pad] * (longest - len(row)) for row in ids], device=device)
    # No attention mask: causal attention alone keeps every prompt's rows off the pads after them. No KV cache: one
    # pass. (Compiling the encoder did not pay: transformers' cache and output hooks recompiled it per layer.)
    if graphs is None:
        states = _hidden(pipe.text_encoder, batch)
        return [states[i, : len(row)] for i, row in enumerate(ids)]
    states = graphs.run(batch)
    return [states[i, : len(row)].clone() for i, row in enumerate(ids)]
