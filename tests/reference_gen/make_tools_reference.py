"""llama.cpp's answers for the tools tests (perplexity, embeddings), measured with llama-cpp-python.

Runs in an interpreter that has llama-cpp-python 0.3.36 (a throw-away venv; never a dependency of llmfw):

    /tmp/lcpp/bin/python tests/reference_gen/make_tools_reference.py perplexity MODEL.gguf TEXT N_CTX [N_CHUNKS]
    /tmp/lcpp/bin/python tests/reference_gen/make_tools_reference.py embed MODEL.gguf POOLING TEXT...
    /tmp/lcpp/bin/python tests/reference_gen/make_tools_reference.py embed-flash-attn MODEL.gguf POOLING TEXT...

and prints one JSON object. ``perplexity`` follows llama-perplexity's ``perplexity()`` (tools/perplexity/
perplexity.cpp): tokenize with add_special=True, parse_special=False; chunks of n_ctx; each chunk on an empty
cache with its first token replaced by BOS when the vocabulary adds one; score positions n_ctx/2 .. n_ctx-2;
running PPL per chunk; final PPL and llama.cpp's stderr. (llama-perplexity packs n_batch/n_ctx chunks into one
decode as separate sequences; here one chunk is decoded at a time, which differs only in rounding.)
``embed`` calls ``Llama.embed`` (embedding=True, the given pooling) for all texts at once (batched) and one by
one, normalized (Euclidean), with llama-cpp-python's default ``flash_attn=False``; ``embed-flash-attn`` does the same
with ``flash_attn=True`` (llama.cpp's other attention path, which its own tools pick by default on a CPU: it
measures how far llama.cpp's two paths disagree, the noise floor of an embedding comparison). tests/reference_gen/make_tools_data.py (run with llmfw's interpreter) calls this
and writes tests/data/tools/*.json.
"""
from __future__ import annotations

import json
import math
import sys

import numpy as np


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    rows = logits.astype(np.float64)
    peak = rows.max(axis=1, keepdims=True)
    return np.log(np.exp(rows - peak).sum(axis=1)) + peak[:, 0] - rows[np.arange(rows.shape[0]), targets]


def perplexity(model_path: str, text_path: str, n_ctx: int, n_chunks: int = -1) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                          n_threads=2, verbose=False)
    text = open(text_path, encoding="utf-8").read()
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    add_bos = bool(llama_cpp.llama_vocab_get_add_bos(llm._model.vocab))
    count = len(tokens) // n_ctx if n_chunks < 0 else min(n_chunks, len(tokens) // n_ctx)
    first = n_ctx // 2
    nll = nll2 = 0.0
    n = 0
    running = []
    for i in range(count):
        chunk = list(tokens[i * n_ctx:(i + 1) * n_ctx])
        if add_bos:
            chunk[0] = llm.token_bos()
        llm.reset()
        llm._ctx.kv_cache_clear()
        llm.eval(chunk)
        logits = np.array(llm.scores[first:n_ctx - 1], dtype=np.float32)
        values = _nll(logits, np.array(chunk[first + 1:], dtype=np.int64))
        nll += float(values.sum())
        nll2 += float((values * values).sum())
        n += values.size
        running.append(math.exp(nll / n))
    mean, mean2 = nll / n, nll2 / n
    stderr = math.sqrt((mean2 - mean * mean) / (n - 1)) * math.exp(mean)
    return {"n_ctx": n_ctx, "n_chunks": count, "n_tokens": len(tokens), "ppl": math.exp(mean), "stderr": stderr,
            "running": running}


POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3}


def embed(model_path: str, pooling: str, texts: list[str], flash_attn: bool = False) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path, embedding=True, pooling_type=POOLING[pooling], n_ctx=2048, n_batch=2048,
                          n_ubatch=2048, n_threads=2, flash_attn=flash_attn, verbose=False)
    one_by_one = [llm.embed(t, normalize=True) for t in texts]
    # llama-cpp-python 0.3.36 reads pooling=none rows of the 2nd and later texts of a batch from the wrong
    # offset (pos advances by tokens, not tokens * n_embd), so for none only one-by-one vectors are measured
    batched = llm.embed(texts, normalize=True) if pooling != "none" else None
    n_tokens = [len(llm.tokenize(t.encode("utf-8"), add_bos=True, special=False)) for t in texts]
    return {"pooling": pooling, "texts": texts, "n_tokens": n_tokens, "one_by_one": one_by_one, "batched": batched}


def main(argv: list[str]) -> None:
    if argv[0] == "perplexity":
        out = perplexity(argv[1], argv[2], int(argv[3]), int(argv[4]) if len(argv) > 4 else -1)
    elif argv[0] == "embed":
        out = embed(argv[1], argv[2], argv[3:])
    elif argv[0] == "embed-flash-attn":
        out = embed(argv[1], argv[2], argv[3:], flash_attn=True)
    else:
        raise SystemExit(__doc__)
    import llama_cpp

    out["llama_cpp_python"] = llama_cpp.__version__
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1:])
