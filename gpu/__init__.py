"""Device kernels (Triton) and their pure-torch references. Never imports hybrid: hybrid imports these."""
