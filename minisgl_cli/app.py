"""The `minisgl` Typer app: mounts one sub-app per subcommand from `commands/`."""

from __future__ import annotations

import typer

from commands import bench, chat, image, router, serve, smoke, video

app = typer.Typer(
    name="minisgl",
    help="minisgl: a compact, fast LLM serving engine and CLI toolkit.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
for module in (chat, serve, router, bench, smoke, image, video):
    app.add_typer(module.app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
