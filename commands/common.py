"""Options every engine-backed command shares, built from the engine's own declarations, and the helpers
every command uses (one-line failures, logging).

An engine option is declared once, as a field of EngineConfig, SchedulerConfig or RuntimeConfig whose
`metadata` holds its flags, help, env var and bounds. `engine_options(...)` turns the fields a command offers into Typer
options in that command's signature and hands the command one `EngineOptions` built from them.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, field, fields, replace
from enum import Enum
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    Literal,
    NoReturn,
    Optional,
    Union,
    cast,
    get_args,
    get_origin,
    get_type_hints,
)

import typer
from typer.core import TyperCommand, TyperOption

from minisgl_cli import notice
from minisgl_cli.engine.config import EngineConfig, EngineImpl
from minisgl_cli.runtime.config import RuntimeConfig
from minisgl_cli.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    from minisgl_cli.client.protocol import EngineClient

# The --help panels (Typer's rich_help_panel). Options a command adds go to the panel of their kind; the engine
# options get theirs from the config that declares them (_declared). docs/options.md holds the details.
MODEL_PANEL = "Model"
ENGINE_PANEL = "Engine"
SCHEDULER_PANEL = "Scheduler"
PARALLEL_PANEL = "Processes and parallelism"
SERVER_PANEL = "Server"
LIMITS_PANEL = "Limits"
MEDIA_PANEL = "Media"
SPEED_PANEL = "Speed"  # the diffusion pipelines' speed options (image, video; serve's with a media prefix)
BENCH_PANEL = "Bench"
ONLINE_PANEL = "Bench a server (--url)"


def in_panel(panel: str) -> Callable[..., Any]:
    """typer.Option for the options of one --help panel: `server = in_panel(SERVER_PANEL)`, then
    `server("--flag", help=...)`."""
    return functools.partial(typer.Option, rich_help_panel=panel)


def pipeline_options(model_env: str, dir_env: str, dir_default: str) -> tuple[Any, Any]:
    """The --model and --model-dir options of a diffusion command (image, video): a hub repo id or a local dir,
    and where its weights live."""
    model = typer.Option(envvar=model_env, rich_help_panel=MODEL_PANEL, help="Hub repo id or local pipeline dir.")
    model_dir = typer.Option(
        envvar=dir_env, rich_help_panel=MODEL_PANEL, show_default=dir_default,
        help="Local pipeline dir (with model_index.json); the weights are fetched here if missing.")
    return model, model_dir


class MediaAttention(str, Enum):
    auto = "auto"
    sdpa = "sdpa"
    cudnn = "cudnn"
    flash2 = "flash2"
    flash3 = "flash3"
    fp8 = "fp8"


class MediaCompile(str, Enum):
    auto = "auto"
    on = "on"
    off = "off"

    def flag(self) -> bool | None:
        return None if self is MediaCompile.auto else self is MediaCompile.on


class MediaQuantization(str, Enum):
    none = "none"
    fp8 = "fp8"


class MediaLoadFormat(str, Enum):
    auto = "auto"
    dummy = "dummy"


def media_speed_options(serve: bool = False) -> tuple[Any, Any, Any, Any, Any, Any]:
    """The diffusion pipelines' speed options: (compile, attention backend, quantization, step cache, load format,
    disable CUDA graphs).
    In their own panel: --compile, --quantization... on image / video; on serve with a media prefix
    (--media-quantization: serve's --quantization is the LLM's). One env var each, for all three commands."""
    panel, p = (f"Media {SPEED_PANEL.lower()}", "--media-") if serve else (SPEED_PANEL, "--")
    what = "Regional torch.compile of the DiT's blocks and the image VAE decode (stored: later starts reuse it)"
    if serve:  # auto / on / off, as the engine's --torch-compile (a --no- twin would not fit the help's columns)
        compile_ = typer.Option("--media-compile", envvar="MINISGL_MEDIA_COMPILE", metavar="<str>",
                                rich_help_panel=panel, help=f"{what}: auto (on for CUDA), on, off.")
    else:
        compile_ = typer.Option("--compile/--no-compile", envvar="MINISGL_MEDIA_COMPILE", rich_help_panel=panel,
                                show_default="on for CUDA", help=f"{what}.")
    attention = typer.Option(
        f"{p}attention" if serve else "--attention-backend", envvar="MINISGL_MEDIA_ATTENTION",
        metavar="<str>", rich_help_panel=panel,
        help="DiT attention: auto (cuDNN on Hopper), sdpa, cudnn, flash2, flash3, fp8 (approximate).")
    quantization = typer.Option(
        f"{p}quantization", envvar="MINISGL_MEDIA_QUANTIZATION", metavar="<str>", rich_help_panel=panel,
        help="fp8: the DiT's block linears in FP8 e4m3 (CUDA, compute capability 8.9+).")
    cache = typer.Option(
        "--media-cache", envvar="MINISGL_MEDIA_CACHE", metavar="<str>", rich_help_panel=panel, callback=_media_cache,
        help="Step cache (cache-dit; approximate): fbcache, dbcache or taylorseer, tuned by :key=value,... "
             "(threshold, warmup, front, back, max-continuous, max-cached, order, scm, scm-policy).")
    load_format = typer.Option(
        f"{p}load-format", envvar="MINISGL_MEDIA_LOAD_FORMAT", metavar="<str>", rich_help_panel=panel,
        help="dummy: the model names a built-in config (z-image-turbo, wan2.1-t2v-1.3b), random weights (speed work).")
    no_graphs = typer.Option(
        f"{p}disable-cuda-graph", envvar="MINISGL_MEDIA_NO_GRAPHS", rich_help_panel=panel,
        help="Run the text encoder and the DiT's blocks eagerly on CUDA (no graph capture; the same pixels).")
    return compile_, attention, quantization, cache, load_format, no_graphs


class MediaParallel(str, Enum):
    cfg = "cfg"
    ulysses = "ulysses"
    auto = "auto"


def media_parallel_options(serve: bool = False) -> tuple[Any, Any]:
    """--media-parallel and --media-parallel-size: one job over several GPUs (media/parallel.py), on image, video
    and serve alike (serve: its video pipeline)."""
    panel = f"Media {SPEED_PANEL.lower()}" if serve else SPEED_PANEL
    mode = typer.Option(
        "--media-parallel", envvar="MINISGL_MEDIA_PARALLEL", metavar="<str>", rich_help_panel=panel,
        show_default="off: one GPU",
        help="One job over several GPUs: cfg (the two CFG passes, 2 GPUs), ulysses (attention heads split), auto "
             "(cfg for a guided job on 2, else ulysses).")
    size = typer.Option(
        "--media-parallel-size", envvar="MINISGL_MEDIA_PARALLEL_SIZE", metavar="<int>", rich_help_panel=panel,
        help="GPUs (ranks, one process each) of --media-parallel, from the --device one on.")
    return mode, size


def media_parallel(mode: MediaParallel | None, size: int, guidance_scale: float) -> dict[str, Any]:
    """--media-parallel / --media-parallel-size as ModelSpec's keyword arguments, `auto` resolved for a job of this
    guidance."""
    from minisgl_cli.media.parallel import resolve_mode

    return dict(media_parallel=resolve_mode(mode.value, guidance_scale, size) if mode else None,
                media_parallel_size=size)


def media_quantization(value: MediaQuantization) -> str | None:
    return None if value is MediaQuantization.none else value.value


def _media_cache(value: str | None) -> str | None:
    """--media-cache checked where the command starts (media/step_cache.py's parse)."""
    if value is not None:
        from minisgl_cli.media.jobs import MediaError
        from minisgl_cli.media.step_cache import check

        try:
            check(value)
        except MediaError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


def speed_options(compile: bool | None, attention_backend: MediaAttention, quantization: MediaQuantization,
                  media_cache: str | None, load_format: MediaLoadFormat, disable_cuda_graph: bool) -> dict[str, Any]:
    """The speed options of `image` / `video` / `serve` as ModelSpec's (and MediaSettings') keyword arguments."""
    return dict(compile=compile, attention_backend=attention_backend.value,
                quantization=media_quantization(quantization), media_cache=media_cache, load_format=load_format.value,
                cuda_graphs=not disable_cuda_graph)


class Command(TyperCommand):
    """A command whose --help reads whole in an 80-column terminal (every command is one: `@app.command(..., cls=
    c.Command)`). Typer writes `<bool>` beside a flag, which takes no value; puts a number's range in the type column,
    whose width the help column pays for (long env var names came out cut); and writes a default the command works out
    itself (`show_default="4"`) as `[default: (4)]`. Here a flag shows no type, and the range and such a default are
    lines of the option's help."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            _tidy(param)

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)
        if option is not None:
            _tidy(option)
        return option


def _tidy(param: Any) -> None:
    """One option's --help columns as Command says (a help string is rich markup: "\\[" is a literal bracket)."""
    if not isinstance(param, TyperOption):
        return
    if param.is_bool_flag:
        param.metavar = ""
    lines = []
    # Typer 0.29's own options hold the bounds (older Typer keeps them in a click range type: left as it shows them).
    low, high = getattr(param, "min", None), getattr(param, "max", None)
    if low is not None or high is not None:
        bounds = f"{low}..{high}" if low is not None and high is not None else (
            f">= {low}" if low is not None else f"<= {high}")
        lines.append(f"\\[range: {bounds}]")
        param.min = param.max = None  # shown only: Typer checks the bounds of the option's declaration
    if isinstance(param.show_default, str):
        if param.envvar and param.show_envvar:  # Typer's order: the env var, then the default
            lines.append(f"[dim yellow]\\[env var: {param.envvar}][/]")
            param.show_envvar = False
        lines.append(f"[dim]\\[default: {param.show_default}][/]")
        param.show_default = False
    if lines:
        param.help = "\n\n".join([param.help or "", *lines]).strip()


Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="INFO logs narrating prefill, decode steps and chunks.")]
# The HTTP fronts' shared options (`serve` and `router`).
Host = Annotated[str, typer.Option("--host", envvar="HOST", rich_help_panel=SERVER_PANEL,
                                   help="Interface to bind (0.0.0.0 for all).")]
Port = Annotated[int, typer.Option("--port", "-p", envvar="PORT", rich_help_panel=SERVER_PANEL, help="TCP port.")]
MaxInflightTotal = Annotated[int, typer.Option(
    "--max-inflight-total", envvar="MAX_INFLIGHT_TOTAL", min=0, metavar="<int>", rich_help_panel=LIMITS_PANEL,
    help="Requests in flight at most, then 429 (0 = no cap).")]
MaxInflightPerEngine = Annotated[int, typer.Option(
    "--max-inflight-per-engine", envvar="MAX_INFLIGHT_PER_ENGINE", min=0, metavar="<int>",
    rich_help_panel=LIMITS_PANEL, help="Requests in flight per engine (replica, worker) at most (0 = no cap).")]


@dataclass(frozen=True)
class _Option:
    """One engine option: a config field's name, type and default, its `metadata` (flags, help, env, min, max)
    and the --help panel it shows in."""

    name: str
    type: Any
    default: Any
    meta: dict[str, Any]
    panel: str

    def parameter(self) -> inspect.Parameter:
        """The keyword-only parameter Typer reads this option from."""
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=self.default,
                                 annotation=Annotated[_cli_type(self.type), self.option()])

    def option(self, more_help: str = "", show_default: bool | str | None = None) -> Any:
        """Its typer.Option: `more_help` appended to the help; `show_default` (default: unless a flag's False)."""
        m = self.meta
        ranged = "min" in m or "max" in m  # <int> rather than Typer's <int range>: Command shows the range
        return typer.Option(*m["flags"], envvar=m.get("env"), help=f"{m['help']} {more_help}".strip(),
                            min=m.get("min"), max=m.get("max"), rich_help_panel=self.panel,
                            metavar=f"<{_scalar(self.type).__name__}>" if ranged else None,
                            show_default=self.default is not False if show_default is None else show_default)


def _cli_type(tp: Any) -> Any:
    """The type Typer parses: a Literal's values are plain strings here (help shows <str>), X | None is Optional."""
    if get_origin(tp) is Literal:
        return type(get_args(tp)[0])
    if get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp):
        (inner,) = [a for a in get_args(tp) if a is not type(None)]
        return Optional[_cli_type(inner)]
    return tp


def _scalar(tp: Any) -> type:
    """int for int, int | None and Optional[int]."""
    args = [a for a in get_args(tp) if a is not type(None)]
    return args[0] if args else tp


# The one option of the command line alone: the reference stack's MODEL_LOCAL_DIR, which overrides --model.
_MODEL_LOCAL_DIR = _Option("model_local_dir", Optional[str], None, dict(
    flags=("--model-local-dir",), env="MODEL_LOCAL_DIR", help="A pre-downloaded model dir; overrides --model."),
    MODEL_PANEL)
# The options that say what model runs and how it is held: every engine-backed command offers them.
MODEL: tuple[str, ...] = ("model", "model_local_dir", "engine", "load_format", "device", "dtype", "quantization",
                          "kv_cache_dtype", "attention_backend")
_CONFIG_PANEL = {EngineConfig: ENGINE_PANEL, SchedulerConfig: SCHEDULER_PANEL, RuntimeConfig: PARALLEL_PANEL}


def _declared() -> dict[str, _Option]:
    """Every engine option, in --help order: EngineConfig's fields with flags, then SchedulerConfig's and
    RuntimeConfig's; each in its config's --help panel, the MODEL options in the model panel."""
    out: dict[str, _Option] = {}
    for cls in (EngineConfig, SchedulerConfig, RuntimeConfig):
        hints = get_type_hints(cls)
        for f in fields(cls):
            if "flags" in f.metadata:
                default = f.default_factory() if f.default_factory is not MISSING else f.default
                panel = MODEL_PANEL if f.name in MODEL else _CONFIG_PANEL[cls]
                out[f.name] = _Option(f.name, hints[f.name], default, dict(f.metadata), panel)
                if f.name == "model":
                    out[_MODEL_LOCAL_DIR.name] = _MODEL_LOCAL_DIR
    return out


_OPTIONS = _declared()
ALL: tuple[str, ...] = tuple(_OPTIONS)  # serve and bench offer every engine option
_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}
_SCHEDULER_FIELDS = {f.name for f in fields(SchedulerConfig)}
_RUNTIME_FIELDS = {f.name for f in fields(RuntimeConfig)}
RUNTIME: tuple[str, ...] = tuple(n for n in ALL if n in _RUNTIME_FIELDS)  # every engine-backed command offers these
# Speculative decoding: serve and bench (ALL) and chat offer these.
SPECULATIVE: tuple[str, ...] = ("speculative_algorithm", "num_speculative_tokens", "prompt_lookup_min",
                                "prompt_lookup_max", "speculative_draft_model")
# The runtime options of its processes alone, which change nothing where the engine runs in the caller's (the
# others there: --tp, --dp, --nnodes need processes, RuntimeConfig says; --dist-init-addr needs --tp 2+, check() says).
PROCESSES_ONLY = ("num_tokenizer",)


def flag(name: str, runtime: RuntimeConfig | None = None) -> str:
    """The flag of engine option `name` (its first name: --tp for tp_size); --runtime with its value."""
    first = cast(str, _OPTIONS[name].meta["flags"][0])
    return f"{first} {runtime.mode}" if name == "mode" and runtime is not None else first


@dataclass
class EngineOptions:
    """What an engine-backed command's flags built: the engine's config, its scheduler's, and how it runs
    (`processes`: the command's choice for --runtime auto; serve's is the multi-process runtime, the others'
    this process)."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    processes: bool = False

    @classmethod
    def from_params(cls, params: dict[str, Any], *, processes: bool = False, **overrides: Any) -> EngineOptions:
        """The configs from a command's option values (other params are ignored), `overrides` taking precedence.
        ValueError (one line) for options that contradict each other (--tp 3 --nnodes 2) or change nothing."""
        values = {k: v for k, v in {**params, **overrides}.items() if k in _OPTIONS}
        local_dir = values.pop("model_local_dir", None)
        if local_dir:
            values["model"] = local_dir
        opts = cls(EngineConfig(**{k: v for k, v in values.items() if k in _ENGINE_FIELDS}),
                   SchedulerConfig(**{k: v for k, v in values.items() if k in _SCHEDULER_FIELDS}),
                   RuntimeConfig(**{k: v for k, v in values.items() if k in _RUNTIME_FIELDS}), processes)
        opts.check()
        return opts

    def with_engine(self, engine: str) -> EngineOptions:
        """These options with another --engine (ValueError for one that does not exist)."""
        return replace(self, engine=replace(self.engine, engine=cast(EngineImpl, engine)))

    def changed(self, names: Iterable[str] = ALL) -> list[str]:
        """Those of the engine options `names` set away from their defaults (by a flag or its env var)."""
        configs = ((self.engine, _ENGINE_FIELDS), (self.scheduler, _SCHEDULER_FIELDS), (self.runtime, _RUNTIME_FIELDS))
        return [n for n in names for cfg, known in configs if n in known and getattr(cfg, n) != _OPTIONS[n].default]

    def check(self) -> None:
        """ValueError (one line) naming the flags set that would change nothing: our engine's under the hf and mlx
        engines, the multi-process runtime's where the engine runs in this process, --dist-init-addr with one rank."""
        from minisgl_cli import backends
        from minisgl_cli.scheduler.speculative import DRAFT_TP

        if self.scheduler.speculative_algorithm == "draft" and self.runtime.tp_size > 1:
            raise ValueError(DRAFT_TP)
        engine = backends.resolve(self.engine.engine)
        r = self.runtime
        if engine in backends.SERIAL:  # --dispatch with one replica: a notice for every engine (client())
            names = [n for n in self.changed() if n not in (*backends.SERIAL_OPTIONS, "dispatch")
                     and not (n == "mode" and r.mode == "in-process")]
            if names:
                raise ValueError(f"--engine {engine} runs in this process, one request at a time, on its own KV "
                                 f"cache: drop {', '.join(flag(n, r) for n in names)} (they configure the torch "
                                 "engine) or use --engine torch")
        elif not r.processes(self.processes) and (names := self.changed(PROCESSES_ONLY)):
            how = "--runtime in-process" if r.mode == "in-process" else "this command's default for --runtime auto"
            raise ValueError(f"drop {', '.join(map(flag, names))} or add --runtime processes: the engine runs in this "
                             f"process ({how}), where the multi-process runtime's options change nothing")
        if r.tp_size == 1 and self.changed(["dist_init_addr"]):
            raise ValueError("--dist-init-addr is where the --tp ranks meet, and --tp 1 has one rank: drop it")

    def client(self, stop: threading.Event | None = None, per_replica_cap: int | None = None) -> EngineClient:
        """Build the engine client where runtime/start.py chooses — in this process, or the multi-process runtime when
        `--runtime` says so (or `processes` for auto; the hf and mlx engines always run here; `stop` set abandons
        the start; `per_replica_cap`: requests in flight per --dp replica at most). Start-up failures become one
        line and exit code 1; an interrupted start exits 130.

        On a node other than 0 (`--node-rank`), this node's ranks serve until stopped; this never returns."""
        from minisgl_cli.loader.errors import ModelLoadError

        notice.show()  # the start-up lines (and the CPU compile's), whatever the command's log set-up
        if self.runtime.dp_size == 1 and self.runtime.dispatch != "rr":  # said, not silently ignored
            notice.notice(f"--dispatch {self.runtime.dispatch} routes across --dp replicas; with "
                          "--dp 1 every request goes to the one engine")
        from minisgl_cli.runtime.start import start_client

        try:
            started = start_client(self.engine, self.scheduler, self.runtime, by_default=self.processes,
                                   progress=notice.notice, stop=stop, per_replica_cap=per_replica_cap)
        except (ModelLoadError, ValueError, RuntimeError) as exc:
            fail(str(exc))
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        if self.runtime.node_rank != 0:  # the Runtime of this node's ranks
            _serve_ranks(started, self.runtime)
        return cast("EngineClient", started)


def prebuild(opts: EngineOptions) -> NoReturn:
    """--prebuild: build the compiled CPU decode step of these options (cpu_step/compiled.py), then exit."""
    from minisgl_cli.cpu_step.build import prebuild as build
    from minisgl_cli.loader.errors import ModelLoadError

    try:
        path = build(opts.engine)
    except ValueError as exc:  # these options decode eagerly: the flag would change nothing
        fail(str(exc), 2)
    except (ModelLoadError, RuntimeError) as exc:
        fail(str(exc))
    notice.notice(f"the compiled CPU decode step is stored: {path}")
    raise typer.Exit(0)


def _serve_ranks(runtime: Any, cfg: RuntimeConfig) -> NoReturn:
    """A node other than 0: run its ranks until SIGINT / SIGTERM (exit 0) or a child dies (exit 1)."""
    ranks = cfg.dist.local_ranks()
    notice.notice(f"node {cfg.node_rank}: ranks {ranks.start}..{ranks.stop - 1} serving node 0's requests")
    from minisgl_cli.runtime.supervisor import stop_on_signals

    with stop_on_signals() as stop:  # through the shutdown too: a second Ctrl-C must not cut it short
        reason = runtime.wait(stop)
        runtime.shutdown()
    if reason is not None:
        fail(reason)
    raise typer.Exit(0)


def repeatable(name: str, more_help: str) -> Any:
    """The Typer option of engine option `name` (its flags, env var and help) taking a list: for a command that
    compares several values in one run (bench's --engine); the command excludes `name` from engine_options."""
    option = _OPTIONS[name]
    info = option.option(more_help, show_default=str(option.default))  # the command's own default is None
    info.metavar = f"<{_scalar(_cli_type(option.type)).__name__}>"  # one value's type, not <list[str]>
    return info


def engine_options(offered: Iterable[str], exclude: Iterable[str] = (),
                   processes: bool = False) -> Callable[[Callable], Callable]:
    """Add the engine options `offered` (names from ALL) to a command where its `opts: EngineOptions` parameter
    stands (keyword-only, after `*`), and call the command with them built into that one object (`processes`: the
    command runs the multi-process runtime for --runtime auto). Options that contradict each other or change
    nothing are a usage error: one line, exit 2."""
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
            try:
                opts = EngineOptions.from_params({n: kwargs.pop(n) for n in names}, processes=processes)
            except ValueError as exc:
                fail(str(exc), code=2)
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


def fail(message: str, code: int = 1) -> NoReturn:
    """Print one line to stderr and exit non-zero: how every command reports bad input."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def setup_logging(verbose: bool) -> None:
    """Logs at WARNING (INFO with -v), and the notices (minisgl_cli/notice.py) at every level."""
    notice.show()
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
