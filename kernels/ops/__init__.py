"""One file per op: Triton kernels, launcher, registration. ``registry.load()`` imports them all."""
