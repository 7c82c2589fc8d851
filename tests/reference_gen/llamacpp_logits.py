"""llama.cpp's teacher-forced logits of one model file for one token sequence, for the opt-in comparisons of
tests/tiny/test_optional_tensors.py (run under the interpreter named by ``LLMFW_LLAMA_PYTHON``; never imported by llmfw).

    LLAMA_PY llamacpp_logits.py MODEL.gguf N_CTX TOKENS_JSON OUT.npy
"""
from __future__ import annotations

import json
import sys

import numpy as np

import llama_cpp  # the measuring stick, only here
from measure_llamacpp import use_plain_cpu_buffers  # a sibling script


def main(model: str, n_ctx: str, tokens_json: str, out: str) -> None:
    use_plain_cpu_buffers()
    tokens = json.loads(tokens_json)
    llm = llama_cpp.Llama(model_path=model, n_ctx=int(n_ctx), n_batch=int(n_ctx), n_ubatch=int(n_ctx), n_threads=2,
                          logits_all=True, verbose=False, seed=0)
    llm.eval(tokens)
    np.save(out, np.array(llm.scores[: len(tokens)], dtype=np.float32))


if __name__ == "__main__":
    main(*sys.argv[1:5])
