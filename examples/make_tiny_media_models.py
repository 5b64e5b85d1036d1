"""Build tiny, randomly initialised Z-Image and Wan pipelines, and tiny vision-language models (Idefics3 /
SmolVLM, Qwen2-VL, Qwen2.5-VL), offline, and save them to a directory.

The weights are random: the pictures are noise-like and the VLMs' replies gibberish, but every component
(tokenizer, processor, text encoder / decoder, vision tower, transformer, VAE, scheduler) is real, so the
saved dirs exercise the exact loading, preprocessing and generation code paths of the full-size models.
Used by tests/media_fixtures.py, tests/test_vlm.py, docs/media.md and docs/server.md.

    python examples/make_tiny_media_models.py OUT_DIR          # writes OUT_DIR/z-image, OUT_DIR/wan
    python examples/make_tiny_media_models.py --vlm OUT_DIR    # writes OUT_DIR/idefics3, qwen2-vl, qwen2.5-vl
"""

from __future__ import annotations

import sys
from pathlib import Path

from minisgl_cli.media.configs import byte_tokenizer as tiny_tokenizer  # the one copy, in the package


def _save_builtin(name: str, out_dir: Path) -> Path:
    """A tiny built-in pipeline of media/configs.py (seeded random weights, on the CPU in fp32), saved to out_dir."""
    import torch

    from minisgl_cli.media.configs import build_dummy_pipeline

    build_dummy_pipeline(name, "cpu", torch.float32).save_pretrained(out_dir)
    return out_dir


def build_tiny_z_image(out_dir: Path) -> Path:
    """ZImagePipeline: 2-layer DiT (dim 32), 2-layer Qwen3 text encoder, 2-level AutoencoderKL."""
    return _save_builtin("tiny-z-image", out_dir)


def build_tiny_wan(out_dir: Path) -> Path:
    """WanPipeline: 2-layer video DiT, 2-layer UMT5 encoder, a base_dim=3 Wan VAE (8x space, 4x time)."""
    return _save_builtin("tiny-wan", out_dir)


def build_all(root: Path) -> dict[str, Path]:
    root = Path(root)
    return {"z-image": build_tiny_z_image(root / "z-image"), "wan": build_tiny_wan(root / "wan")}


# --- vision-language models --------------------------------------------------------------------------
# The markup of SmolVLM's and Qwen2-VL's own chat templates, cut to what a chat with images needs.
IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
QWEN2_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Each tile of a tiny Idefics3: 32x32 pixels, 8x8 patches, pixel shuffle by 2 -> 4 image tokens.
IDEFICS3_TILE, IDEFICS3_PATCH = 32, 8
# Qwen2-VL: 8x8 patches, 2x2 merged per token, images resized to between 16x16 and 64x64 pixels.
QWEN_PATCH, QWEN_MERGE, QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 8, 2, 16 * 16, 64 * 64


def _tiny_decoder(tokenizer, eos: str, **extra) -> dict:
    """A 2-layer decoder config (64 wide, 4 heads of 16, GQA 2) for the tokenizer; `extra` overrides or adds."""
    return {**dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                   bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids(eos),
                   pad_token_id=tokenizer.pad_token_id), **extra}


def build_tiny_idefics3(out_dir: Path) -> Path:
    """Idefics3ForConditionalGeneration (SmolVLM's architecture): 2-layer SigLIP-style vision tower, a pixel
    shuffle connector, a 2-layer Llama decoder; images split into 32x32 tiles (at most 2x2) plus a global one."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor, Idefics3Processor

    torch.manual_seed(0)
    rows = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    tokenizer = tiny_tokenizer(("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *rows))
    tokenizer.chat_template = IDEFICS3_TEMPLATE
    config = Idefics3Config(
        text_config=dict(model_type="llama", head_dim=16, tie_word_embeddings=False,
                         **_tiny_decoder(tokenizer, "<end_of_utterance>")),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=IDEFICS3_TILE, patch_size=IDEFICS3_PATCH),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    processor = Idefics3Processor(
        image_processor=Idefics3ImageProcessor(size={"longest_edge": 2 * IDEFICS3_TILE},
                                               max_image_size={"longest_edge": IDEFICS3_TILE}),
        tokenizer=tokenizer, image_seq_len=(IDEFICS3_TILE // IDEFICS3_PATCH) ** 2 // 4,
        chat_template=IDEFICS3_TEMPLATE,
    )
    Idefics3ForConditionalGeneration(config).save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


QWEN_MARKERS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _qwen_tokenizer(words_up_to: int = 0):
    tokenizer = tiny_tokenizer(QWEN_MARKERS, words_up_to)
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    return tokenizer


def _marker_ids(tokenizer) -> dict:
    ids = {m: tokenizer.convert_tokens_to_ids(m) for m in QWEN_MARKERS}
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def _mrope_section(head_dim: int) -> list[int]:
    """Qwen's split of a head's frequencies over time, height and width (16, 24, 24 of 64), for any head size."""
    half = head_dim // 2
    t = half // 4
    return [t, (half - t) // 2, half - t - (half - t) // 2]


def build_tiny_qwen2_vl(out_dir: Path, version: str = "2", width: int = 64, layers: int = 2, heads: int = 4,
                        vision_width: int = 32, vision_depth: int = 2, patch: int = QWEN_PATCH,
                        max_pixels: int = QWEN_MAX_PIXELS) -> Path:
    """Qwen2VLForConditionalGeneration (version "2") or Qwen2_5_VLForConditionalGeneration ("2.5"): a 2-layer
    vision tower with 2x2 patch merging and a 2-layer Qwen2 decoder with M-RoPE (larger ones by the arguments:
    the decoder's width, layers and heads, the tower's width and depth, the patch size, the processor's pixel cap).

    Saved as the hub's Qwen2-VL checkpoints are (tokenizer files + preprocessor_config.json, no
    processor_config.json): transformers builds their video processor only with torchvision, so a
    processor object cannot be saved whole without it."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    tokenizer = _qwen_tokenizer()
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": _mrope_section(width // heads)}
    # Weights drawn 10x wider than transformers' default (std 0.02): a reply then depends on the picture and the
    # words, so greedy ids compared against HF's test something (at 0.02 every prompt gives the same reply).
    init = dict(initializer_range=0.2)
    common = dict(patch_size=patch, spatial_merge_size=QWEN_MERGE, temporal_patch_size=2, num_heads=2,
                  depth=vision_depth, **init)
    if version == "2":
        vision = dict(embed_dim=vision_width, hidden_size=width, **common)
        config_cls, model_cls = tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration
    else:
        vision = dict(hidden_size=vision_width, out_hidden_size=width, intermediate_size=2 * vision_width,
                      window_size=4 * patch, fullatt_block_indexes=[vision_depth - 1], **common)
        config_cls, model_cls = tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration
    text = _tiny_decoder(tokenizer, "<|im_end|>", rope_parameters=rope, hidden_size=width,
                         intermediate_size=2 * width, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), **init)
    config = config_cls(text_config=text, vision_config=vision, **_marker_ids(tokenizer))
    model_cls(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _qwen_image_processor(patch, QWEN_MIN_PIXELS, max_pixels).save_pretrained(out_dir)
    return out_dir


def _qwen_image_processor(patch: int, min_pixels: int, max_pixels: int):
    import transformers as tf

    return tf.Qwen2VLImageProcessor(patch_size=patch, merge_size=QWEN_MERGE, temporal_patch_size=2,
                                    min_pixels=min_pixels, max_pixels=max_pixels)


def write_dummy_vlm_dir(out_dir: Path, config: dict) -> Path:
    """A model directory for `--load-format dummy` of a full-size Qwen2-VL / Qwen2.5-VL config (e.g. the built-in
    qwen2.5-vl-7b): the config, a byte-level tokenizer whose image markers replace the config's ids, the image
    processor of the config's patch size (Qwen's own pixel range) and an empty weights file (the engine draws the
    weights). Enough for the whole serving path, tokenizer worker and processor included, with no download."""
    import json

    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _qwen_tokenizer(words_up_to=config["vocab_size"])
    tokenizer.save_pretrained(out_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    (out_dir / "config.json").write_text(json.dumps({**config, **_marker_ids(tokenizer), "eos_token_id": eos,
                                                     "bos_token_id": None}, indent=1))
    patch = config["vision_config"].get("patch_size", 14)
    _qwen_image_processor(patch, 56 * 56, 28 * 28 * 16384).save_pretrained(out_dir)
    save_file({}, str(out_dir / "model.safetensors"))
    return out_dir


def build_vlms(root: Path) -> dict[str, Path]:
    root = Path(root)
    return {"idefics3": build_tiny_idefics3(root / "idefics3"), "qwen2-vl": build_tiny_qwen2_vl(root / "qwen2-vl"),
            "qwen2.5-vl": build_tiny_qwen2_vl(root / "qwen2.5-vl", "2.5")}


if __name__ == "__main__":
    args = sys.argv[1:]
    vlm = "--vlm" in args
    args = [a for a in args if a != "--vlm"]
    if len(args) != 1:
        sys.exit("usage: python examples/make_tiny_media_models.py [--vlm] OUT_DIR")
    for name, path in (build_vlms if vlm else build_all)(Path(args[0])).items():
        print(f"{name}: {path}")
