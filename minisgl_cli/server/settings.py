"""ServerSettings: what the HTTP front adds on top of the engine (the flags and env vars of `minisgl serve`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minisgl_cli.media.settings import MediaSettings
from minisgl_cli.vision.image_source import DEFAULT_MAX_BODY_BYTES, ImagePolicy

if TYPE_CHECKING:
    from minisgl_cli.vision.vlm import VlmChat


@dataclass(frozen=True)
class VisionSettings:
    """The server's vision-language model and where its images may come from (flags of `minisgl serve`)."""

    model: str | None = None  # --vlm-model: None and image parts get a 400 naming the flag
    device: str | None = None  # None: mps -> cuda -> cpu
    images: ImagePolicy = field(default_factory=ImagePolicy)

    def vlm_chat(self) -> VlmChat | None:
        from minisgl_cli.vision.vlm import VlmChat

        return VlmChat(self.model, self.device) if self.model else None


@dataclass
class ServerSettings:
    """What the HTTP front adds on top of the engine (flags/env vars of `minisgl serve`)."""

    api_key: str | None = None
    max_inflight_total: int | None = None  # engine requests at once; None: gate.default_cap, 0: no cap
    adaptive_max_new_tokens: bool = False
    adaptive_min_tokens: int = 16  # the downscale never cuts below this
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    served_model_name: str | None = None  # default: the engine's model name
    retry_after_s: int = 1
    request_timeout_s: float = 600.0  # a request's deadline, and the most its `timeout` may ask; 0: none
    media: MediaSettings | None = None
    vision: VisionSettings | None = None  # image_url parts in chat (server/vlm_chat.py)
    web: bool = True  # the page at / and /metrics/live (server/web.py); --no-web turns them off
    extra_model_aliases: tuple[str, ...] = field(default=("default",))
    reasoning_parser: str = "none"  # --reasoning-parser: auto, qwen3, deepseek-r1, harmony, none (server/reasoning.py)
