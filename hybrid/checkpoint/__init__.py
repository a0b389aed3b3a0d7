"""Reading Hugging Face safetensors checkpoints: tensors by name with clear errors, fp8 block dequantization."""
