"""Fused kernels for fxmem: Triton on GPU, lean PyTorch on CPU (filled in by the [kernels] work)."""
