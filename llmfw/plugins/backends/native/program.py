"""Flat programs: a split compiled once into instructions (csrc/native.h ``nat_instr``) over buffers, which ONE C
call runs (``nat_program_run``, the GIL released by ctypes).

Buffer 0 is the program's arena: every activation of the split lives at an offset decided at compile time (a
first-fit allocator over the core's liveness, so a prefill holds only the live values). The other buffers are memory
the program reads or writes in place: KV caches, norm weights, biases, constants. Matrices are a table of
``nat_weight`` records. :func:`check_program` verifies every operand's extent against its buffer, every weight index
and every shape relation before C may touch memory: a program that fails is refused with a :class:`ProgramError`,
never run. What only the data decides (token ids, KV cells) the C code checks as it runs."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from math import prod
from functools import partial
from typing import Callable, Mapping, Sequence

import numpy as np

from llmfw.core.errors import ModelError
import llmfw.plugins.backends.native.kernels as kernels
from llmfw.plugins.backends.native.repack import BLOCK, QUANTIZED_KINDS

N_ARGS, N_INTS, N_FLOATS = 7, 16, 8
#: one ``nat_instr``
INSTR = np.dtype([("op", "<i8"), ("buf", "<i8", (N_ARGS,)), ("off", "<i8", (N_ARGS,)), ("n", "<i8", (N_INTS,)),
                  ("f", "<f4", (N_FLOATS,))])
assert INSTR.itemsize == kernels.INSTR_BYTES
# enum nat_op
BINARY, UNARY, SWIGLU, RMS_NORM, NORM, SOFTMAX, GET_ROWS, GET_ROWS_W, MUL_MAT, SLICE, ROPE, KV_WRITE, ATTEND = range(1, 14)
# the recurrent ops (csrc/recurrent.c)
SSM_CONV, CONV_WINDOW, SSM_SCAN, GATED_DELTA = range(14, 18)
#: the angles of a step's rotations, once for all of its ropes (csrc/ops.c)
ROPE_ANGLES = 26
OP_NAMES = {BINARY: "binary", UNARY: "unary", SWIGLU: "swiglu", RMS_NORM: "rms_norm", NORM: "norm",
            SOFTMAX: "softmax", GET_ROWS: "get_rows", GET_ROWS_W: "get_rows", MUL_MAT: "mul_mat", SLICE: "slice",
            ROPE: "rope", ROPE_ANGLES: "rope", KV_WRITE: "kv_write", ATTEND: "attention", SSM_CONV: "ssm_conv",
            CONV_WINDOW: "conv_window", SSM_SCAN: "ssm_scan", GATED_DELTA: "gated_delta"}
# the mixture-of-experts ops (csrc/moe.c)
MUL_MAT_ID, ADD_ID, TOP_K, TAKE, SUM_ROWS, ID_MASK, SWIGLU_OAI, CONCAT = range(18, 26)
MOE_OP_NAMES = {MUL_MAT_ID: "mul_mat_id", ADD_ID: "add_id", TOP_K: "top_k", TAKE: "take", SUM_ROWS: "sum_rows",
                ID_MASK: "id_mask", SWIGLU_OAI: "swiglu_oai", CONCAT: "concat"}
BINARY_KINDS = {"add": 0, "sub": 1, "mul": 2, "div": 3}
UNARY_KINDS = {"silu": 0, "gelu": 1, "relu": 2, "sigmoid": 3, "softplus": 4, "scale": 5, "softcap": 6, "clamp": 7}
#: a value's element type → its numpy type
NP_DTYPES = {"f32": np.float32, "i32": np.int32, "i64": np.int64}
#: words (4 bytes) every arena value is aligned to: a cache line
ALIGN = 16
#: the rotated dimensions the C rope keeps on its stack
MAX_ROPE_DIMS = 1024
#: activation rows of a tile copy, and its bytes a block (native.h ``NAT_TILE_ROWS``, ``NAT_TILE_BYTES``)
TILE_ROWS, TILE_BYTES = 4, 192
STATUS = {-1: "out of memory", -2: "an instruction it does not know", -3: "an id outside its table (a token id, "
          "KV cell or expert id out of range)"}


class ProgramError(ModelError):
    """A program that does not fit its buffers (refused before C runs it), or a run that failed."""


def activation_words(m: int, n_cols: int) -> int:
    """Words of a quantized matmul's activation buffers (native.h ``nat_act_words``): codes, scales, code sums, float
    sums, then the whole four-row tiles' copy of them."""
    nb = n_cols // BLOCK
    return (m * n_cols + 3) // 4 + m * nb + m * nb * 2 + m * nb + m // TILE_ROWS * nb * TILE_BYTES // 4


def moe_scratch_words(n_expert: int, n_slots: int, x_rows: int, info: "WeightInfo") -> int:
    """Words of a ``mul_mat_id``'s scratch (csrc/moe.c ``mul_mat_id``): the expert starts and the active experts
    (int64), the slots in expert order (int64), the activations of the x rows and of the sorted rows (quantized
    kinds) or the sorted x rows (float kinds), the sorted results."""
    k = info.n_cols
    rows = activation_words(x_rows, k) + activation_words(n_slots, k) if info.kind in QUANTIZED_KINDS \
        else n_slots * k
    return 2 * (2 * n_expert + 1 + n_slots) + rows + n_slots * info.n_rows


@dataclass(frozen=True)
class Operand:
    buf: int
    off: int


NONE = Operand(-1, 0)


@dataclass
class Instr:
    op: int
    args: list[Operand]
    n: list[int] = field(default_factory=list)
    f: list[float] = field(default_factory=list)
    #: the graph op it comes from (profiles)
    label: str = ""


class Arena:
    """First-fit allocation of word ranges, freed ranges coalesced; ``size`` is the high-water mark."""

    def __init__(self) -> None:
        self.free: list[tuple[int, int]] = []  # (start, words), sorted by start
        self.size = 0

    def alloc(self, words: int) -> int:
        words = max(ALIGN, -(-words // ALIGN) * ALIGN)
        for index, (start, length) in enumerate(self.free):
            if length >= words:
                if length == words:
                    del self.free[index]
                else:
                    self.free[index] = (start + words, length - words)
                return start
        start = self.size
        if self.free and self.free[-1][0] + self.free[-1][1] == self.size:  # grow the free tail
            start = self.free.pop()[0]
        self.size = start + words
        return start

    def release(self, start: int, words: int) -> None:
        words = max(ALIGN, -(-words // ALIGN) * ALIGN)
        self.free.append((start, words))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for begin, length in self.free:
            if merged and merged[-1][0] + merged[-1][1] == begin:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((begin, length))
        self.free = merged


@dataclass(frozen=True)
class WeightInfo:
    """What the checker needs of a ``nat_weight``."""

    kind: int
    n_rows: int
    n_cols: int


def check_program(instrs: np.ndarray, buffer_words: Sequence[int], writable: Sequence[bool],
                  weights: Sequence[WeightInfo]) -> None:
    """Refuse (ProgramError) a program any of whose instructions would reach outside a buffer, write a read-only
    buffer, name a weight that is not there, or whose shapes do not fit each other."""
    if instrs.dtype != INSTR:
        raise ProgramError("native program: instructions of the wrong record type")
    for index, ins in enumerate(instrs):
        try:
            _check_instruction(ins, buffer_words, writable, weights)
        except ProgramError as exc:
            name = OP_NAMES.get(int(ins["op"])) or MOE_OP_NAMES.get(int(ins["op"]), "?")
            raise ProgramError(f"native program: instruction {index} ({name}): "
                               f"{exc}") from None


def _check_instruction(ins: np.void, buffer_words: Sequence[int], writable: Sequence[bool],
                       weights: Sequence[WeightInfo]) -> None:
    op, n, buf, off = int(ins["op"]), [int(v) for v in ins["n"]], ins["buf"], ins["off"]
    if not all(np.isfinite(ins["f"])) and op not in (UNARY, BINARY):
        raise ProgramError("a non-finite float attribute")

    def need(i: int, words: int, optional: bool = False, out: bool = False) -> None:
        b, o = int(buf[i]), int(off[i])
        if b == -1 and optional:
            return
        if not 0 <= b < len(buffer_words):
            raise ProgramError(f"operand {i} names buffer {b} of {len(buffer_words)}")
        if words < 0 or o < 0 or o + words > buffer_words[b]:
            raise ProgramError(f"operand {i} spans words {o}..{o + words} of a buffer of {buffer_words[b]}")
        if out and not writable[b]:
            raise ProgramError(f"operand {i} writes read-only buffer {b}")

    def positive(*values: int) -> None:
        """Counts (0 allowed: a batch with no output rows) within what an allocation could hold."""
        if any(v < 0 or v > 1 << 40 for v in values):
            raise ProgramError(f"sizes {values} out of range")

    def span(count: int, *strided: tuple[int, int]) -> int:
        """Words from the first element to one past the last of ``count`` rows of (extent, stride) steps."""
        if count == 0 or any(extent == 0 for extent, _ in strided):
            return 0
        return 1 + sum((extent - 1) * stride for extent, stride in strided)

    def strided_rows(count: int, width: int, stride: int) -> int:
        """The rows of ``width`` words, ``stride`` apart, that ``count`` words fill (whole rows, not overlapping)."""
        if count == 0:
            return 0
        if width < 1 or count % width or stride < width:
            raise ProgramError(f"{count} words in rows of {width}, {stride} words apart")
        return count // width

    def cache_words(values: int, f16: int) -> int:
        """Words of ``values`` cache values: float32, or f16 (``f16`` 1) two to a word."""
        if f16 not in (0, 1):
            raise ProgramError(f"a cache flag {f16} (0: float32, 1: f16)")
        return (values + 1) // 2 if f16 else values

    def weight(index: int) -> WeightInfo:
        if not 0 <= index < len(weights):
            raise ProgramError(f"weight {index} of {len(weights)}")
        return weights[index]

    if op == BINARY:
        dims, sa, sb = n[1:5], n[5:9], n[9:13]
        positive(*dims)
        if not 0 <= n[0] <= 3 or min(sa + sb) < 0:
            raise ProgramError("a bad kind or a negative stride")
        need(0, prod(dims), out=True)
        need(1, span(prod(dims), *zip(dims, sa)))
        need(2, span(prod(dims), *zip(dims, sb)))
    elif op == UNARY:
        count, width, stride = n[1:4]
        if count < 0 or not 0 <= n[0] < len(UNARY_KINDS):
            raise ProgramError("a bad kind or count")
        rows = strided_rows(count, width, stride)
        need(0, count, out=True)
        need(1, span(rows, (rows, stride), (width, 1)))
    elif op == SWIGLU:
        rows, width, gate_stride, up_stride = n[0:4]
        positive(rows, width)
        if min(gate_stride, up_stride) < width:
            raise ProgramError(f"rows of {width} words {gate_stride} and {up_stride} words apart")
        need(0, rows * width, out=True)
        need(1, span(rows, (rows, gate_stride), (width, 1)))
        need(2, span(rows, (rows, up_stride), (width, 1)))
    elif op in (RMS_NORM, NORM, SOFTMAX):
        rows, width, group, group_stride = n[0:4]
        positive(rows, width)
        if rows and (group < 1 or rows % group):
            raise ProgramError(f"{rows} rows in groups of {group}")
        groups = strided_rows(rows * width, group * width, group_stride)
        need(0, rows * width, out=True)
        need(1, span(groups, (groups, group_stride), (group * width, 1)))
        if op != SOFTMAX:
            need(2, n[1], optional=True)
    elif op == GET_ROWS:
        positive(n[0], n[1], n[2])
        if n[3] not in (4, 8):
            raise ProgramError("ids of 4 or 8 bytes")
        need(0, n[0] * n[1], out=True)
        need(1, n[2] * n[1])
        need(2, n[0] * n[3] // 4)
    elif op == GET_ROWS_W:
        positive(n[0])
        w = weight(n[1])
        if n[3] not in (4, 8):
            raise ProgramError("ids of 4 or 8 bytes")
        need(0, n[0] * w.n_cols, out=True)
        need(1, n[0] * n[3] // 4)
    elif op == MUL_MAT:
        w = weight(n[0])
        positive(n[1])
        need(0, n[1] * w.n_rows, out=True)
        need(1, n[1] * w.n_cols)
        need(3, n[1] * w.n_rows, optional=True)  # a residual added to the product
        if w.kind in QUANTIZED_KINDS:
            if w.n_cols % BLOCK:
                raise ProgramError(f"{w.n_cols} columns are not whole blocks")
            need(2, activation_words(n[1], w.n_cols), out=True)
    elif op == SLICE:
        positive(n[0], n[1])
        if n[2] < 0 or n[3] < 0 or n[2] + n[3] > n[1]:
            raise ProgramError(f"slice {n[2]}+{n[3]} of rows of {n[1]}")
        need(0, n[0] * n[3], out=True)
        need(1, span(n[0], (n[0], n[1]), (n[2] + n[3], 1)))
    elif op == ROPE:
        n_tokens, n_head, dim, n_dims = n[0:4]
        positive(n_tokens, n_head, dim, n_dims)
        if n_head < 1 or n_dims < 2 or n_dims % 2 or n_dims > dim or n_dims > MAX_ROPE_DIMS or min(n[5:9]) < 0:
            raise ProgramError(f"rotating {n_dims} of {dim} dimensions")
        if n[9] and (buf[0] != buf[1] or off[0] != off[1] or n[5:7] != n[7:9]):
            raise ProgramError("an f16 rope that is not in place (only a K shift rotates f16 keys)")
        need(0, cache_words(span(n_tokens, (n_tokens, n[7]), (n_head, n[8]), (dim, 1)), n[9]), out=True)
        need(1, cache_words(span(n_tokens, (n_tokens, n[5]), (n_head, n[6]), (dim, 1)), n[9]))
        need(2, n_tokens)
        need(3, n_dims // 2, optional=True)
        need(4, n_dims // 2, optional=True)
        need(5, n_tokens * n_dims, optional=True)
    elif op == ROPE_ANGLES:
        n_tokens, n_dims = n[0], n[3]
        positive(n_tokens)
        if n_dims < 2 or n_dims % 2 or n_dims > MAX_ROPE_DIMS:
            raise ProgramError(f"angles of {n_dims} rotated dimensions")
        need(0, n_tokens * n_dims, out=True)
        need(2, n_tokens)
        need(3, n_dims // 2, optional=True)
        need(4, n_dims // 2, optional=True)
    elif op == KV_WRITE:
        n_tokens, n_head_kv, dk, dv, n_cells = n[0:5]
        positive(n_tokens, n_head_kv, dk, dv, n_cells)
        need(0, cache_words(n_head_kv * n_cells * dk, n[7]), out=True)
        need(1, cache_words(n_head_kv * n_cells * dv, n[7]), out=True)
        k_stride, v_stride = n[5:7]
        if k_stride < n_head_kv * dk or v_stride < n_head_kv * dv:
            raise ProgramError(f"tokens' k and v {k_stride} and {v_stride} words apart")
        need(2, span(n_tokens, (n_tokens, k_stride), (n_head_kv * dk, 1)))
        need(3, span(n_tokens, (n_tokens, v_stride), (n_head_kv * dv, 1)))
        need(4, 2 * n_tokens)
    elif op == ATTEND:
        n_tokens, n_head, n_head_kv, dk, dv, n_kv, n_cells = n[0:7]
        positive(n_tokens, n_head, n_head_kv, dk, dv, n_kv, n_cells)
        if n_head_kv < 1 or n_head % n_head_kv or n_kv > n_cells:
            raise ProgramError(f"{n_head} heads over {n_head_kv} KV heads, {n_kv} of {n_cells} cells")
        need(0, n_tokens * n_head * dv, out=True)
        need(1, n_tokens * n_head * dk)
        need(2, cache_words(n_head_kv * n_cells * dk, n[7]))
        need(3, cache_words(n_head_kv * n_cells * dv, n[7]))
        need(4, n_tokens * n_kv)
        need(5, n_head, optional=True)
        need(6, n_kv, optional=True)  # the order's cells: C checks each is below n_kv
    elif op in RECURRENT_CHECKS:
        RECURRENT_CHECKS[op](n[:6], need, positive)
    elif op in MOE_OP_NAMES:
        _check_moe_instruction(op, n, need, positive, weight)
    else:
        raise ProgramError(f"unknown op code {op}")


Need = Callable[..., None]


def _check_conv(n: list[int], need: Need, positive: Callable[..., None], window_out: bool) -> None:
    """ssm_conv / conv_window: S sequences of T tokens of C channels, a carried window of K-1 rows."""
    n_seqs, n_tokens, n_ch, keep = n[:4]
    positive(n_seqs, n_tokens, n_ch, keep)
    need(0, n_seqs * (keep if window_out else n_tokens) * n_ch, out=True)
    need(1, n_seqs * keep * n_ch)
    need(2, n_seqs * n_tokens * n_ch)
    if not window_out:
        need(3, n_ch * (keep + 1))


def scan_operand_words(op: int, n: Sequence[int]) -> list[int]:
    """The words of each operand of a scan (``ssm_scan`` / ``gated_delta``) with n = S, T, H, shared heads (B/C
    groups or q/k heads), rows and columns of a head's state (P, N or Dv, Dk): out, state, then the inputs (the
    last one the packed pair B then C, g then beta)."""
    n_seqs, n_tokens, n_head, n_shared, rows, cols = n[:6]
    tokens = n_seqs * n_tokens
    inputs = ([tokens * n_head * rows, tokens * n_head, n_head, 2 * tokens * n_shared * cols] if op == SSM_SCAN
              else [tokens * n_shared * cols, tokens * n_shared * cols, tokens * n_head * rows, 2 * tokens * n_head])
    return [n_seqs * (n_tokens * n_head * rows + n_head * rows * cols), n_seqs * n_head * rows * cols, *inputs]


def _check_scan(op: int, n: list[int], need: Need, positive: Callable[..., None]) -> None:
    positive(*n)
    if n[3] < 1 or n[2] % n[3]:
        raise ProgramError(f"{n[2]} heads over {n[3]} groups or key heads")
    for index, words in enumerate(scan_operand_words(op, n)):
        need(index, words, out=index == 0)


#: the checks of the recurrent ops: (n[:6], need, positive)
RECURRENT_CHECKS: Mapping[int, Callable[[list[int], Need, Callable[..., None]], None]] = {
    SSM_CONV: partial(_check_conv, window_out=False), CONV_WINDOW: partial(_check_conv, window_out=True),
    SSM_SCAN: partial(_check_scan, SSM_SCAN), GATED_DELTA: partial(_check_scan, GATED_DELTA)}


def _check_moe_instruction(op: int, n: list[int], need: Callable[..., None], positive: Callable[..., None],
                           weight: Callable[[int], WeightInfo]) -> None:
    """The operands of the mixture-of-experts ops (csrc/native.h's enum): ``need(i, words, out=)`` checks operand
    i's extent, ``positive`` the counts, ``weight`` a weight index."""
    if op in (ADD_ID, TAKE, ID_MASK) and n[3] not in (4, 8) or op == MUL_MAT_ID and n[5] not in (4, 8):
        raise ProgramError("ids of 4 or 8 bytes")
    if op == MUL_MAT_ID:
        first, n_expert, n_tokens, n_used, per_slot, id_bytes = n[0:6]
        positive(n_tokens, n_used)
        if not 1 <= n_expert <= 1 << 20 or per_slot not in (0, 1):
            raise ProgramError(f"{n_expert} experts, x per slot {per_slot}")
        info = weight(first)
        if any(weight(first + e) != info for e in range(1, n_expert)):
            raise ProgramError(f"weights {first}..{first + n_expert - 1} are not experts of one shape and kind")
        if info.kind in QUANTIZED_KINDS and info.n_cols % BLOCK:
            raise ProgramError(f"{info.n_cols} columns are not whole blocks")
        n_slots = n_tokens * n_used
        x_rows = n_slots if per_slot else n_tokens
        need(0, n_slots * info.n_rows, out=True)
        need(1, x_rows * info.n_cols)
        need(2, n_slots * id_bytes // 4)
        need(3, moe_scratch_words(n_expert, n_slots, x_rows, info), out=True)
    elif op == ADD_ID:
        rows, width, n_expert, id_bytes = n[0:4]
        positive(rows, width, n_expert)
        need(0, rows * width, out=True)
        need(1, rows * width)
        need(2, n_expert * width)
        need(3, rows * id_bytes // 4)
    elif op in (TOP_K, TAKE, ID_MASK):
        rows, width, k = n[0:3]
        positive(rows, width, k)
        if op == TOP_K and not 0 < k <= width:
            raise ProgramError(f"the {k} best of {width}")
        need(0, rows * (width if op == ID_MASK else k), out=True)
        need(1, rows * width)
        if op != TOP_K:
            need(2, rows * k * n[3] // 4)
    elif op == SUM_ROWS:
        positive(n[0], n[1])
        need(0, n[0], out=True)
        need(1, n[0] * n[1])
    elif op == SWIGLU_OAI:
        positive(n[0])
        for i in range(3):
            need(i, n[0], out=i == 0)
    else:  # CONCAT
        positive(n[0], n[1], n[2])
        need(0, n[0] * (n[1] + n[2]), out=True)
        need(1, n[0] * n[1])
        need(2, n[0] * n[2])


def output_array(words: int) -> np.ndarray:
    """``words`` fresh float32 words starting on a cache line, like the arena's values (the memory of an output)."""
    words = max(words, 1)
    raw = np.empty(words + ALIGN, dtype=np.float32)
    start = (-raw.ctypes.data % (4 * ALIGN)) // 4
    return raw[start:start + words]


class Program:
    """A checked program with its arena and buffers, run by one C call."""

    def __init__(self, instrs: list[Instr], arena_words: int, buffers: list[np.ndarray], writable: list[bool],
                 weights: list[kernels.NatWeight], weight_infos: list[WeightInfo], outputs: Sequence[int] = ()):
        records = np.zeros(len(instrs), dtype=INSTR)
        for record, ins in zip(records, instrs):
            record["op"] = ins.op
            args = ins.args + [NONE] * (N_ARGS - len(ins.args))
            record["buf"] = [a.buf for a in args]
            record["off"] = [a.off for a in args]
            record["n"][:len(ins.n)] = ins.n
            record["f"][:len(ins.f)] = ins.f
        self.labels = [ins.label for ins in instrs]
        self.arena = np.zeros(max(arena_words, 1), dtype=np.float32)
        self.buffers = [self.arena, *buffers]
        for array in self.buffers:
            if not array.flags.c_contiguous or array.itemsize * array.size % 4:
                raise ProgramError("native program: a buffer that is not contiguous 4-byte words")
        writable = [True, *writable]
        words = [int(a.nbytes) // 4 for a in self.buffers]
        check_program(records, words, writable, weight_infos)
        records.flags.writeable = False  # checked: what C runs is what was checked
        self.instrs = records
        self._pointers = (ctypes.c_void_p * len(self.buffers))(*(a.ctypes.data for a in self.buffers))
        self._weights = (kernels.NatWeight * max(len(weights), 1))(*weights)
        self.times = np.zeros(len(instrs), dtype=np.float64)
        #: the buffers of the split's outputs, which rebind may point at other memory of the same size
        self.output_buffers = frozenset(outputs)
        for index in self.output_buffers:
            if not 0 < index < len(self.buffers) or not writable[index]:
                raise ProgramError(f"native program: output buffer {index} is not a writable buffer of the program")

    def rebind(self, index: int, array: np.ndarray) -> None:
        """Point output buffer ``index`` at ``array`` for the next runs: the same number of bytes, so every check
        check_program made of the operands in it still holds. A run then writes the output into ``array``, which the
        caller may keep (a new array each run: no copy out of the arena)."""
        if index not in self.output_buffers:
            raise ProgramError(f"native program: buffer {index} is not an output buffer")
        if array.nbytes != self.buffers[index].nbytes or not array.flags.c_contiguous or not array.flags.writeable:
            raise ProgramError(f"native program: output buffer {index} takes a writable contiguous array of "
                               f"{self.buffers[index].nbytes} bytes, not {array.nbytes}")
        self.buffers[index] = array
        self._pointers[index] = array.ctypes.data

    def view(self, off: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        """The arena's words at ``off`` as an array (int64 values take two words each)."""
        np_dtype = np.dtype(NP_DTYPES[dtype])
        count = prod(shape)
        words = count * np_dtype.itemsize // 4
        return self.arena[off:off + words].view(np_dtype).reshape(shape)

    def run(self, pool: kernels.ThreadPool, isa: str, profile: bool = False) -> None:
        failed = ctypes.c_int64(-1)
        status = kernels.load_library().nat_program_run(
            pool.handle, kernels.ISAS.index(isa), self.instrs.ctypes.data, len(self.instrs), self._pointers,
            self._weights, self.times.ctypes.data if profile else None, ctypes.byref(failed))
        if status != 0:
            label = self.labels[failed.value] if 0 <= failed.value < len(self.labels) else "?"
            raise ProgramError(f"native program failed at instruction {failed.value} ({label}): "
                               f"{STATUS.get(status, f'status {status}')}")
