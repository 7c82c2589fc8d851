"""Large mixture-of-experts GGUF files for memory measurements, written with the ``gguf`` package.

The weights are random *blocks*, not quantized values: every block type is written as random code bytes with
sane f16 scales in the header fields, so a file of any size costs a few seconds and little memory to make
(tensor after tensor, never the whole file at once). The numbers such a model computes are meaningless; what
matters is that its tensors have the names, shapes and block types of a real qwen3moe file (Qwen3-30B-A3B's
layer: 2048 wide, 128 experts of 768, 32 query heads of 128 over 4 KV heads; Q4_K_M's types: Q4_K gate/up
experts, Q6_K down experts, Q8_0 attention), so that loading it does what loading a real one does.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "arch"

#: byte offsets of the f16 header fields (scale / min) of each block type, given sane values
_F16_FIELDS = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,), "Q5_K": (0, 2)}


@dataclass(frozen=True)
class MoeFileShape:
    """The dimensions of a generated qwen3moe file (defaults: Qwen3-30B-A3B's layer)."""

    n_layer: int = 3
    n_embd: int = 2048
    n_head: int = 32
    n_head_kv: int = 4
    head_dim: int = 128
    n_expert: int = 128
    n_expert_used: int = 8
    n_ff_exp: int = 768
    expert_type: str = "Q4_K"
    down_type: str = "Q6_K"
    attn_type: str = "Q8_0"


def _random_blocks(rng: np.random.Generator, qtype: str, n_elements: int) -> np.ndarray:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    blocks = rng.integers(0, 256, size=(n_elements // block, size), dtype=np.uint8)
    scale = np.array([0.002], dtype=np.float16).view(np.uint8)
    for offset in _F16_FIELDS[qtype]:
        blocks[:, offset:offset + 2] = scale
    return blocks.reshape(-1)


def _tensor_plan(shape: MoeFileShape, n_vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, type) of every tensor, in file order."""
    e, q, kv = shape.n_embd, shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    plan = [("token_embd.weight", (n_vocab, e), "Q4_K")]
    for il in range(shape.n_layer):
        p = f"blk.{il}."
        plan += [(p + "attn_norm.weight", (e,), "F32"), (p + "attn_q.weight", (q, e), shape.attn_type),
                 (p + "attn_k.weight", (kv, e), shape.attn_type), (p + "attn_v.weight", (kv, e), shape.attn_type),
                 (p + "attn_output.weight", (e, q), shape.attn_type),
                 (p + "attn_q_norm.weight", (shape.head_dim,), "F32"),
                 (p + "attn_k_norm.weight", (shape.head_dim,), "F32"), (p + "ffn_norm.weight", (e,), "F32"),
                 (p + "ffn_gate_inp.weight", (shape.n_expert, e), "F32"),
                 (p + "ffn_gate_exps.weight", (shape.n_expert, shape.n_ff_exp, e), shape.expert_type),
                 (p + "ffn_up_exps.weight", (shape.n_expert, shape.n_ff_exp, e), shape.expert_type),
                 (p + "ffn_down_exps.weight", (shape.n_expert, e, shape.n_ff_exp), shape.down_type)]
    plan += [("output_norm.weight", (e,), "F32"), ("output.weight", (n_vocab, e), "Q6_K")]
    return plan


def _tensor_data(rng: np.random.Generator, name: str, numpy_shape: tuple[int, ...], qtype: str) -> np.ndarray:
    if qtype != "F32":
        return _random_blocks(rng, qtype, int(np.prod(numpy_shape)))
    if name.endswith("norm.weight"):
        return np.ones(numpy_shape, dtype=np.float32)
    return rng.normal(0.0, 0.05, size=numpy_shape).astype(np.float32)


def write_moe_file(path: Path, shape: MoeFileShape = MoeFileShape(), seed: int = 0) -> Path:
    """A qwen3moe GGUF file of ``shape`` at ``path`` (with SmolLM2's first 8k BPE tokens as its vocabulary)."""
    import gguf

    vocab = json.loads((DATA_DIR / "vocab_bpe_smollm2_8k.json").read_text(encoding="utf-8"))
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_context_length(4096)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(6144)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(shape.n_expert)
    writer.add_expert_used_count(shape.n_expert_used)
    writer.add_expert_feed_forward_length(shape.n_ff_exp)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["token_type"])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(vocab["special_ids"]["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(vocab["special_ids"]["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(False)
    plan = _tensor_plan(shape, len(vocab["tokens"]))
    for name, numpy_shape, qtype in plan:  # the header first; the data tensor after tensor
        ggml_type = gguf.GGMLQuantizationType[qtype]
        block, size = gguf.GGML_QUANT_SIZES[ggml_type]
        n_bytes = int(np.prod(numpy_shape)) // block * size
        writer.add_tensor_info(name, numpy_shape, np.dtype(np.float32), n_bytes, raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, numpy_shape, qtype in plan:
        writer.write_tensor_data(_tensor_data(rng, name, numpy_shape, qtype))
    writer.close()
    return path


def expert_bytes(shape: MoeFileShape) -> int:
    """The bytes of one layer's experts (what a file of ``shape`` spends per layer on them)."""
    import gguf

    def size(qtype: str, n: int) -> int:
        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
        return n // block * nbytes

    n = shape.n_expert * shape.n_ff_exp * shape.n_embd
    return 2 * size(shape.expert_type, n) + size(shape.down_type, n)


#: run in the fresh process: RSS before the load, then the peak over load + context + first decode
_MEASURE = r"""
import json, sys
import llmfw
from llmfw.core.exec.backend import backend_class, backend_options_from_environment
import os
from llmfw.core.exec.backend import default_backend_spec
backend = sys.argv[2] or None  # "": the default backend
backend_class(backend or default_backend_spec()).check_available(None)  # its libraries imported before the base
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
base = rss()
model = llmfw.load_model(sys.argv[1], backend=backend, backend_options=backend_options_from_environment(os.environ))
ctx = model.new_context(n_ctx=256, n_batch=8, n_ubatch=8, n_threads=2)
assert ctx.decode(llmfw.Batch([1, 2, 3])) == 0
after = rss()
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the process that forked this one (a large pytest run)
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"rss_base": base, "rss_after": after, "rss_peak": peak}))
"""


def measure_load(model: Path, backend: str, env: dict[str, str]) -> dict:
    """Load ``model`` on ``backend`` ("default": none named) in a fresh process; its RSS record plus ``added``
    and ``ratio``."""
    named = "" if backend == "default" else backend
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(model), named], env={**os.environ, **env},
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{backend} load failed:\n{out.stderr[-3000:]}")
    record = json.loads(out.stdout.strip().splitlines()[-1])
    size = model.stat().st_size
    record["added"] = record["rss_peak"] - record["rss_base"]
    record["ratio"] = round(record["added"] / size, 3)
    record["after_ratio"] = round((record["rss_after"] - record["rss_base"]) / size, 3)
    return record
