"""`minisgl serve`: not built yet; says so and exits non-zero."""

from __future__ import annotations

import typer

app = typer.Typer()


@app.command("serve", help="(not built yet)")
def serve() -> None:
    typer.echo("minisgl serve: not built yet", err=True)
    raise typer.Exit(2)
