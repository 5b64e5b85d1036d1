"""`minisgl video`: not built yet; says so and exits non-zero."""

from __future__ import annotations

import typer

app = typer.Typer()


@app.command("video", help="(not built yet)")
def video() -> None:
    typer.echo("minisgl video: not built yet", err=True)
    raise typer.Exit(2)
