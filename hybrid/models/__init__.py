"""Model architectures (one file each), the decoder skeleton they share, and its step as segments."""
