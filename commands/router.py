"""`minisgl router`: one OpenAI-compatible endpoint routing across several `minisgl serve` workers (hosts)."""

from __future__ import annotations

from typing import Annotated

import typer

from commands import common as c

app = typer.Typer()


@app.command("router", cls=c.Command)
@c.engine_options(("dispatch",))
def router(
    worker_url: Annotated[list[str], typer.Option(
        "--worker-url", metavar="<url>", rich_help_panel=c.SERVER_PANEL,
        help="A `minisgl serve` base URL (http://HOST:PORT); repeat for each worker.")],
    host: c.Host = "127.0.0.1",
    port: c.Port = 8000,
    max_inflight_total: c.MaxInflightTotal = 0,
    max_inflight_per_engine: c.MaxInflightPerEngine = 0,
    health_interval: Annotated[float, typer.Option(
        "--health-interval", min=0.05, metavar="<float>", rich_help_panel=c.SERVER_PANEL,
        help="Seconds between health checks (a failing worker is taken out).")]
        = 2.0,
    request_timeout: Annotated[float, typer.Option(
        "--request-timeout", envvar="ROUTER_REQUEST_TIMEOUT", min=0, metavar="<float>",
        rich_help_panel=c.LIMITS_PANEL,
        help="Seconds a worker may send nothing while it has a request (a whole non-streamed answer, a stream's "
             "first frame, a gap between frames): past it the client gets 504 (a stream: an error frame), the "
             "request is not retried elsewhere and the worker counts a failure. 0 = no limit.")]
        = 600.0,
    processes: Annotated[int, typer.Option(
        "--processes", envvar="ROUTER_PROCESSES", min=0, metavar="<int>", rich_help_panel=c.SERVER_PANEL,
        help="Router processes on the port (the kernel spreads connections over them; each routes on its own, "
             "caps are split among them; one that dies stops the router, exit 1). 0 = auto: 1 for cache_aware, "
             "else one per core up to 4.")]
        = 0,
    *,
    opts: c.EngineOptions,  # --dispatch
    verbose: c.Verbose = False,
) -> None:
    """One OpenAI endpoint in front of several `minisgl serve` workers (hosts).

    Routes by --dispatch, with health checks, retries, timeouts and caps (429). See docs/server.md."""
    import httpx

    from minisgl_cli.router.processes import SPREADS, RouterConfig, auto_processes, run_router

    c.setup_logging(verbose)
    for url in worker_url:
        parsed = httpx.URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            c.fail(f"--worker-url must be http://HOST:PORT, not {url!r}")
    cfg = RouterConfig(tuple(worker_url), opts.runtime.dispatch, max_inflight_per_engine or None,
                       max_inflight_total or None, health_interval, request_timeout or None)
    if processes > 1 and not SPREADS:
        c.fail("--processes above 1 needs Linux (SO_REUSEPORT spreads a port's connections only there)", 2)
    if processes and (most := cfg.max_processes()) is not None and processes > most:
        c.fail(f"--processes {processes} cannot split a cap of {most} (--max-inflight-per-engine, "
               "--max-inflight-total: each process needs at least 1): lower --processes or raise the cap", 2)
    try:
        run_router(cfg, host, port, processes or auto_processes(cfg), log_level="info" if verbose else "warning")
    except RuntimeError as exc:  # the port is taken or not an address here, or a router process died
        c.fail(str(exc))
