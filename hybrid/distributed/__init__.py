"""CPU-only scale-out: tensor-parallel ranks (one per NUMA node) and pipeline stages over torch.distributed."""
