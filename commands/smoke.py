"""`minisgl smoke`: not built yet; says so and exits non-zero."""

from __future__ import annotations

import typer

app = typer.Typer()


@app.command("smoke", help="(not built yet)")
def smoke() -> None:
    typer.echo("minisgl smoke: not built yet", err=True)
    raise typer.Exit(2)
