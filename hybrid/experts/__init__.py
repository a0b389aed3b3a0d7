"""Routed experts behind one interface (base.py): torch reference, kernels, the expert process, hot experts."""
