"""`minisgl image`: not built yet; says so and exits non-zero."""

from __future__ import annotations

import typer

app = typer.Typer()


@app.command("image", help="(not built yet)")
def image() -> None:
    typer.echo("minisgl image: not built yet", err=True)
    raise typer.Exit(2)
