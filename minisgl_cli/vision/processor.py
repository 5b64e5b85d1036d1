"""VisionProcessor: a vision-language model's chat prompt with images -> a `Prompt` the engine takes: the chat
template, the model's HF processor (placeholders expanded, pixel values, patch grids), a content hash per image, and
the pixels left as a tensor (the engine is in this process) or put in shared memory (vision/pixels.py: another
process runs it).

Images come in chat messages as `{"type": "image", "image": <PIL image>}` parts, or in their wire form
(`image_to_wire`: raw RGB bytes) where a request crossed a process to get here.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

from minisgl_cli.models.config import VISION_ARCHITECTURES
from minisgl_cli.tokenizer import hermes_messages
from minisgl_cli.types import ImageInput, Prompt
from minisgl_cli.vision import pixels


def has_images(messages: list[dict] | None) -> bool:
    return bool(messages) and any(isinstance(m.get("content"), list) and any(
        isinstance(p, dict) and p.get("type") == "image" for p in m["content"]) for m in messages or [])


def image_to_wire(image: Any) -> dict:
    """A PIL image as a message part can carry it across processes (msgpack): its RGB bytes and size."""
    rgb = image.convert("RGB")
    return {"rgb": rgb.tobytes(), "size": list(rgb.size)}


def _image(value: Any) -> Any:
    """A message part's image: a PIL image, or its wire form."""
    if isinstance(value, dict) and "rgb" in value:
        from PIL import Image

        return Image.frombytes("RGB", tuple(value["size"]), value["rgb"])
    if not hasattr(value, "convert"):
        raise ValueError("an image part holds no image")
    return value


def messages_to_wire(messages: list[dict]) -> list[dict]:
    """The messages with each image part's PIL image in its wire form (`image_to_wire`)."""
    return [{**m, "content": [{**p, "image": image_to_wire(p["image"])} if p.get("type") == "image"
                              and hasattr(p.get("image"), "convert") else p for p in m["content"]]}
            if isinstance(m.get("content"), list) else m for m in messages]


def load_processor(model_dir: Path) -> Any:
    """AutoProcessor; where its video processor cannot be built (transformers needs torchvision for the
    Qwen2-VL and SmolVLM ones), the same processor class without it: images only, which is all chat sends."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_dir)
    except ImportError as exc:
        if "torchvision" not in str(exc).lower():
            raise
    import inspect

    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    cls = getattr(transformers, PROCESSOR_MAPPING_NAMES[AutoConfig.from_pretrained(model_dir).model_type])

    class ImageOnly(cls):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            return None if name == "video_processor" and arg is None else super().check_argument_for_proper_class(
                name, arg)

    ImageOnly.__name__ = cls.__name__
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # The processor's own settings (image_seq_len, ...) from processor_config.json, where the dir has one.
    saved = model_dir / "processor_config.json"
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "image_processor", "tokenizer",
                                                                   "video_processor", "chat_template"}
    extra = {k: v for k, v in json.loads(saved.read_text()).items() if k in accepted} if saved.is_file() else {}
    template = tokenizer.chat_template
    if (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    return ImageOnly(image_processor=AutoImageProcessor.from_pretrained(model_dir), tokenizer=tokenizer,
                     video_processor=None, chat_template=template, **extra)


class VisionProcessor:
    """One model's image prompts (the HF processor loads on first use; one thread at a time uses it)."""

    @classmethod
    def of(cls, model_dir: Path | str) -> VisionProcessor | None:
        """The processor of a model on the engine that takes images (Qwen2-VL / Qwen2.5-VL); None for another."""
        try:
            cfg = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        return cls(model_dir) if (cfg.get("architectures") or [""])[0] in VISION_ARCHITECTURES else None

    def __init__(self, model_dir: Path | str):
        self.model_dir = Path(model_dir)
        cfg = json.loads((self.model_dir / "config.json").read_text())
        self.image_token_id = int(cfg["image_token_id"])
        self.merge = int(cfg.get("vision_config", {}).get("spatial_merge_size", 2))
        self._processor: Any = None
        self._lock = threading.Lock()

    @property
    def processor(self) -> Any:
        if self._processor is None:
            from transformers.utils import logging as tlog

            tlog.disable_progress_bar()
            self._processor = load_processor(self.model_dir)
        return self._processor

    def prompt(self, messages: list[dict], tools: list[dict] | None = None, share: bool = False,
               template_kwargs: dict | None = None) -> Prompt:
        """The messages' prompt ids (chat template applied, each image's placeholder expanded to its tokens) and
        images; `share`: their pixels go into shared memory for another process. ValueError for input the
        template or the processor refuses."""
        if not messages:
            raise ValueError("messages must not be empty")
        images: list[Any] = []
        chat = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") == "image":
                        images.append(_image(part.get("image")))
                        parts.append({"type": "image"})  # the template writes the marker; the pixels go below
                    else:
                        parts.append(part)
                m = {**m, "content": parts}
            chat.append(m)
        with self._lock:  # transformers' processors keep state between calls
            proc = self.processor
            template = getattr(proc, "chat_template", None) or proc.tokenizer.chat_template
            if not template:
                raise ValueError(f"{self.model_dir.name} has no chat template")
            if tools and "tools" not in template:
                chat, tools = hermes_messages(chat, tools), None
            text = proc.tokenizer.apply_chat_template(chat, chat_template=template, tools=tools or None,
                                                      tokenize=False, add_generation_prompt=True,
                                                      **(template_kwargs or {}))
            out = proc(text=[text], images=[images] if images else None, return_tensors="pt")
        ids = [int(t) for t in out["input_ids"][0].tolist()]
        if not images:
            return Prompt(ids)
        return Prompt(ids, self._images(ids, out["pixel_values"], out["image_grid_thw"].tolist(), share))

    def _images(self, ids: list[int], values: Any, grids: list[list[int]], share: bool) -> list[ImageInput]:
        """One ImageInput per image: its placeholder run in `ids` (in order), its rows of the pixel values."""
        runs: list[tuple[int, int]] = []  # (offset, length) of each run of placeholder ids
        for i, t in enumerate(ids):
            if t != self.image_token_id:
                continue
            if runs and runs[-1][0] + runs[-1][1] == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
        tokens = [t * h * w // self.merge**2 for t, h, w in grids]
        if [n for _, n in runs] != tokens:
            raise ValueError(f"the prompt's image placeholders ({[n for _, n in runs]} tokens) do not match its "
                             f"{len(grids)} images ({tokens} tokens): is an image marker in the text?")
        out, row = [], 0
        for (offset, n), grid in zip(runs, grids):
            patches = grid[0] * grid[1] * grid[2]
            rows = values[row : row + patches].float().contiguous()
            row += patches
            digest = hashlib.blake2b(rows.numpy().tobytes(), digest_size=16)
            digest.update(repr(grid).encode())
            out.append(ImageInput(digest.hexdigest(), offset, n, grid, list(rows.shape),
                                  shm=pixels.write(rows) if share else None, pixels=None if share else rows))
        return out
