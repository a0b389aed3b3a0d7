"""CPU kernels for the routed experts (C++ with a thin binding) and CPU feature detection."""
