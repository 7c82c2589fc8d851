"""Produce tests/data/ugm_nomic_bert_moe.json: llama.cpp's UGM (T5 / XLM-RoBERTa unigram) tokenization of
llama.cpp's ``models/ggml-vocab-nomic-bert-moe.gguf`` (``tokenizer.ggml.model = t5``, a precompiled charsmap,
``remove_extra_whitespaces``), which the suite ships without ``.inp`` / ``.out``.

Run ONCE in a throw-away environment that has llama-cpp-python 0.3.36 (never a dependency of llmfw):

    /tmp/lcpp/bin/python tests/reference_gen/ugm_reference.py MODELS_DIR tests/data/ugm_nomic_bert_moe.json

MODELS_DIR holds the suite's vocab files (``vendor/llama.cpp/models`` of the sdist). The texts are the 46 inputs
of ``ggml-vocab-bert-bge.gguf.inp`` plus cases aimed at UGM's normalizer (NFKC through the charsmap, runs of
spaces, tabs and newlines, user-defined / control token texts, lone surrogates excluded), tokenized with
``add_special`` on and off and ``parse_special`` off and on.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import llama_cpp

SEPARATOR = "\n__ggml_vocab_test__\n"
EXTRA = ["ＡＢＣ ﬁ ① ㍻ ｶﾀｶﾅ", "   leading and trailing   ", "tabs\tand\nnewlines\r\n", "<mask> <s> </s> <pad>",
         "Ünïcödé façade naïve — “quotes”", "日本語のテキスト。中文文本。", "😀🙂👍🏽", "a" * 200, "x\u0000y",
         "Hello<mask>world", "  \u3000 ideographic space", "e\u0301 vs é"]


def main(models_dir: str, out_path: str) -> None:
    models = Path(models_dir)
    texts = (models / "ggml-vocab-bert-bge.gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)
    texts = [t for t in texts if t] + EXTRA
    llm = llama_cpp.Llama(model_path=str(models / "ggml-vocab-nomic-bert-moe.gguf"), vocab_only=True, verbose=False)
    cases = []
    for text in texts:
        for add_special in (False, True):
            for parse_special in (False, True):
                ids = llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
                cases.append({"text": text, "add_special": add_special, "parse_special": parse_special, "ids": ids})
    result = {"vocab": "ggml-vocab-nomic-bert-moe.gguf", "llama_cpp_python": llama_cpp.__version__, "cases": cases}
    Path(out_path).write_text(json.dumps(result, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"{len(cases)} cases", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:3])
