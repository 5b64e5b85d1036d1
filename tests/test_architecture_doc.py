"""docs/architecture.md stays true to the code: every module its map of the layers names exists, and every module of
the package is named there (a module moved, renamed or added without the map fails here)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "minisgl_cli"
DOC = REPO / "docs" / "architecture.md"
HEADER = re.compile(r"^( {0,4})(\S+)(?: {2,}|$)")  # a room's line: its path at the left, its description after
NAMED = re.compile(r"[\w./]*\w\.py\b|[\w.]*/[\w./]*\.(?:cpp|h)\b")  # a file the description names (C++ by its path)


def _rooms() -> list[tuple[Path, str]]:
    """(room path, its description) for each room of the map (the first fenced block)."""
    block = DOC.read_text().split("```")[1]
    rooms: list[tuple[Path, str]] = []
    for line in block.splitlines():
        m = HEADER.match(line)
        if m and ("/" in m.group(2) or m.group(2).endswith(".py")) and " " not in line[: len(m.group(0))].strip():
            name = m.group(2)
            base = REPO if name.split("/")[0] in ("minisgl_cli", "commands") else PACKAGE
            rooms.append((base / name.rstrip("/"), line[len(m.group(0)):]))
        elif rooms:
            rooms[-1] = (rooms[-1][0], rooms[-1][1] + " " + line.strip())
    return rooms


def _resolve(room: Path, name: str) -> Path | None:
    """The file a description names: a path from the package or the repo, or a file of its room (any depth)."""
    if "/" in name:
        for base in (PACKAGE, REPO, room if room.is_dir() else room.parent):
            if (base / name).is_file():
                return base / name
        if room.is_dir():
            return next((p for p in room.rglob(Path(name).name) if p.as_posix().endswith(name)), None)
        return None
    if room.is_dir() and (hits := sorted(room.rglob(name))):
        return hits[0]
    return PACKAGE / name if (PACKAGE / name).is_file() else None


def test_every_room_and_module_the_map_names_exists():
    missing = []
    for room, text in _rooms():
        if not room.exists():
            missing.append(str(room.relative_to(REPO)))
        missing += [f"{name} (in {room.relative_to(REPO)})" for name in NAMED.findall(text)
                    if "*" not in name and _resolve(room, name) is None]
    assert not missing, f"docs/architecture.md names what is not there: {missing}"


def test_every_module_is_on_the_map():
    named: set[Path] = set()
    for room, text in _rooms():
        if room.is_file():
            named.add(room)
        named |= {p for name in NAMED.findall(text) if (p := _resolve(room, name)) is not None}
    modules = [p for top in (PACKAGE, REPO / "commands") for p in top.rglob("*.py") if p.name != "__init__.py"]
    absent = sorted(str(p.relative_to(REPO)) for p in modules if p not in named)
    assert not absent, f"modules docs/architecture.md does not name: {absent}"
