"""`llmfw inspect` on both real models and on written / broken files, through click's CliRunner."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from llmfw.cli import cli, main
from llmfw.core.errors import CatalogError, GGUFError
from llmfw.core.gguf import GGUFValueType as VT, GGUFWriter


def invoke(*args: str):
    result = CliRunner().invoke(cli, ["inspect", *args])
    return result


def inspect_json(*args: str) -> dict:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_smollm2_json(smollm2_path: Path) -> None:
    s = inspect_json(str(smollm2_path))
    assert (s["gguf_version"], s["architecture"]) == (3, "llama")
    hp = s["hyperparameters"]
    assert hp["block_count"] == 30 and hp["embedding_length"] == 576 and hp["context_length"] == 8192
    assert hp["attention.head_count"] == 9 and hp["attention.head_count_kv"] == 3
    assert hp["feed_forward_length"] == 1536 and hp["rope.freq_base"] == 100000.0
    assert hp["attention.layer_norm_rms_epsilon"] == 1e-05
    tok = s["tokenizer"]
    assert (tok["model"], tok["pre"], tok["vocab_size"], tok["merges"]) == ("gpt2", "smollm", 49152, 48900)
    assert tok["chat_template"] is True
    assert s["file_type"] == "Q4_1"
    assert s["general_file_type"] == {"id": 3, "name": "Q4_1"}
    assert s["tensor_count"] == 272
    assert s["parameters"] == 134_515_008
    assert s["tensor_bytes"] == sum(t["bytes"] for t in s["types"].values())
    assert s["bits_per_weight"] == pytest.approx(8 * s["tensor_bytes"] / s["parameters"], abs=1e-4)
    assert s["types"]["Q8_0"]["tensors"] == 1 and s["types"]["Q4_1"]["tensors"] == 210
    assert "tensors" not in s


def test_gemma3_json_with_tensors(gemma3_path: Path) -> None:
    s = inspect_json("gemma-3-270m", "--tensors")  # a catalog name works too
    assert s["path"] == str(gemma3_path)
    assert s["architecture"] == "gemma3"
    hp = s["hyperparameters"]
    assert hp["attention.sliding_window"] == 512 and hp["attention.key_length"] == 256
    assert hp["block_count"] == 18 and hp["attention.head_count_kv"] == 1 and hp["rope.freq_base"] == 1e6
    assert (s["tokenizer"]["model"], s["tokenizer"]["pre"], s["tokenizer"]["vocab_size"]) == ("llama", "default",
                                                                                              262144)
    assert s["tokenizer"]["merges"] is None
    assert s["general_file_type"]["name"] == "Q4_K - Medium"
    # by element count among matrices the 262144 x 640 Q8_0 embedding dominates
    assert s["file_type"] == "Q8_0"
    assert len(s["tensors"]) == s["tensor_count"] == 236
    emb = next(t for t in s["tensors"] if t["name"] == "token_embd.weight")
    assert (emb["type"], emb["shape"], emb["bytes"]) == ("Q8_0", [640, 262144], 640 * 262144 // 32 * 34)
    assert set(s["types"]) == {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}


def test_text_output(smollm2_path: Path) -> None:
    result = invoke(str(smollm2_path), "--tensors")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "GGUF version:    3" in out and "architecture:    llama" in out
    assert "attention.head_count_kv" in out and "gpt2 (pre smollm), 49152 tokens, 48900 merges" in out
    assert "file type:       Q4_1" in out and "bits per weight" in out
    assert "token_embd.weight" in out and "[576, 49152]" in out
    assert out.count("blk.") == 270  # 30 layers x 9 tensors, one table row each


@pytest.mark.fast
def test_written_model_and_split(tmp_path: Path) -> None:
    writer = GGUFWriter(tmp_path / "tiny.gguf", n_splits=2)
    writer.add("general.architecture", "tiny")
    writer.add("tiny.block_count", 1, VT.UINT32)
    writer.add("tiny.layer_sizes", np.arange(100, dtype=np.int32))  # long arrays are summarized
    writer.add("tokenizer.ggml.tokens", ["a", "b", "c"])
    writer.add_tensor("w1", np.zeros((4, 8), np.float32))
    writer.add_tensor("w2", np.zeros((2, 8), np.float16))
    writer.write()
    s = inspect_json(str(writer.written_paths[0]), "--tensors")
    assert s["files"] == [str(p) for p in writer.written_paths]
    assert s["hyperparameters"] == {"block_count": 1, "layer_sizes": "<100 x INT32>"}
    assert s["tokenizer"]["vocab_size"] == 3 and s["tokenizer"]["model"] is None
    assert s["file_type"] == "F32" and s["parameters"] == 48 and s["tensor_bytes"] == 4 * 32 + 2 * 16
    assert [t["file"] for t in s["tensors"]] == [0, 1]


@pytest.mark.fast
def test_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(40))
    result = invoke(str(bad))
    assert result.exit_code != 0 and isinstance(result.exception, GGUFError)
    assert isinstance(invoke(str(tmp_path / "missing.gguf")).exception, CatalogError)
    with pytest.raises(SystemExit) as exit_info:  # the console entry point turns errors into one line
        main(["inspect", str(bad)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("llmfw: error:") and "magic b'NOPE'" in err and "Traceback" not in err


def test_names_the_memory_module(tmp_path: Path, smollm2_path: Path) -> None:
    """Issue 34: the memory module the architecture's plugin needs, for a hybrid family and a KV-cache one."""
    from reference_gen.arch_files import build_model_file

    lfm2 = build_model_file("lfm2", tmp_path)
    assert inspect_json(str(lfm2))["memory"] == "hybrid"
    assert "memory:          hybrid" in invoke(str(lfm2)).output
    assert inspect_json(str(smollm2_path))["memory"] == "kv_cache"
    qwen35moe = inspect_json(str(build_model_file("qwen35moe", tmp_path)))
    assert qwen35moe["memory"] == "hybrid" and qwen35moe["experts"]["count"] == 8
    assert inspect_json(str(build_model_file("nemotron_h", tmp_path)))["memory"] == "hybrid"
    assert inspect_json(str(build_model_file("gemma4", tmp_path)))["memory"] == "kv_cache_iswa"
