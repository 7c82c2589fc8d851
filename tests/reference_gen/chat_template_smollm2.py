"""Produce tests/data/chat_template_smollm2.json: llama.cpp's rendering of SmolLM2's chat template.

Run ONCE in a throw-away environment that has llama-cpp-python (never a dependency of llmfw):

    /tmp/lcpp/bin/python tests/reference_gen/chat_template_smollm2.py MODEL.gguf tests/data/chat_template_smollm2.json

Two renderings are recorded for each conversation and add_generation_prompt value:
* ``jinja``: llama-cpp-python's Jinja2ChatFormatter applied to the GGUF's ``tokenizer.chat_template``;
* ``llama_cpp_builtin``: llama.cpp's C++ ``llama_chat_apply_template`` with the same template text (it detects
  the template family — ChatML here — and formats it natively; it has no Jinja engine, so it ignores the
  template's default-system-prompt logic).
"""
from __future__ import annotations

import ctypes
import json
import sys

import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

CONVERSATIONS = {
    "three_turns_with_system": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy? Answer in one word, please."},
    ],
    "no_system_unicode": [
        {"role": "user", "content": "Привіт! Що таке KV-кеш? 🙂"},
        {"role": "assistant", "content": "Кеш ключів і значень."},
        {"role": "user", "content": "Дякую"},
    ],
}


def builtin(template: str, messages: list[dict], add_ass: bool) -> str:
    array = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        array[i].role, array[i].content = role, content
    size = 1 << 16
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(template.encode(), array, len(messages), add_ass, buf, size)
    if n < 0:
        raise RuntimeError(f"llama_chat_apply_template failed: {n}")
    return buf.raw[:n].decode("utf-8")


def main(model_path: str, out_path: str) -> None:
    llm = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    template = llm.metadata["tokenizer.chat_template"]
    bos = llm._model.token_get_text(llm.token_bos())
    eos = llm._model.token_get_text(llm.token_eos())
    result = {"model": model_path.rsplit("/", 1)[-1], "llama_cpp_python": llama_cpp.__version__,
              "bos_token": bos, "eos_token": eos, "template": template, "cases": []}
    for name, messages in CONVERSATIONS.items():
        for add_gen in (True, False):
            formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos,
                                            add_generation_prompt=add_gen)
            jinja_text = formatter(messages=messages).prompt
            result["cases"].append({"name": name, "messages": messages, "add_generation_prompt": add_gen,
                                    "jinja": jinja_text, "llama_cpp_builtin": builtin(template, messages, add_gen)})
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, ensure_ascii=False, indent=1)
        fh.write("\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
