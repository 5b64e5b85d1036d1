"""Prometheus text format: one metric family, escaped label values (for `serve`'s and `router`'s /metrics)."""

from __future__ import annotations


def number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def prometheus_family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> list[str]:
    """One metric family in the text format: HELP, TYPE, then `minisgl_<name>{labels} value` per sample."""
    return [f"# HELP minisgl_{name} {help_}", f"# TYPE minisgl_{name} {kind}",
            *(f"minisgl_{name}{labels} {number(value)}" for labels, value in samples)]


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
