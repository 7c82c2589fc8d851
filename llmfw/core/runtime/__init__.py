"""Runtime: loading weights, models, batches, memory (KV caches), contexts and their state."""
