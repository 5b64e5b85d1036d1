"""Build tiny, randomly initialised Z-Image and Wan pipelines offline and save them to a directory.

The weights are random: the pictures are noise-like, but every component (tokenizer, text
encoder, transformer, VAE, scheduler) is real, so the saved dirs exercise the exact loading and
denoising code paths of the full-size models. Used by tests/media_fixtures.py and docs/media.md.

    python examples/make_tiny_media_models.py OUT_DIR    # writes OUT_DIR/z-image, OUT_DIR/wan
"""

from __future__ import annotations

import sys
from pathlib import Path

# Qwen-style chat markup, enough for ZImagePipeline's apply_chat_template(enable_thinking=...).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<unk>", "</s>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer():
    """A byte-level tokenizer with no merges: covers any text with a ~260-entry vocab, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_z_image(out_dir: Path) -> Path:
    """ZImagePipeline: 2-layer DiT (dim 32), 2-layer Qwen3 text encoder, 2-level AutoencoderKL."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=32,
        axes_dims=[4, 6, 6],  # sums to head_dim = dim / n_heads
        axes_lens=[256, 64, 64],
    )
    # The pad embeddings fill padded positions; fix them so a tiny random model cannot emit NaN.
    with torch.no_grad():
        transformer.x_pad_token.fill_(1.0)
        transformer.cap_pad_token.fill_(1.0)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(16, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        scaling_factor=0.3611,
        shift_factor=0.1159,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    pipe = ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    pipe.save_pretrained(out_dir)
    return out_dir


def build_tiny_wan(out_dir: Path) -> Path:
    """WanPipeline: 2-layer video DiT, 2-layer UMT5 encoder, a base_dim=3 Wan VAE (8x space, 4x time)."""
    import torch
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    tokenizer = tiny_tokenizer()
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=32,
            d_kv=16,
            d_ff=64,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=32,
        ffn_dim=32,
        num_layers=2,
        rope_max_seq_len=32,
    )
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)
    pipe = WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer
    )
    pipe.save_pretrained(out_dir)
    return out_dir


def build_all(root: Path) -> dict[str, Path]:
    root = Path(root)
    return {"z-image": build_tiny_z_image(root / "z-image"), "wan": build_tiny_wan(root / "wan")}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/make_tiny_media_models.py OUT_DIR")
    for name, path in build_all(Path(sys.argv[1])).items():
        print(f"{name}: {path}")
