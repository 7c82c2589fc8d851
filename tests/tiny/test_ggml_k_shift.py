"""The "ggml" backend's K-shift on a tiny random-weight llama: ``seq_add`` re-ropes the cached keys in float32
and stores them back into its f16 KV cache, like llama.cpp's."""
from __future__ import annotations

import numpy as np

import llmfw
from reference_gen.arch_testing import shift_error
from support.models import write_tiny_llama


def test_k_shift_reropes_the_f16_cache(tmp_path):
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    prompt, follower, delta = list(range(10, 40)), 77, 7
    with llmfw.load_model(path, backend="ggml") as model:
        assert model.backends["ggml"].f16_kv_cache is True
        # shifted keys are rounded to f16 twice (written, then re-roped), directly decoded ones once
        assert shift_error(model, prompt, follower, delta) < 0.1
        ctx = model.new_context(n_ctx=128)
        assert ctx.decode(llmfw.Batch(prompt)) == 0
        ctx.memory.seq_add(0, 0, -1, delta)
        assert ctx.decode(llmfw.Batch([follower])) == 0
        for storage in ctx.memory.storage.values():  # every cached key is an f16 value after the shift
            np.testing.assert_array_equal(storage.k, storage.k.astype(np.float16).astype(np.float32))
