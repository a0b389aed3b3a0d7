"""GPU-side pieces: Triton attention and MoE kernels and the hybrid runner's device seam."""
