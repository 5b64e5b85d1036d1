"""Model building blocks in plain torch: TP-aware linear and embedding, RMSNorm, RoPE, activations."""
