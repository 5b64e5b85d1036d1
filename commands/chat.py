"""`minisgl chat`: talk to a model in a REPL that shows what the engine does (prefill, radix cache, decode)."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Annotated, Optional

import typer

from commands import common as c

app = typer.Typer()


def _positive(value: float) -> float:
    if not value > 0:
        raise typer.BadParameter("must be > 0")
    return value


@app.command("chat", cls=c.Command)
@c.engine_options((*c.MODEL, "max_total_tokens", "cache", *c.SPECULATIVE, *c.RUNTIME))
def chat(
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", min=1, metavar="<int>", help="Tokens per reply at most.")
    ] = 256,
    temperature: Annotated[
        float, typer.Option("--temperature", "-t", min=0.0, metavar="<float>", help="0 = greedy.")
    ] = 0.0,
    min_p: Annotated[float, typer.Option("--min-p", min=0.0, max=1.0, help=(
        "Sampling: drop tokens less likely than this times the most likely one (0 = off)."))] = 0.0,
    repetition_penalty: Annotated[float, typer.Option("--repetition-penalty", callback=_positive, help=(
        "Divide positive logits (multiply negative ones) of tokens already in the prompt or reply (1 = off)."
    ))] = 1.0,
    system: Annotated[
        Optional[str], typer.Option("--system", "-s", help="System prompt (default: the model's own).")
    ] = None,
    multi_turn: Annotated[
        bool,
        typer.Option("--multi-turn", help="Keep prior turns in context (their KV is reused through the radix cache)."),
    ] = False,
    vlm_model: Annotated[
        Optional[str],
        typer.Option(
            "--vlm-model",
            envvar="MINISGL_VLM_MODEL",
            rich_help_panel=c.MEDIA_PANEL,
            help="Vision-language model (HF dir or hub id) for /image PATH prompts: Qwen2-VL / Qwen2.5-VL run on the "
                 "engine (as the chat's model), others in transformers.",
        ),
    ] = None,
    *,
    opts: c.EngineOptions,  # the model options, --max-total-tokens and --cache go here in --help
    verbose: c.Verbose = False,
) -> None:
    """Chat with a model. Enter submits, Esc+Enter adds a newline, Ctrl-C stops a reply, Ctrl-D leaves.

    Piped (echo hi | minisgl chat): each input line is a prompt; replies go to stdout, status lines to stderr.
    """
    from rich.console import Console

    from minisgl_cli import env
    from minisgl_cli.loader.errors import ModelLoadError
    from minisgl_cli.repl.app import load_engine, run_chat
    from minisgl_cli.repl.session import ChatSession, ChatSettings
    from minisgl_cli.repl.view import ChatView
    from minisgl_cli.vision.vlm import VlmChat, VlmLoadError, on_engine

    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    out = Console(highlight=False, soft_wrap=not interactive)
    view = ChatView(out, out if interactive else Console(stderr=True, highlight=False, soft_wrap=True), verbose)
    settings = ChatSettings(max_new_tokens=max_new_tokens, temperature=temperature, min_p=min_p,
                            repetition_penalty=repetition_penalty, system=system, multi_turn=multi_turn,
                            logprobs=verbose)
    vlm = None
    if vlm_model:  # Qwen2-VL / Qwen2.5-VL: the engine's model; other families: transformers beside it
        try:
            engine_model, vlm_model, line = on_engine(vlm_model, opts.engine.model)
        except VlmLoadError as exc:
            c.fail(str(exc))
        view.note(line, style="dim")
        if engine_model is not None:
            opts = replace(opts, engine=replace(opts.engine, model=engine_model))
        vlm = VlmChat(vlm_model, env.media_device()) if vlm_model else None
    try:
        if vlm is not None:  # first: on a GPU the engine then sizes its KV pool from the memory left
            with view.loading(f"loading vision-language model {vlm_model} (transformers) ..."):
                vlm.load()
        # The compiled CPU decode step: built in the background where none is stored yet (cpu_step/compiled.py).
        opts = replace(opts, engine=replace(opts.engine, compile_in_process=True))
        client = load_engine(view, opts.engine.model, opts.engine.load_format, opts.client)
    except (ModelLoadError, VlmLoadError) as exc:
        c.fail(str(exc))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if not client.info.has_tokenizer:
        client.close()
        c.fail("chat needs a tokenizer: a built-in --load-format dummy config has none (give an HF dir as --model)")
    try:
        code = run_chat(client, ChatSession(settings), view, interactive, vlm)
    except KeyboardInterrupt:  # Ctrl-C outside a reply on a pipe: leave quietly
        code = 130
    finally:
        client.close()
    raise typer.Exit(code)
