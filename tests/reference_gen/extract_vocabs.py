"""Cut the two real vocabularies down to 8,192 tokens for the random-weight architecture files (run once).

    python3 tests/reference_gen/extract_vocabs.py

writes ``tests/data/arch/vocab_bpe_smollm2_8k.json`` and ``tests/data/arch/vocab_spm_gemma3_8k.json``. Both cuts
stay valid tokenizers for llama.cpp:

* SmolLM2's BPE gives merge number ``k`` the token id ``252 + k`` (17 special tokens and 235 byte characters
  come first), so the first 8,192 tokens together with the first 7,940 merges are a closed BPE: every merge
  result and every merge part is kept.
* Gemma-3's SPM orders its normal pieces by score (score = -rank) after the special and byte tokens (ids < 494),
  so the first 8,192 ids keep every byte token and the best-scored pieces; a piece that was cut is spelled from
  its shorter pieces or from bytes, as SentencePiece would.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from llmfw.core.format.catalog import resolve_model  # noqa: E402
from llmfw.core.format.gguf import GGUFFile  # noqa: E402

N_TOKENS = 8192
DATA_DIR = ROOT / "tests" / "data" / "arch"
#: SmolLM2's merge k produces token 252 + k (checked below)
SMOLLM2_FIRST_MERGED_ID = 252


def _plain_list(values) -> list:
    return [v.item() if hasattr(v, "item") else v for v in values]


def extract_bpe() -> dict:
    with GGUFFile(resolve_model("smollm2")) as model:
        tokens = model.get("tokenizer.ggml.tokens")[:N_TOKENS]
        types = _plain_list(model.get("tokenizer.ggml.token_type")[:N_TOKENS])
        merges = model.get("tokenizer.ggml.merges")[:N_TOKENS - SMOLLM2_FIRST_MERGED_ID]
        specials = {key: model.get(key) for key in (
            "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id")}
    index = {token: i for i, token in enumerate(tokens)}
    for rank, merge in enumerate(merges):
        left, right = merge.split(" ")
        if index.get(left + right) != SMOLLM2_FIRST_MERGED_ID + rank:
            raise SystemExit(f"merge {rank} {merge!r} does not produce token {SMOLLM2_FIRST_MERGED_ID + rank}")
    return {"source": "SmolLM2-135M-Instruct.Q4_1.gguf (first 8192 tokens, first 7940 merges)",
            "tokens": tokens, "token_type": types, "merges": merges, "special_ids": specials}


def extract_spm() -> dict:
    with GGUFFile(resolve_model("gemma-3-270m")) as model:
        tokens = model.get("tokenizer.ggml.tokens")[:N_TOKENS]
        scores = [float(s) for s in model.get("tokenizer.ggml.scores")[:N_TOKENS]]
        types = _plain_list(model.get("tokenizer.ggml.token_type")[:N_TOKENS])
    return {"source": "gemma-3-270m-q4_k_m.gguf (first 8192 ids)", "tokens": tokens, "scores": scores,
            "token_type": types}


def main() -> None:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    for name, data in (("vocab_bpe_smollm2_8k.json", extract_bpe()), ("vocab_spm_gemma3_8k.json", extract_spm())):
        path = DATA_DIR / name
        path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8")
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
