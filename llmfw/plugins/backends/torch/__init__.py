"""The torch backend: the graph IR executed with PyTorch on the CPU or on a CUDA device.

Weights are converted once, at load, into the fastest form for the device that still clears the reference bar
(the ``matmul`` option, ``backend_options={"torch": {"matmul": "fp16" | "int8" | "bf16" | "f32"}}`` — on the CLI
``LLMFW_TORCH_MATMUL`` — overrides it):

* CPU: fp16 matmul weights for fbgemm's fp16 linear (``quantized::linear_dynamic_fp16``: float32 activations
  and accumulation, weights widened inside the kernel). Per-row int8 for fbgemm's dynamic quantized linear
  (``quantized::linear_dynamic``) is faster but falls outside the reference bar (per-row re-quantization of Q4_1 blocks plus one activation
  scale per token; docs/backends.md), so it is opt-in. Without fbgemm: float32 (bf16 matmuls have no fast path on AVX2 CPUs).
* CUDA: bf16 weights; activations are cast to bf16 for the matmul and back to float32 after it (unverified: no
  GPU was available when this was written).

Everything else (norms, rope, attention, activations) runs in float32. The backend receives the graph the core
passes optimised (``llmfw.core.ir.passes``) and maps its ops to kernels: ``fuse_weights`` builds the fused weights
the core's matmul fusion asks for at load, a folded ``rms_norm(x, w)`` is one ``F.rms_norm`` call, and a split
is compiled once per graph build into closures over a value table (``compiler``), freeing each value after its
last reader as the core's liveness says. Rope angles and the grouped attention mask are computed once per run
and shared by every layer. The KV cache is a static preallocated tensor per layer, written in place with
``index_copy_``. torch is imported only by this package, and only when the backend is used.

Modules: ``environment`` (importing torch, devices), ``weights`` (the weight forms), ``kernels`` (ops that are
more than one torch call), ``compiler`` (a split -> closures over a value table), ``runtime`` (the Backend class).
"""
from llmfw.plugins.backends.torch.runtime import TorchBackend, TorchOptions

__all__ = ["TorchBackend", "TorchOptions"]
