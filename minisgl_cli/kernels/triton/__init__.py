"""Triton kernels (CUDA): paged attention, sampling, fused decoder ops, GEMV, fused MoE, FP8 quantization."""
