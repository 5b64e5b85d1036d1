"""`minisgl <command> --help` as a newcomer reads it: in an 80-column terminal, every option name whole."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from minisgl_cli.app import app

_CLI = typer.main.get_command(app)
COMMANDS = sorted(_CLI.commands)  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_at_80_columns_shows_every_option_name_whole(command):
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    names = [n for p in _CLI.commands[command].params for n in (*p.opts, *p.secondary_opts) if n.startswith("-")]
    for name in names:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-]|…)", result.output), (name, result.output)
    assert not re.search(r"-[\w-]*…", result.output), result.output  # no option cut short either


def test_engine_options_are_grouped_in_panels():
    out = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "80"}).output
    panels = re.findall(r"╭─ (.+?) ─", out)
    assert panels[:1] == ["Options"]
    for panel in ("Server", "Limits", "Media", "Model", "Engine", "Scheduler", "Processes and parallelism"):
        assert panel in panels, panels
