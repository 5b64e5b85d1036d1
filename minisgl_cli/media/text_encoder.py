"""The text encoder's work cut to the prompt's own tokens: Z-Image's prompt embeddings without its 512-token padding.

diffusers' Z-Image pads every prompt to `max_sequence_length` (512) tokens, encodes them under a padding mask and keeps
each prompt's own rows of the second-to-last layer. Its Qwen3 encoder is causal and a prompt's tokens come first, so
no kept row ever attends to a pad: encoding only as far as the batch's longest prompt (shorter ones padded on the
right, their pad rows dropped as before) gives the same rows in exact arithmetic, at a short prompt for a fifteenth of
the work. (Kernels chosen for another row count may round the last bit differently, as any batch change does.)
"""

from __future__ import annotations

import inspect
from typing import Any


def install(pipe: Any) -> bool:
    """Replace a Z-Image pipeline's `_encode_prompt` with `prompt_rows`; False (nothing done) for any other pipeline,
    or a Z-Image whose method no longer takes the arguments this one reads."""
    original = getattr(pipe, "_encode_prompt", None)
    if type(pipe).__name__ != "ZImagePipeline" or original is None:
        return False
    if list(inspect.signature(original).parameters) != ["prompt", "device", "prompt_embeds", "max_sequence_length"]:
        return False

    def encode(prompt: str | list[str], device: Any = None, prompt_embeds: Any = None,
               max_sequence_length: int = 512) -> Any:
        if prompt_embeds is not None:
            return prompt_embeds
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        return prompt_rows(pipe, prompts, device or pipe._execution_device, max_sequence_length)

    pipe._encode_prompt = encode
    return True


def prompt_rows(pipe: Any, prompts: list[str], device: Any, max_tokens: int) -> list[Any]:
    """Each prompt's embedding rows (its tokens x the encoder's width), as diffusers' Z-Image makes them: the chat
    template with thinking on, cut at `max_tokens`, the second-to-last layer's hidden states."""
    import torch

    tok = pipe.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True,
                                     enable_thinking=True) for p in prompts]
    ids = tok(texts, truncation=True, max_length=max_tokens)["input_ids"]
    longest = max(len(row) for row in ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    batch = torch.tensor([row + [pad] * (longest - len(row)) for row in ids], device=device)
    # No attention mask: causal attention alone keeps every prompt's rows off the pads after them. No KV cache: one
    # pass. (Compiling the encoder did not pay: transformers' cache and output hooks recompiled it per layer.)
    states = pipe.text_encoder(input_ids=batch, use_cache=False, output_hidden_states=True).hidden_states[-2]
    return [states[i, : len(row)] for i, row in enumerate(ids)]
