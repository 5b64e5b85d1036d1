"""ServerSettings: what the HTTP front adds on top of the engine (the flags and env vars of `minisgl serve`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl_cli.server.media import MediaSettings


@dataclass
class ServerSettings:
    """What the HTTP front adds on top of the engine (flags/env vars of `minisgl serve`)."""

    api_key: str | None = None
    max_inflight_total: int | None = None  # engine requests at once; None or 0: no cap
    adaptive_max_new_tokens: bool = False
    adaptive_min_tokens: int = 16  # the downscale never cuts below this
    max_body_bytes: int = 4 * 1024 * 1024
    served_model_name: str | None = None  # default: the engine's model name
    retry_after_s: int = 1
    media: MediaSettings | None = None
    web: bool = True  # the page at / and /metrics/live (server/web.py); --no-web turns them off
    extra_model_aliases: tuple[str, ...] = field(default=("default",))
