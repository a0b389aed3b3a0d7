"""Attention over the paged KV cache behind one interface (backend.py): torch, C++ CPU and Triton backends."""
