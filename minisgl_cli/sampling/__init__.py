"""Sampling: every request's sampling state on the device, the sampler that draws each step's tokens, its graphs."""
