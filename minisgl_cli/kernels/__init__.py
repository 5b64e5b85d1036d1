"""Every hand-written kernel of minisgl and its builder, nothing else: Triton for CUDA (triton/), C++ for the CPU
(cpu/), and the FP8 numerics they share. Layers, attention and sampling call them."""
