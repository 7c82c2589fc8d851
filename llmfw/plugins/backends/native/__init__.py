"""The native backend: llmfw's own compiled CPU kernels (C11 with compiler intrinsics, csrc/), built by the
project's setup.py as an optional extension. One build runs on every x86-64 CPU: each kernel is compiled as
portable C, for AVX2+FMA+F16C and for AVX-512 (F/BW/VL + VNNI, with the AMX tile unit's dot products for prompt-sized
matmuls where it runs: ``amx``), and the path is chosen at load from what the CPU reports (``backend_options: {native: {isa: auto|scalar|avx2|avx512|amx}}`` forces one); other architectures build the
scalar path. Without the built extension the backend reports itself unavailable with the reason.

Matmuls: weights stay in their own bits (repack.py: exact ``scale * code + offset`` per 16/32 elements, rows
interleaved in groups of 8), activations are quantized once per matmul to 8-bit blocks of 32 with their code sums,
dot products are integer (vpmaddubsw/vpmaddwd on AVX2, vpdpbusd with VNNI). Every ISA path does the same float
operations in the same order (csrc/native.h), so a row's result is the same bits whatever the batch, its place in
it, the thread count or the ISA.

Every other op of the dense architectures runs in C too: a split compiles once into a flat program (op codes,
shapes and offsets into one arena; program.py checks every offset and shape) that one C call runs with the GIL
released, on a pool whose threads claim chunks of each op and sleep between ops (csrc/pool.c).

Modules: ``kernels`` (ctypes bridge, ISA choice, thread pool), ``repack`` (GGUF blocks → the kernels' layout),
``program`` (instruction records, arena, the checker), ``runtime`` (the split compiler and the Backend class).
"""
from llmfw.plugins.backends.native.runtime import NativeBackend, NativeOptions

__all__ = ["NativeBackend", "NativeOptions"]
