"""`minisgl bench`: not built yet; says so and exits non-zero."""

from __future__ import annotations

import typer

app = typer.Typer()


@app.command("bench", help="(not built yet)")
def bench() -> None:
    typer.echo("minisgl bench: not built yet", err=True)
    raise typer.Exit(2)
