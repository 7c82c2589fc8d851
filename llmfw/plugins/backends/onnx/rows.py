"""Whether ONNX Runtime's one-row block product rounds a row as its many-row kernel does, on this CPU.

MLAS picks a ``MatMulNBits`` kernel by the row count. Its many-row kernel gives a row the same bits whatever the
row count, the row's place and the thread split; its one-row kernel (a one-token decode step, a prompt's last
row into the output head) does too on some CPUs (AVX-512) and not on others (AVX2 without AVX-512: another
activation rounding and summation order). Where they differ, a one-token step gets other logits than the same
token in a speculative verify batch or beside other sequences, so the backend appends a row to each block
product's input (see ``SplitTranslator._matmul_nbits``) — which costs decode time, so only where it matters.
"""
from __future__ import annotations

from typing import Any

import numpy as np

#: the probe's product: small, with as many 32-element blocks as a kernel needs to show its summation order
PROBE_K, PROBE_N, PROBE_ROWS = 256, 64, 3


def one_row_product_differs(ort: Any, onnx: Any, accuracy_level: int, providers: list[str]) -> bool:
    """True when a row multiplied alone gets other bits than the same row among others, for 4- and 8-bit
    blocks at ``accuracy_level`` (a few milliseconds: two tiny sessions, one run each per row count)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((PROBE_ROWS, PROBE_K)).astype(np.float32)
    for bits in (4, 8):
        session = block_product_session(ort, onnx, bits, accuracy_level, providers, rng)
        alone = session.run(None, {"x": x[:1]})[0]
        among = session.run(None, {"x": x})[0]
        if not np.array_equal(alone[0], among[0]):
            return True
    return False


def block_product_session(ort: Any, onnx: Any, bits: int, accuracy_level: int, providers: list[str],
                           rng: np.random.Generator) -> Any:
    helper, tensor = onnx.helper, onnx.TensorProto
    n_blocks = PROBE_K // 32
    codes = rng.integers(0, 256, (PROBE_N, n_blocks, 32 * bits // 8), dtype=np.uint8)
    scales = (rng.random(PROBE_N * n_blocks) * 0.05 + 0.01).astype(np.float32)
    node = helper.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=PROBE_K, N=PROBE_N,
                            bits=bits, block_size=32, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "one_row_probe",
                              [helper.make_tensor_value_info("x", tensor.FLOAT, [None, PROBE_K])],
                              [helper.make_tensor_value_info("y", tensor.FLOAT, [None, PROBE_N])],
                              [onnx.numpy_helper.from_array(codes, "b"), onnx.numpy_helper.from_array(scales, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=providers)
