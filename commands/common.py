"""Options every engine-backed command shares, built from the engine's own declarations, and the helpers
every command uses (one-line failures, logging).

An engine option is declared once, as a field of EngineConfig or SchedulerConfig whose `metadata` holds
its flags, help, env var and bounds. `engine_options(...)` turns the fields a command offers into Typer
options in that command's signature and hands the command one `EngineOptions` built from them.
"""

from __future__ import annotations

import functools
import inspect
import logging
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

import typer

from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.scheduler.config import SchedulerConfig

Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="INFO logs narrating prefill, decode steps and chunks.")]


@dataclass(frozen=True)
class _Option:
    """One engine option: a config field's name, type and default, and its `metadata` (flags, help, env, min, max)."""

    name: str
    type: Any
    default: Any
    meta: dict[str, Any]

    def parameter(self) -> inspect.Parameter:
        """The keyword-only parameter Typer reads this option from."""
        m = self.meta
        option = typer.Option(*m["flags"], envvar=m.get("env"), help=m["help"], min=m.get("min"), max=m.get("max"))
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=self.default,
                                 annotation=Annotated[_cli_type(self.type), option])


def _cli_type(tp: Any) -> Any:
    """The type Typer parses: a Literal's values are plain strings here (help shows <str>), X | None is Optional."""
    if get_origin(tp) is Literal:
        return type(get_args(tp)[0])
    if get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp):
        (inner,) = [a for a in get_args(tp) if a is not type(None)]
        return Optional[_cli_type(inner)]
    return tp


# The one option of the command line alone: the reference stack's MODEL_LOCAL_DIR, which overrides --model.
_MODEL_LOCAL_DIR = _Option("model_local_dir", Optional[str], None, dict(
    flags=("--model-local-dir",), env="MODEL_LOCAL_DIR", help="A pre-downloaded model dir; overrides --model."))


def _declared() -> dict[str, _Option]:
    """Every engine option, in --help order: EngineConfig's fields with flags, then SchedulerConfig's."""
    out: dict[str, _Option] = {}
    for cls in (EngineConfig, SchedulerConfig):
        hints = get_type_hints(cls)
        for f in fields(cls):
            if "flags" in f.metadata:
                out[f.name] = _Option(f.name, hints[f.name], f.default, dict(f.metadata))
                if f.name == "model":
                    out[_MODEL_LOCAL_DIR.name] = _MODEL_LOCAL_DIR
    return out


_OPTIONS = _declared()
ALL: tuple[str, ...] = tuple(_OPTIONS)  # serve and bench offer every engine option
MODEL: tuple[str, ...] = ("model", "model_local_dir", "load_format", "device", "dtype", "attention_backend")
_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}
_SCHEDULER_FIELDS = {f.name for f in fields(SchedulerConfig)}


@dataclass
class EngineOptions:
    """What an engine-backed command's flags built: the engine's config and its scheduler's."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_params(cls, params: dict[str, Any], **overrides: Any) -> EngineOptions:
        """The configs from a command's option values (other params are ignored), `overrides` taking precedence."""
        values = {k: v for k, v in {**params, **overrides}.items() if k in _OPTIONS}
        local_dir = values.pop("model_local_dir", None)
        if local_dir:
            values["model"] = local_dir
        return cls(EngineConfig(**{k: v for k, v in values.items() if k in _ENGINE_FIELDS}),
                   SchedulerConfig(**{k: v for k, v in values.items() if k in _SCHEDULER_FIELDS}))

    def client(self):
        """Build the engine client; loader errors become one line on stderr and exit code 1."""
        from minisgl_cli.loader.errors import ModelLoadError

        try:
            from minisgl_cli.client import LocalClient

            return LocalClient(self.engine, self.scheduler)
        except (ModelLoadError, ValueError) as exc:
            fail(str(exc))


def engine_options(offered: Iterable[str], exclude: Iterable[str] = ()) -> Callable[[Callable], Callable]:
    """Add the engine options `offered` (names from ALL) to a command where its `opts: EngineOptions` parameter
    stands (keyword-only, after `*`), and call the command with them built into that one object."""
    names = [n for n in offered if n not in set(exclude)]
    if unknown := [n for n in names if n not in _OPTIONS]:
        raise TypeError(f"not engine options: {', '.join(unknown)}")

    def decorate(command: Callable) -> Callable:
        sig = inspect.signature(command)
        params = [_evaluated(p, command.__globals__) for p in sig.parameters.values()]
        at = [p.name for p in params].index("opts")
        params[at : at + 1] = [_OPTIONS[n].parameter() for n in names]

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            opts = EngineOptions.from_params({n: kwargs.pop(n) for n in names})
            return command(**kwargs, opts=opts)

        # Typer reads a command's options from its signature and annotations: show it the new ones
        # (inspect.signature honours __signature__; typeshed does not declare it on functions).
        run.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params if p.annotation is not p.empty}
        return run

    return decorate


def _evaluated(p: inspect.Parameter, globalns: dict[str, Any]) -> inspect.Parameter:
    """p with its annotation evaluated if it is a string (as Typer would), except `opts`, which Typer never sees."""
    if p.name == "opts" or not isinstance(p.annotation, str):
        return p
    return p.replace(annotation=eval(p.annotation, globalns))  # noqa: S307 (a command's own annotation)


def fail(message: str, code: int = 1) -> None:
    """Print one line to stderr and exit non-zero: how every command reports bad input."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
