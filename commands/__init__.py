"""Thin Typer sub-apps, one per `minisgl` subcommand: parse flags and env vars, call one front."""
