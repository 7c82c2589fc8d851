"""Measure llama.cpp's tokenization and teacher-forced logits on the random-weight models (run by
``make_arch_reference.py`` inside a throw-away llama-cpp-python environment; never imported by llmfw or tests).

    LLAMA_PY measure_llamacpp.py OUT_DIR MODEL.gguf [MODEL.gguf ...]

For every prompt of the model's spec: llama.cpp's tokens (``add_special=True, parse_special=True``), a greedy
continuation of ``N_CONTINUATION`` tokens (stopping at an end-of-generation token), then the whole sequence
evaluated at once with ``logits_all``; each position keeps its top-``N_TOP`` ids and logits and the
log-sum-exp over the vocabulary, the format of ``tests/data/reference`` (so ``tests/conftest.py``'s ``score``
applies). Writes ``OUT_DIR/<name>.json``.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arch_specs import N_CONTINUATION, N_CTX, N_TOP, SPECS, prompt_text, reference_name

import llama_cpp  # the measuring stick, only here

N_THREADS = 2


def use_plain_cpu_buffers() -> None:
    """Load models without ggml's extra CPU buffer types (AMX / repacked weights): the AMX matmul crashes in a
    container that has not been granted the AMX tile state, and the plain CPU kernels are the reference anyway.
    llama-cpp-python reads ``llama_cpp.llama_cpp.llama_model_default_params`` when it builds a model: wrap it."""
    default = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_cpp.llama_model_default_params = params


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _is_eog(llm: "llama_cpp.Llama", token: int) -> bool:
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return bool(llama_cpp.llama_vocab_is_eog(vocab, token))


def _positions(logits: np.ndarray) -> list[dict]:
    rows = []
    for row in logits.astype(np.float64):
        top = np.argsort(-row, kind="stable")[:N_TOP]
        peak = row.max()
        lse = peak + np.log(np.exp(row - peak).sum())
        rows.append({"top_ids": [int(t) for t in top], "top_logits": [round(float(row[t]), 5) for t in top],
                     "lse": round(float(lse), 5)})
    return rows


def _measure_prompt(llm: "llama_cpp.Llama", key: str, n_ctx: int) -> dict:
    text = prompt_text(key)
    prompt_ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    llm.reset()
    llm.eval(prompt_ids)
    sequence = list(prompt_ids)
    continuation = []
    for _ in range(N_CONTINUATION):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if _is_eog(llm, token):
            break
        continuation.append(token)
        sequence.append(token)
        llm.eval([token])
    # teacher forcing: the whole sequence in one batch, logits for every position
    llm.reset()
    llm.eval(sequence)
    logits = np.array(llm.scores[: len(sequence)], dtype=np.float32)
    return {
        "name": key, "n_ctx": n_ctx, "prompt": text, "prompt_ids": [int(t) for t in prompt_ids],
        "sequence": [int(t) for t in sequence],
        "continuation_text": llm.detokenize(continuation).decode("utf-8", errors="replace"),
        "positions": _positions(logits),
    }


def measure(path: Path) -> dict:
    name = path.name[: -len(".gguf")]
    spec = SPECS[name]
    runs = [{"n_ctx": N_CTX, "prompts": spec["prompts"]}] + spec.get("extra_runs", [])
    records = []
    n_vocab = None
    for run in runs:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=run["n_ctx"], n_batch=run["n_ctx"],
                              n_ubatch=run["n_ctx"], n_threads=N_THREADS, n_threads_batch=N_THREADS,
                              logits_all=True, verbose=False, seed=0)
        n_vocab = llm.n_vocab()
        records += [_measure_prompt(llm, key, run["n_ctx"]) for key in run["prompts"]]
        llm.close()
    return {
        "model": name, "arch": spec["arch"], "file": path.name, "sha256": _sha256(path),
        "size": path.stat().st_size, "n_vocab": n_vocab, "llama_cpp_python": llama_cpp.__version__,
        "n_threads": N_THREADS, "prompts": records,
    }


def main() -> None:
    use_plain_cpu_buffers()
    out_dir = Path(sys.argv[1])
    for arg in sys.argv[2:]:
        result = measure(Path(arg))
        target = out_dir / reference_name(result["model"])
        target.write_text(json.dumps(result, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
        lengths = [len(r["sequence"]) for r in result["prompts"]]
        print(f"{target}: {len(lengths)} prompts, sequence lengths {lengths}")


if __name__ == "__main__":
    main()
