"""The onnx backend's options on a real model: ``profile`` writes ONNX Runtime's per-node trace of the decode
session, the ``dump`` graph is what ORT made of a split, and a misspelt or ill-typed option is a ConfigError."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import llmfw
from llmfw.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_profile_and_dump_write_the_trace_and_the_optimised_graph(smollm2_path, tmp_path):
    options = {"profile": str(tmp_path / "trace"), "dump": str(tmp_path / "graph"), "cache_dir": str(tmp_path),
               "fused_attention": True}
    model = llmfw.load_model(smollm2_path, backend="onnx", backend_options={"onnx": options})
    ctx = model.new_context(n_ctx=64)
    for token in (1, 504, 3458):
        assert ctx.decode(llmfw.Batch([token])) == 0
    ctx.close()
    model.close()  # sessions write their trace when released
    traces = list(tmp_path.glob("trace*.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    ops = {e["args"].get("op_name") for e in events if e.get("cat") == "Node" and "args" in e}
    assert len(runs) == 3 and "MatMulNBits" in ops
    (graph,) = tmp_path.glob("graph-*.onnx")
    import onnx

    optimised = onnx.load(str(graph), load_external_data=False)
    op_types = {n.op_type for n in optimised.graph.node}
    op_types |= {inner.op_type for n in optimised.graph.node for a in n.attribute if a.HasField("g") for inner in a.g.node}
    # residual + rms_norm in one kernel, attention as ORT's fused kernel (one sequence in cell order)
    assert {"SkipSimplifiedLayerNormalization", "GroupQueryAttention", "MatMulNBits"} <= op_types


def test_profile_benchmark_prints_the_op_table():
    import subprocess

    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "onnx_profile.py"), "--tg", "4"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| MatMulNBits |" in result.stdout and "4 session runs" in result.stdout


@pytest.mark.parametrize("options,message", [
    ({"profil": "x"}, r"profil: unknown option, did you mean 'profile'"),
    ({"cache": "sometimes"}, r"cache"),
    ({"cache_dir": 3}, r"cache_dir"),
])
def test_bad_onnx_options_are_config_errors(smollm2_path, options, message):
    with pytest.raises(ConfigError, match=message):
        llmfw.load_model(smollm2_path, backend="onnx", backend_options={"onnx": options})
