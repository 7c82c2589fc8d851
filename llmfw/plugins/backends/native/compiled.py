"""A compiled split of the native backend: copies inputs into the arena of the program compiler.py made, runs it
with one C call and hands back its outputs, each written into a new array."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from llmfw.core.exec.backend import Split
from llmfw.core.exec.compiler import check_inputs
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import DYNAMIC
import llmfw.plugins.backends.native.program as pg
from llmfw.plugins.backends.native.compiler import NativeCompiler, ProgramHost
from llmfw.plugins.backends.native.values import OutputSlot
from llmfw.plugins.backends.numpy.kernels import NumpyKV


class CompiledProgram:
    """A compiled split: copy the inputs into the arena, one C call, the outputs in new arrays. A split whose inputs
    the graph left DYNAMIC (the K-shift) compiles per input shape, at its first run with that shape.

    Each output has a buffer of its own, pointed at a new array before every run (``Program.rebind``): the op that
    computes it writes it there, and the array is the caller's to keep. So the context keeps a step's logits as they
    are, with no copy out of the arena (a pass over megabytes a step for a large vocabulary), and nothing a later run
    writes can change an array handed out before (``Backend.fresh_outputs``)."""

    def __init__(self, backend: ProgramHost, split: Split, kv: Mapping[tuple[str, int], NumpyKV]):
        self.backend, self.split, self.kv = backend, split, kv
        compiler = NativeCompiler(backend, split, kv)
        self.required = compiler.required_inputs()
        nodes = {i.id: i for n in split.nodes for i in (n, *n.inputs)}
        self.dynamic = [i for i, _ in self.required if nodes[i].shape is None or DYNAMIC in (nodes[i].shape or ())]
        self.programs: dict[tuple[Any, ...], tuple[pg.Program, list[tuple[int, np.ndarray]],
                                                   list[tuple[int, OutputSlot]]]] = {}
        if not self.dynamic:
            self.programs[()] = compiler.compile_program()
        else:  # the ops must still be known now: decline at compile time, not at the first run
            for node in split.nodes:
                if node.op not in ("input", "weight"):
                    compiler.op_handler(node)

    def __call__(self, inputs: Mapping[int, Any]) -> dict[int, Any]:
        check_inputs(self.required, inputs)
        key = tuple(np.shape(inputs[i]) for i in self.dynamic)
        compiled = self.programs.get(key)
        if compiled is None:
            shapes = {i: tuple(np.shape(inputs[i])) for i in self.dynamic}
            compiled = self.programs[key] = NativeCompiler(self.backend, self.split, self.kv, shapes).compile_program()
        program, input_views, output_slots = compiled
        for node_id, view in input_views:
            value = np.asarray(inputs[node_id])
            if value.shape != view.shape:
                raise ModelError(f"native backend: input %{node_id} has shape {value.shape}, its program "
                                 f"{view.shape}")
            np.copyto(view, value, casting="unsafe")
        outputs = {node_id: fresh_output(program, slot) for node_id, slot in output_slots}
        program.run(self.backend.pool, self.backend.isa, self.backend.native_options.profile)
        return outputs


def fresh_output(program: pg.Program, slot: OutputSlot) -> np.ndarray:
    """A new array for an output of the program's next run: its buffer pointed at it (the run writes it in place)."""
    memory = pg.output_array(slot.words)
    program.rebind(slot.buf, memory)
    return memory[:slot.words].view(pg.NP_DTYPES[slot.dtype]).reshape(slot.shape)
