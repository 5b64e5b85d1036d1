"""The text encoder's work cut to the prompt's own tokens: Z-Image's prompt embeddings without its 512-token padding.

diffusers' Z-Image pads every prompt to `max_sequence_length` (512) tokens, encodes them under a padding mask and keeps
each prompt's own rows of the second-to-last layer. Its Qwen3 encoder is causal and a prompt's tokens come first, so
no kept row ever attends to a pad: encoding only as far as the batch's longest prompt (shorter ones padded on the
right, their pad rows dropped as before) gives the same rows in exact arithmetic, at a short prompt for a fifteenth of
the work. (Kernels chosen for another row count may round the last bit differently, as any batch change does.)

The pads go up to a multiple of `BUCKET` tokens (the same rows again), so a few shapes cover all prompts: on CUDA the
pass runs as a CUDA graph per shape (media/graphs.py), where the eager pass of its 36-layer encoder at batch 1 is ~500
small launches, ~20-30 ms of host time an image for ~3 ms of device work.
"""

from __future__ import annotations

import inspect
from typing import Any

BUCKET = 32  # the pass pads its prompts' tokens up to a multiple of this


def install(pipe: Any, pool: Any = None) -> bool:
    """Replace a Z-Image pipeline's `_encode_prompt` with `prompt_rows`, its pass CUDA-graphed in `pool` (a
    media/graphs.Pool) when given; False (nothing done) for any other pipeline, or a Z-Image whose method no longer
    takes the arguments this one reads."""
    original = getattr(pipe, "_encode_prompt", None)
    if type(pipe).__name__ != "ZImagePipeline" or original is None:
        return False
    if list(inspect.signature(original).parameters) != ["prompt", "device", "prompt_embeds", "max_sequence_length"]:
        return False
    graphed = None
    if pool is not None:
        from minisgl_cli.media.graphs import Graphed

        graphed = Graphed(lambda ids: hidden(pipe.text_encoder, ids), pool, "text encoder")

    def encode(prompt: str | list[str], device: Any = None, prompt_embeds: Any = None,
               max_sequence_length: int = 512) -> Any:
        if prompt_embeds is not None:
            return prompt_embeds
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        return prompt_rows(pipe, prompts, device or pipe._execution_device, max_sequence_length, graphed)

    pipe._encode_prompt = encode
    return True


def hidden(encoder: Any, ids: Any) -> Any:
    """The second-to-last layer's hidden states of `ids` (prompts x tokens), as diffusers' Z-Image keeps them. Under
    SDPA the causal mask is handed in whole: without one, transformers checks the positions for packed sequences on
    the host (a sync, which it skips while a CUDA graph captures, building another mask: the replay would differ)."""
    import torch

    mask = None
    if getattr(encoder.config, "_attn_implementation", None) == "sdpa":
        n = ids.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril().expand(ids.shape[0], 1, n, n)
    return encoder(input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True).hidden_states[-2]


def prompt_rows(pipe: Any, prompts: list[str], device: Any, max_tokens: int, graphed: Any = None) -> list[Any]:
    """Each prompt's embedding rows (its tokens x the encoder's width), as diffusers' Z-Image makes them: the chat
    template with thinking on, cut at `max_tokens`, the second-to-last layer's hidden states; the pass through
    `graphed` (media/graphs.Graphed of `hidden`) when given."""
    import torch

    tok = pipe.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                     enable_thinking=True) for p in prompts]
    ids = tok(texts, truncation=True, max_length=max_tokens)["input_ids"]
    # Right pads up to a multiple of BUCKET, graphed or not: fewer shapes (graphs), and the same bits either way.
    longest = -(-max(len(row) for row in ids) // BUCKET) * BUCKET
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    batch = torch.tensor([row + [pad] * (longest - len(row)) for row in ids], device=device)
    # No padding mask: causal attention alone keeps every prompt's rows off the pads after them. No KV cache: one
    # pass. (Compiling the encoder did not pay: transformers' cache and output hooks recompiled it per layer.)
    states = hidden(pipe.text_encoder, batch) if graphed is None else graphed(batch)
    return [states[i, : len(row)] for i, row in enumerate(ids)]
