"""The smoke run: one request streamed to stdout through the full prefill + decode path, then a summary."""

from __future__ import annotations

import asyncio
import logging
import sys

from minisgl_cli.client.protocol import EngineClient
from minisgl_cli.types import GenerateRequest, SamplingParams

log = logging.getLogger("minisgl.smoke")


def run_smoke(client: EngineClient, prompt: str, max_new_tokens: int, temperature: float, raw: bool) -> int:
    info = client.info
    log.info("setup: model=%s engine=%s device=%s dtype=%s attention=%s eos=%s", info.name, info.engine, info.device,
             info.dtype, info.attention_backend, list(info.eos_token_ids))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    req = (GenerateRequest(prompt=prompt, params=params) if raw
           else GenerateRequest(messages=[{"role": "user", "content": prompt}], params=params))

    async def stream():
        final = None
        async for delta in client.submit(req):
            if delta.error:
                raise ValueError(delta.error)
            if delta.text:
                log.info("chunk sent: %r", delta.text)
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            final = delta
        return final

    try:
        final = asyncio.run(stream())
    finally:
        client.close()
    s = final.stats
    print(
        f"\n[smoke] model={info.name} engine={info.engine} prompt_tokens={s.prompt_tokens} "
        f"generated_tokens={s.completion_tokens} ttft={s.ttft_s * 1000:.0f}ms decode={s.decode_tok_s:.1f} tok/s "
        f"finish={final.finish_reason}"
    )
    return 0 if s.completion_tokens > 0 else 1
