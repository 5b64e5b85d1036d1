"""Talk to `minisgl serve` with the official openai client: chat (stream and not), completions, models.

    minisgl serve --port 8000 &
    python examples/openai_client.py                 # or: --base-url http://host:port/v1 --api-key KEY
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none", help="The server's --api-key, if it has one.")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)

    model = client.models.list().data[0].id
    print("model:", model)

    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=32)
    print("chat:", reply.choices[0].message.content, "| usage:", reply.usage)

    print("stream: ", end="")
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=32, stream=True,
            stream_options={"include_usage": True}):
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            print(f"\n  usage: {chunk.usage.completion_tokens} tokens, "
                  f"{chunk.usage.prompt_tokens_details.cached_tokens} prompt tokens from the cache")

    sampled = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8, n=2, temperature=0.9,
        seed=7, extra_body={"top_k": 50})  # top_k and ignore_eos are extensions: send them in extra_body
    print("n=2:", [c.message.content for c in sampled.choices])

    text = client.completions.create(model=model, prompt="The three primary colors are", max_tokens=16, stop=["."])
    print("completion:", text.choices[0].text, "| finish:", text.choices[0].finish_reason)


if __name__ == "__main__":
    main()
