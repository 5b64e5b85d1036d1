"""Built-in diffusion pipeline configs by name, built with random weights for `--load-format dummy` (speed work).

No weights exist offline, so the full-size entries (docs/media.md; the values of the public checkpoints' config
files, /work/shared/reference/media_configs.md) are built directly on the target device in its dtype: no disk, no
hub, seconds for Z-Image-Turbo's 6B DiT + 4B text encoder on a GPU. The tiny entries are the test pipelines
(examples/make_tiny_media_models.py builds and saves them). Pictures from random weights are noise: a dummy
pipeline exists to time the real code path, nothing else. The tokenizer is a byte-level one built here (the real
ones are on the hub): a prompt becomes about one token a byte.
"""

from __future__ import annotations

import functools
from typing import Any

from minisgl_cli.media.jobs import Kind, MediaError

# Qwen-style chat markup, enough for ZImagePipeline's apply_chat_template(enable_thinking=...).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<unk>", "</s>", "<|im_start|>", "<|im_end|>"]

_FLUX_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
)

# name -> (kind, pipeline class, {component: (class, kwargs)}); text encoders are transformers' (model, config).
PIPELINES: dict[str, tuple[Kind, str, dict[str, tuple[str, dict[str, Any]]]]] = {
    "z-image-turbo": ("image", "ZImagePipeline", {
        "text_encoder": ("Qwen3Model", dict(
            vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
            max_position_embeddings=40960, tie_word_embeddings=True)),
        "transformer": ("ZImageTransformer2DModel", dict(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2,
            n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
            t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512])),
        "vae": ("AutoencoderKL", _FLUX_VAE),
        "scheduler": ("FlowMatchEulerDiscreteScheduler", dict(num_train_timesteps=1000, shift=3.0)),
    }),
    "wan2.1-t2v-1.3b": ("video", "WanPipeline", {
        "text_encoder": ("UMT5EncoderModel", dict(
            vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
            relative_attention_num_buckets=32, feed_forward_proj="gated-gelu")),
        "transformer": ("WanTransformer3DModel", dict(
            patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
            text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)),
        "vae": ("AutoencoderKLWan", {}),
        "scheduler": ("FlowMatchEulerDiscreteScheduler", dict(shift=3.0)),
    }),
    # The test pipelines (examples/make_tiny_media_models.py saves them to disk).
    "tiny-z-image": ("image", "ZImagePipeline", {
        "text_encoder": ("Qwen3Model", dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, max_position_embeddings=1024)),
        "transformer": ("ZImageTransformer2DModel", dict(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2, n_refiner_layers=1,
            n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[256, 64, 64])),
        "vae": ("AutoencoderKL", dict(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32), layers_per_block=1,
            latent_channels=4, norm_num_groups=8, scaling_factor=0.3611, shift_factor=0.1159)),
        "scheduler": ("FlowMatchEulerDiscreteScheduler", dict(num_train_timesteps=1000, shift=3.0)),
    }),
    "tiny-wan": ("video", "WanPipeline", {
        "text_encoder": ("UMT5EncoderModel", dict(
            d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, relative_attention_num_buckets=8)),
        "transformer": ("WanTransformer3DModel", dict(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16,
            text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32)),
        "vae": ("AutoencoderKLWan", dict(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])),
        "scheduler": ("FlowMatchEulerDiscreteScheduler", dict(shift=7.0)),
    }),
}

_CONFIGS = {"Qwen3Model": "Qwen3Config", "UMT5EncoderModel": "UMT5Config"}


def byte_tokenizer(extra_special: tuple[str, ...] = (), words_up_to: int = 0) -> Any:
    """A byte-level tokenizer with no merges: covers any text with a ~260-entry vocab, no download. `words_up_to`:
    filler words " w<id>" take the ids up to that many (less the specials) -- never produced by encoding, but
    every id a full-size dummy model samples then decodes to text, so a stream has chunks to time."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + sorted(alphabet))}
    vocab.update({f"\u0120w{i}": i for i in range(len(vocab), words_up_to - len(extra_special))})  # \u0120: space
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    if extra_special:  # a model's own markers (image tokens, end of turn), each one token
        fast.add_special_tokens({"additional_special_tokens": list(extra_special)})
    return fast


def builtin_kind(name: str) -> Kind:
    """The kind ("image" / "video") of a built-in config; a clear error naming the choices for an unknown one."""
    if name not in PIPELINES:
        raise MediaError(f"--load-format dummy needs a built-in config for --model, got {name!r}: use one of "
                         f"{', '.join(PIPELINES)}", "model")
    return PIPELINES[name][0]


def _component(name: str, part: str, tokenizer: Any) -> Any:
    """One component of built-in pipeline `name`, built in torch's current default device (random weights)."""
    import diffusers
    import transformers

    cls_name, kwargs = PIPELINES[name][2][part]
    if part != "text_encoder":
        return getattr(diffusers, cls_name)(**kwargs)
    config = getattr(transformers, _CONFIGS[cls_name])(
        **kwargs, **({} if "vocab_size" in kwargs else {"vocab_size": len(tokenizer)}),
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        **({"decoder_start_token_id": tokenizer.pad_token_id} if cls_name == "UMT5EncoderModel" else {}))
    return getattr(transformers, cls_name)(config)


@functools.cache
def parameter_counts(name: str) -> dict[str, int]:
    """The parameters (and buffers) of each weighted component of built-in pipeline `name`, counted on the meta
    device: no memory, a second or two for Z-Image-Turbo's 10B."""
    import torch

    builtin_kind(name)
    tokenizer = byte_tokenizer()
    counts = {}
    with torch.device("meta"):
        for part in PIPELINES[name][2]:
            if part != "scheduler":
                module = _component(name, part, tokenizer)
                counts[part] = sum(t.numel() for t in (*module.parameters(), *module.buffers()))
    return counts


def _cast(model: Any, dtype: Any, keep_fp32: bool = True) -> Any:
    """`model` in `dtype` as from_pretrained(torch_dtype=dtype) leaves it: its fp32-kept modules (Wan's norms,
    RoPE, time embedder) stay in float32 where `keep_fp32` (diffusers always; transformers under fp16 only)."""
    import torch

    torch.nn.Module.to(model, dtype)  # (ModelMixin.to warns about the fp32-kept modules this handles next)
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ()) if keep_fp32 else set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if keep & set(name.split(".")) and tensor.is_floating_point():
            tensor.data = tensor.data.float()
    return model.eval()


def build_dummy_pipeline(name: str, device: str, dtype: Any) -> Any:
    """The built-in pipeline `name` with random weights, its modules created directly on `device` (a GPU initialises
    10B parameters in about a second), in float32 (constructors compute RoPE tables and the like in the default
    dtype) and then cast to `dtype`, one module at a time."""
    import diffusers
    import torch

    builtin_kind(name)
    _, pipeline_cls, parts = PIPELINES[name]
    tokenizer = byte_tokenizer()
    components: dict[str, Any] = {"tokenizer": tokenizer}
    # Seeded on a forked RNG: the same name gives the same weights in every build (a benchmark compares options on
    # one set of weights), and the caller's RNG state is left as it was.
    cuda = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        torch.manual_seed(0)
        for part in parts:
            module = _component(name, part, tokenizer)
            keep_fp32 = part != "text_encoder" or dtype == torch.float16
            components[part] = module if part == "scheduler" else _cast(module, dtype, keep_fp32)
    transformer = components["transformer"]
    if hasattr(transformer, "x_pad_token"):  # Z-Image's pad embeddings start at zero: a tiny DiT then emits NaN
        with torch.no_grad():
            transformer.x_pad_token.fill_(1.0)
            transformer.cap_pad_token.fill_(1.0)
    return getattr(diffusers, pipeline_cls)(**components)
