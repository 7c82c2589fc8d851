"""The graph IR, its rewrite passes and RoPE helpers."""
