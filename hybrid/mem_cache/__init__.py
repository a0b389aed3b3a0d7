"""The paged KV cache: the pool of per-layer cache tensors and the allocation of its blocks to sequences."""
