"""`minisgl smoke`: an end-to-end streaming check — one prompt through prefill and decode to stdout."""

from __future__ import annotations

from typing import Annotated

import typer

from commands import common as c

app = typer.Typer()


@app.command("smoke", cls=c.Command)
@c.engine_options((*c.MODEL, *c.RUNTIME))
def smoke(
    prompt: Annotated[str, typer.Argument(help="Prompt (sent as one user chat message).")] = "Hello from mini-sglang",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate at most.")] = 32,
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the prompt as plain text, without the chat template.")
    ] = False,
    temperature: Annotated[float, typer.Option("--temperature", "-t")] = 0.0,
    *,
    opts: c.EngineOptions,  # the model options (c.MODEL) go here in --help
    verbose: c.Verbose = False,
) -> None:
    """Stream one reply to stdout, then a one-line summary (prompt/generated tokens, TTFT, tok/s)."""
    from minisgl_cli.smoke import run_smoke

    c.setup_logging(verbose)
    try:
        code = run_smoke(opts.client(), prompt, max_new_tokens, temperature, raw)
    except ValueError as exc:
        c.fail(str(exc))
    raise typer.Exit(code)
