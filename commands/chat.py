"""`minisgl chat`: not built yet; says so and exits non-zero."""

from __future__ import annotations

import typer

app = typer.Typer()


@app.command("chat", help="(not built yet)")
def chat() -> None:
    typer.echo("minisgl chat: not built yet", err=True)
    raise typer.Exit(2)
