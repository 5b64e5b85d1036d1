"""`minisgl <command> --help` as a newcomer reads it: in an 80-column terminal, every option name and env var name
whole, no type beside a flag, defaults written plainly, and every help string shown as written."""

from __future__ import annotations

import re

import pytest
import typer
from rich.markup import render
from typer.testing import CliRunner

from minisgl_cli.app import app

_CLI = typer.main.get_command(app)
COMMANDS = sorted(_CLI.commands)  # type: ignore[attr-defined]


def _help(command: str) -> str:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    return result.output


def _whole(word: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-]|…)", text) is not None


@pytest.mark.parametrize("command", COMMANDS)
def test_help_at_80_columns_shows_every_option_name_whole(command):
    out = _help(command)
    assert max(len(line) for line in out.splitlines()) <= 80
    params = _CLI.commands[command].params
    names = [n for p in params for n in (*p.opts, *p.secondary_opts) if n.startswith("-")]
    for name in names:
        assert _whole(name, out), (name, out)
    assert not re.search(r"-[\w-]*…", out), out  # no option cut short either


@pytest.mark.parametrize("command", COMMANDS)
def test_help_at_80_columns_cuts_no_env_var_and_reads_plainly(command):
    """Rich cuts a word wider than the help column with "…" (it did: `MINISGL_DISABLE_OVERLAP_…`); a flag takes no
    value, so no `<bool>` beside it (`--help <bool>`); a default is `[default: 4]`, not Typer's `[default: (4)]`."""
    out = _help(command)
    assert "…" not in out, [line for line in out.splitlines() if "…" in line]
    for param in _CLI.commands[command].params:
        for var in [param.envvar] if isinstance(param.envvar, str) else param.envvar or []:
            assert _whole(var, out), (var, out)
    assert "<bool>" not in out and "[default: (" not in out, out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_string_shows_as_written(command):
    """A help string is rich markup: "[len*ratio, len]" would vanish as an unknown style unless escaped."""
    for param in _CLI.commands[command].params:
        text = getattr(param, "help", None) or ""
        assert render(text).plain == re.sub(r"\\(\[)", r"\1", re.sub(r"\[/?(dim|dim yellow)?\]", "", text)), text


def test_engine_options_are_grouped_in_panels():
    out = _help("serve")
    panels = re.findall(r"╭─ (.+?) ─", out)
    assert panels[:1] == ["Options"]
    for panel in ("Server", "Limits", "Media", "Model", "Engine", "Scheduler", "Processes and parallelism"):
        assert panel in panels, panels
