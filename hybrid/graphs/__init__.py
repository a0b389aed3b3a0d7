"""Captured decode steps: CUDA graphs on a GPU, a guarded stand-in on the CPU, driven through the layer segments."""
