"""Lines per room: each package of minisgl_cli (and commands/) with its line count, for the house's before/after.

Run: python examples/rooms.py [--modules]
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rooms() -> dict[str, list[tuple[str, int]]]:
    """room -> [(module file, lines)]: a room is a package directory; top-level modules are rooms of one file."""
    out: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for top in ("minisgl_cli", "commands"):
        for path in sorted((REPO / top).rglob("*")):
            if path.suffix not in (".py", ".cpp", ".h") or "web" in path.parts:
                continue
            rel = path.relative_to(REPO)
            room = str(rel.parent) if rel.parent.name != "minisgl_cli" or path.suffix != ".py" else str(rel)
            if top == "minisgl_cli" and len(rel.parts) > 2:
                room = "/".join(rel.parts[:2])  # a sub-folder (csrc, triton) belongs to its room
            out[room].append((str(rel), len(path.read_text().splitlines())))
    return out


def main() -> None:
    table = rooms()
    total = 0
    for room, files in sorted(table.items()):
        lines = sum(n for _, n in files)
        total += lines
        print(f"{room:<34} {len(files):>3} files {lines:>6} lines")
        if "--modules" in sys.argv:
            for name, n in files:
                print(f"    {name:<56} {n:>5}")
    print(f"{len(table)} rooms, {total} lines")


if __name__ == "__main__":
    main()
