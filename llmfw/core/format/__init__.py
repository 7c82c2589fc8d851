"""File formats: GGUF parsing and ggml quantisation types."""
