"""How reproducible are the reference files' greedy continuations by llama.cpp itself?

Run with an interpreter that has llama-cpp-python (a throw-away one, never a project dependency):

    /tmp/lcpp/bin/python benchmarks/llama_cpp_vs_reference.py \
        ~/.cache/llmfw/models/SmolLM2-135M-Instruct.Q4_1.gguf tests/data/reference/smollm2-135m-instruct-q4_1.json

For every reference prompt it (1) decodes greedily token by token, as the reference's ``sequence`` was made,
and reports where the result first differs from the reference and llama.cpp's top-2 gap *in the reference* at
that position; (2) evaluates the reference ``sequence`` teacher-forced in one batch and reports this build's own
top-2 gap at that position, and its mean log-prob error against the reference (the score of
``tests/data/reference/compare.py``). It imports nothing from llmfw.

Measured with llama-cpp-python 0.3.36 (the version the reference names) built on the project's AVX2 VM, 2 threads:

| model | prompt | mean_lp_err vs reference | greedy vs reference | reference gap there | this build's gap there |
| --- | --- | --- | --- | --- | --- |
| SmolLM2 | 0 / 1 / 2 | 0.082 / 0.119 / 0.064 | equal | | |
| SmolLM2 | 3 | 0.087 | differs at token 16 | 0.035 | -0.045 |
| SmolLM2 | 4 | 0.100 | differs at token 1 | 0.051 | -0.062 |
| Gemma-3 | 0 / 1 / 2 | 0.082 / 0.188 / 0.106 | equal | | |
| Gemma-3 | 3 | 0.087 | differs at token 3 | 0.049 | -0.114 |
| Gemma-3 | 4 | 0.168 | differs at token 4 | **0.160** | -0.100 |

So llama.cpp itself, same version, scores like any correct engine against the files (mean_lp_err 0.06-0.19) and
does not reproduce every greedy continuation; even its own context settings move the flips (with n_ctx = n_batch
= 4096 Gemma-3 prompt 3 differs at token 11 instead of 3). On SmolLM2 prompt 0, token 5 (reference gap 0.33,
where llmfw's backends take the second choice), this build's teacher-forced gap is 0.017.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
from llama_cpp import Llama


def first_difference(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


def greedy(llm: Llama, prompt: list[int], n_tokens: int) -> list[int]:
    out: list[int] = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        out.append(token)
        if len(out) >= n_tokens or token == llm.token_eos():
            break
    return out


def mean_lp_error(record: dict, logits: np.ndarray) -> float:
    errors = []
    for row, pos in zip(logits, record["positions"]):
        row = row.astype(np.float64)
        lse = row.max() + np.log(np.exp(row - row.max()).sum())
        errors.append(np.abs(np.array(pos["top_logits"]) - pos["lse"] - (row[pos["top_ids"]] - lse)))
    return float(np.concatenate(errors).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="the GGUF file the reference was made from")
    parser.add_argument("reference", help="the reference JSON file")
    parser.add_argument("-t", "--threads", type=int, default=2)
    args = parser.parse_args()
    reference = json.load(open(args.reference))
    n_ctx = max(len(r["sequence"]) for r in reference["prompts"]) + 16
    llm = Llama(args.model, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=512, n_threads=args.threads, logits_all=True,
                verbose=False)
    for index, record in enumerate(reference["prompts"]):
        prompt, sequence = record["prompt_ids"], record["sequence"]
        want = sequence[len(prompt):]
        first = first_difference(greedy(llm, prompt, len(want)), want)
        llm.reset()
        llm.eval(sequence)
        logits = np.array(llm.scores[:len(sequence)])
        line = f"prompt {index}: mean_lp_err {mean_lp_error(record, logits):.3f}, greedy "
        if first is None:
            print(line + "equal to the reference", flush=True)
            continue
        row = len(prompt) + first - 1
        pos = record["positions"][row]
        best, second = pos["top_ids"][:2]
        print(line + f"differs at token {first}: reference gap {pos['top_logits'][0] - pos['top_logits'][1]:.3f}, "
              f"this build's teacher-forced gap {logits[row, best] - logits[row, second]:.3f}", flush=True)


if __name__ == "__main__":
    main()
