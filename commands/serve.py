"""`minisgl serve`: an OpenAI-compatible HTTP server (plus /generate, /metrics) over one engine (or --dp replicas)."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from commands import common as c
from minisgl_cli.server.reasoning import PARSERS
from minisgl_cli.vision.image_source import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_BYTES, DEFAULT_MAX_PIXELS

if TYPE_CHECKING:
    from minisgl_cli.client.protocol import EngineClient

app = typer.Typer()
server = c.in_panel(c.SERVER_PANEL)
limits = c.in_panel(c.LIMITS_PANEL)
media = c.in_panel(c.MEDIA_PANEL)
COMPILE, ATTENTION, QUANTIZATION, MEDIA_CACHE, LOAD_FORMAT, NO_GRAPHS = c.media_speed_options(serve=True)
PARALLEL, PARALLEL_SIZE = c.media_parallel_options(serve=True)


@app.command("serve", cls=c.Command)
@c.engine_options(c.ALL, processes=True)
def serve(
    host: c.Host = "127.0.0.1",
    port: c.Port = 8000,
    api_key: Annotated[Optional[str], server("--api-key", envvar="MINISGL_API_KEY",
        help="Require 'Authorization: Bearer KEY' on every route but /health.")] = None,
    max_inflight_total: Annotated[Optional[int], limits(
        "--max-inflight-total", envvar="MAX_INFLIGHT_TOTAL", min=0, metavar="<int>", show_default="auto",
        help="Requests in flight at most, then 429 (auto: 16 x --max-running-requests of all replicas, at least 2048; "
             "0 = no cap).")] = None,
    max_inflight_per_engine: c.MaxInflightPerEngine = 0,
    adaptive_max_new_tokens: Annotated[bool, limits("--adaptive-max-new-tokens", envvar="ADAPTIVE_MAX_NEW_TOKENS",
        help="Cut max_tokens under load (x1/2 past 50%, x1/4 past 75%).")] = False,
    max_body_bytes: Annotated[int, limits("--max-body-bytes", envvar="MAX_BODY_BYTES", min=1, metavar="<int>",
        help="Larger request bodies get 413.")] = DEFAULT_MAX_BODY_BYTES,
    request_timeout: Annotated[float, limits("--request-timeout", envvar="MINISGL_REQUEST_TIMEOUT", min=0,
        metavar="<seconds>", help="A request still running after this long is aborted: 504 (a request's `timeout` "
        "may ask less; 0 = no limit).")] = 600.0,
    served_model_name: Annotated[Optional[str], server("--served-model-name",
        help="Model id in /v1/models and responses (default: the engine's).")] = None,
    reasoning_parser: Annotated[str, server("--reasoning-parser", envvar="MINISGL_REASONING_PARSER",
        help="auto, qwen3, deepseek-r1, harmony or none: split thoughts (<think>, or gpt-oss's harmony analysis "
        "channel, whose commentary channel also gives the tool calls) from replies (reasoning_content in chat, "
        "thinking blocks in /v1/messages; auto: by the model's family).")] = "none",
    warm_prefixes: Annotated[Optional[str], server("--warm-prefixes", envvar="WARM_PREFIXES",
        help="'|'-separated prefixes prefilled into the radix cache at start.")] = None,
    zmq_control: Annotated[bool, server("--zmq-control", envvar="ZMQ_CONTROL",
        help="Serve a ZMQ control channel (ping, metrics, warm <prefix>).")] = False,
    zmq_control_endpoint: Annotated[str, server("--zmq-control-endpoint", envvar="ZMQ_CONTROL_ENDPOINT",
        help="Where the control channel binds.")] = "tcp://127.0.0.1:5557",
    stream_interval: Annotated[int, server("--stream-interval", envvar="STREAM_INTERVAL", metavar="<int>",
        help="Send a stream's text every N tokens (the first and the end at once).")] = 1,
    web: Annotated[bool, server("--web/--no-web", envvar="MINISGL_WEB",
        help="The web page at / (chat, live engine view).")] = True,
    image_model_dir: Annotated[Optional[Path], media("--image-model-dir", envvar="Z_IMAGE_MODEL_DIR",
        help="Diffusers pipeline dir for /v1/images/generations.")] = None,
    video_model_dir: Annotated[Optional[Path], media("--video-model-dir", envvar="MINISGL_VIDEO_MODEL_DIR",
        help="Diffusers pipeline dir for /v1/videos/generations.")] = None,
    image_model: Annotated[Optional[str], media("--image-model", envvar="MINISGL_IMAGE_MODEL",
        help="Image pipeline (hub id; a built-in config under --media-load-format dummy).",
        show_default="Z-Image-Turbo")] = None,
    video_model: Annotated[Optional[str], media("--video-model", envvar="MINISGL_VIDEO_MODEL",
        help="Video pipeline (hub id; a built-in config under --media-load-format dummy).",
        show_default="Wan2.1-T2V-1.3B")] = None,
    media_compile: Annotated[c.MediaCompile, COMPILE] = c.MediaCompile.auto,
    media_attention: Annotated[c.MediaAttention, ATTENTION] = c.MediaAttention.auto,
    media_quantization: Annotated[c.MediaQuantization, QUANTIZATION] = c.MediaQuantization.none,
    media_cache: Annotated[Optional[str], MEDIA_CACHE] = None,
    media_load_format: Annotated[c.MediaLoadFormat, LOAD_FORMAT] = c.MediaLoadFormat.auto,
    media_disable_cuda_graph: Annotated[bool, NO_GRAPHS] = False,
    media_parallel: Annotated[Optional[c.MediaParallel], PARALLEL] = None,
    media_parallel_size: Annotated[int, PARALLEL_SIZE] = 2,
    media_max_queue: Annotated[int, media("--media-max-queue", envvar="MINISGL_MEDIA_MAX_QUEUE", min=1,
        metavar="<int>", help="Image / video jobs that may wait for the media worker; more get a 429.")] = 32,
    media_max_batch: Annotated[int, media("--media-max-batch", envvar="MINISGL_MEDIA_MAX_BATCH", min=1,
        metavar="<int>", help="Images of compatible requests run in one pipeline call.")] = 4,
    media_max_work: Annotated[float, media("--media-max-work", envvar="MINISGL_MEDIA_MAX_WORK", min=0.001,
        metavar="<MP-steps>", help="Megapixel-steps (width x height x steps x images or frames) admitted at once: "
        "a request past it alone gets a 400, one that would take the total past it a 503 with Retry-After.")] = 4096.0,
    vlm_model: Annotated[Optional[str], media("--vlm-model", envvar="MINISGL_VLM_MODEL",
        help="Vision-language model (HF dir or hub id) for image_url chat parts: Qwen2-VL / Qwen2.5-VL run on the "
             "engine (as the served model), others in transformers.")] = None,
    allow_local_images: Annotated[Optional[Path], media("--allow-local-images", envvar="MINISGL_ALLOW_LOCAL_IMAGES",
        help="Let image_url name files under this dir (default: data: URLs only).")] = None,
    allow_remote_images: Annotated[bool, media("--allow-remote-images", envvar="MINISGL_ALLOW_REMOTE_IMAGES",
        help="Let the server fetch http(s) image URLs.")] = False,
    max_image_bytes: Annotated[int, media("--max-image-bytes", envvar="MINISGL_MAX_IMAGE_BYTES", min=1, metavar="<int>",
        help="Larger images get a 400.")] = DEFAULT_MAX_BYTES,
    max_image_pixels: Annotated[int, media(
        "--max-image-pixels", envvar="MINISGL_MAX_IMAGE_PIXELS", min=1, metavar="<int>",
        help="Images with more pixels get a 400.")] = DEFAULT_MAX_PIXELS,
    prebuild: Annotated[bool, server("--prebuild",
        help="Build the compiled CPU decode step of these options (stored for every later start), then exit: for "
             "container images.")] = False,
    *,
    opts: c.EngineOptions,  # the engine options (c.ALL) go here in --help
    verbose: c.Verbose = False,
) -> None:
    """Serve the OpenAI API (/v1/...), /generate, /metrics, /health and a web page at /.

    It listens at once (503 until the engine is up). Details: docs/server.md, docs/options.md."""
    from minisgl_cli import backends
    from minisgl_cli.media.memory import keep_free
    from minisgl_cli.media.settings import MediaSettings
    from minisgl_cli.notice import notice
    from minisgl_cli.server.app import ServerSettings
    from minisgl_cli.server.launch import LaunchConfig
    from minisgl_cli.server.launch import serve as run_server
    from minisgl_cli.server.settings import VisionSettings
    from minisgl_cli.vision.image_source import ImagePolicy
    from minisgl_cli.vision.vlm import VlmLoadError, load_vlm, on_engine

    c.setup_logging(verbose)
    if prebuild:
        c.prebuild(opts)
    if stream_interval != 1:  # the detokenizer process holds the tokens: the multi-process runtime only
        if opts.runtime.mode == "in-process" or backends.resolve(opts.engine.engine) in backends.SERIAL:
            c.fail("--stream-interval is the detokenizer process's: it needs the multi-process runtime "
                   "(--runtime processes, --engine torch or sgl)", code=2)
        try:
            opts = replace(opts, runtime=replace(opts.runtime, stream_interval=stream_interval))
        except ValueError as exc:
            c.fail(str(exc), code=2)
    if warm_prefixes and opts.engine.engine == "hf":
        c.fail("--warm-prefixes fills a prefix cache, and --engine hf has none", code=2)
    # The total cap admits at most every replica's share; the pool keeps each replica within its own. Neither
    # given: the server's default cap (gate.default_cap); 0: none.
    caps = [x for x in (max_inflight_total or 0, max_inflight_per_engine * opts.runtime.dp_size) if x > 0]
    total = min(caps) if caps else max_inflight_total
    per_replica = max_inflight_per_engine or None
    media = MediaSettings.from_env()
    media = replace(
        media, image_model=image_model or media.image_model, video_model=video_model or media.video_model,
        image_model_dir=image_model_dir or media.image_model_dir,
        video_model_dir=video_model_dir or media.video_model_dir,
        **c.speed_options(media_compile.flag(), media_attention, media_quantization, media_cache, media_load_format,
                          media_disable_cuda_graph),
        max_queue=media_max_queue, max_batch=media_max_batch, max_work=media_max_work,
        media_parallel=media_parallel.value if media_parallel else media.media_parallel,
        media_parallel_size=media_parallel_size,
    )
    if media.media_parallel is not None:  # a split this machine or model cannot make: refused now, not per request
        from minisgl_cli.device import DeviceError
        from minisgl_cli.media.jobs import MediaError
        from minisgl_cli.media.ranks import check

        try:
            check(media.spec("video"))
        except (MediaError, DeviceError) as exc:
            c.fail(getattr(exc, "message", None) or str(exc), code=2)
    if allow_local_images is not None and not allow_local_images.expanduser().is_dir():
        c.fail(f"--allow-local-images {allow_local_images}: not a directory")
    images = ImagePolicy(local_dir=allow_local_images, allow_remote=allow_remote_images, max_bytes=max_image_bytes,
                         max_pixels=max_image_pixels)
    if vlm_model:  # Qwen2-VL / Qwen2.5-VL: the engine's model; other families: transformers beside it
        try:
            engine_model, vlm_model, line = on_engine(vlm_model, opts.engine.model)
        except VlmLoadError as exc:
            c.fail(str(exc))
        notice(line)
        if engine_model is not None:
            opts = replace(opts, engine=replace(opts.engine, model=engine_model))
    vision = VisionSettings(model=vlm_model or None, device=media.device, images=images)
    if reasoning_parser not in PARSERS:
        c.fail(f"--reasoning-parser: {reasoning_parser!r} is not one of {', '.join(PARSERS)}")
    settings = ServerSettings(
        api_key=api_key or None, max_inflight_total=total,
        adaptive_max_new_tokens=adaptive_max_new_tokens, max_body_bytes=max_body_bytes,
        served_model_name=served_model_name, media=media, web=web, vision=vision, request_timeout_s=request_timeout,
        reasoning_parser=reasoning_parser,
    )
    launch = LaunchConfig(
        host=host, port=port, warm_prefixes=[x for x in (warm_prefixes or "").split("|") if x],
        zmq_control=zmq_control, zmq_endpoint=zmq_control_endpoint, log_level="info" if verbose else "warning",
    )
    if opts.runtime.node_rank > 0:  # a node other than 0 runs its TP ranks only: no HTTP there
        opts.client()

    def make_client(stop: threading.Event) -> EngineClient:
        if vision.model:  # first: on a GPU the engine then sizes its KV pool from the memory left
            try:
                load_vlm(vision.model, vision.device)
            except VlmLoadError as exc:
                raise RuntimeError(str(exc)) from None
        engine = opts.engine
        if backends.resolve(engine.engine) not in backends.SERIAL:  # a KV pool: room for the media worker beside it
            engine = replace(engine, keep_free=keep_free(media, str(engine.resolved_device())))
        return replace(opts, engine=engine).client(stop=stop, per_replica_cap=per_replica)

    try:
        run_server(make_client, settings, launch)
    except typer.Exit:  # a RuntimeError too (click's): the engine's start already said why
        raise
    except (RuntimeError, OSError) as exc:  # port in use, ZMQ endpoint taken, the engine died
        c.fail(str(exc))
