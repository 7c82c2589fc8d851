"""Produce tests/data/bpe_pretokenizers_more.json: llama.cpp's tokenization under the pre-tokenizers that
tests/data/reference/bpe-pretokenizers.json does not cover (the ones issue 17 added), with SmolLM2's BPE vocabulary.

Two steps, two interpreters (llama-cpp-python is only the measuring stick, never a dependency of llmfw):

    python3 tests/reference_gen/bpe_pretokenizers_more.py write /tmp/pre MODELS_DIR SMOLLM2.gguf   # llmfw's venv
    /tmp/lcpp/bin/python tests/reference_gen/bpe_pretokenizers_more.py measure /tmp/pre tests/data/bpe_pretokenizers_more.json

``write`` makes one vocab-only GGUF per pre value (SmolLM2's tokenizer keys, only ``tokenizer.ggml.pre``
replaced) and ``texts.json``: the 46 inputs of the suite's ``ggml-vocab-bert-bge.gguf.inp`` plus multilingual
and code cases. ``measure`` tokenizes every text with llama.cpp (add_special off, parse_special off).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

PRE_VALUES = ["qwen35", "deepseek-v3", "spark2_5", "youtu", "jais-2", "bloom", "poro-chat", "viking", "chatglm-bpe",
              "glm4", "exaone-moe", "chameleon", "granite-embed-multi-97m", "bailingmoe", "seed-coder", "ufakzeka",
              "grok-2", "laguna", "minicpm5", "minimax-m2", "hunyuan-dense", "megrez"]
SEPARATOR = "\n__ggml_vocab_test__\n"
EXTRA = ["def f(x):\n\treturn x**2  # 12345678", "Ünïcödé façade naïve — “quotes” l'été", "日本語のテキスト、カタカナ。中文文本。",
         "한국어 텍스트 ㄱㄴㄷ", "Привіт, світе! 2026 рік.", "नमस्ते दुनिया", "مرحبا بالعالم ،؛", "<sentinel:12> IMGIMGABZ",
         "I'M   SHOUTING, you're WhiSpErInG", "1,234,567.89 and 3.14159", "😀🙂👍🏽 e\u0301", "a/b\\c|d~e`f^g"]


def write(folder: str, models_dir: str, smollm2: str) -> None:
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root))
    from llmfw.core.format.gguf import GGUFWriter, open_gguf

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    with open_gguf(smollm2) as source:
        keys = [(k, v, source.metadata_types[k], source.metadata_array_types.get(k))
                for k, v in source.metadata.items() if k.startswith("tokenizer.ggml.") and k != "tokenizer.ggml.pre"]
    for pre in PRE_VALUES:
        writer = GGUFWriter(out / f"{pre}.gguf")
        writer.add("general.architecture", "llama")
        for key, value, vtype, array_type in keys:
            writer.add(key, value, vtype, array_type=array_type)
        writer.add("tokenizer.ggml.pre", pre)
        writer.write()
    texts = (Path(models_dir) / "ggml-vocab-bert-bge.gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)
    (out / "texts.json").write_text(json.dumps([t for t in texts if t] + EXTRA, ensure_ascii=False))


def measure(folder: str, out_path: str) -> None:
    import llama_cpp

    texts = json.loads((Path(folder) / "texts.json").read_text())
    by_pre = {}
    for pre in PRE_VALUES:
        llm = llama_cpp.Llama(model_path=str(Path(folder) / f"{pre}.gguf"), vocab_only=True, verbose=False)
        by_pre[pre] = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in texts]
    result = {"vocab": "SmolLM2-135M-Instruct tokenizer keys, tokenizer.ggml.pre replaced",
              "llama_cpp_python": llama_cpp.__version__, "texts": texts, "by_pre": by_pre}
    Path(out_path).write_text(json.dumps(result, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    {"write": write, "measure": measure}[sys.argv[1]](*sys.argv[2:])
