"""A compiled split of the native backend: copies inputs into the arena of the program compiler.py made, runs it
with one C call and hands back views of its outputs in the arena."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from llmfw.core.exec.backend import Split
from llmfw.core.exec.compiler import check_inputs
from llmfw.core.errors import ModelError
from llmfw.core.ir.graph import DYNAMIC
import llmfw.plugins.backends.native.program as pg
from llmfw.plugins.backends.native.compiler import NativeCompiler, ProgramHost
from llmfw.plugins.backends.numpy.kernels import NumpyKV


class CompiledProgram:
    """A compiled split: copy the inputs into the arena, one C call, the outputs as views of the arena. A split whose
    inputs the graph left DYNAMIC (the K-shift) compiles per input shape, at its first run with that shape.

    The views hold until this split runs again, at the plan's next compute: the scheduler hands them to the next
    split or, as graph outputs, to the context, which copies a ubatch's logits and states out before it computes the
    next (``Backend.to_numpy``'s "a view the caller will not keep"). A copy here as well was a second pass over every
    step's logits."""

    def __init__(self, backend: ProgramHost, split: Split, kv: Mapping[tuple[str, int], NumpyKV]):
        self.backend, self.split, self.kv = backend, split, kv
        compiler = NativeCompiler(backend, split, kv)
        self.required = compiler.required_inputs()
        nodes = {i.id: i for n in split.nodes for i in (n, *n.inputs)}
        self.dynamic = [i for i, _ in self.required if nodes[i].shape is None or DYNAMIC in (nodes[i].shape or ())]
        self.programs: dict[tuple[Any, ...], tuple[pg.Program, list[tuple[int, np.ndarray]],
                                                   list[tuple[int, np.ndarray]]]] = {}
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
        program, input_views, output_views = compiled
        for node_id, view in input_views:
            value = np.asarray(inputs[node_id])
            if value.shape != view.shape:
                raise ModelError(f"native backend: input %{node_id} has shape {value.shape}, its program "
                                 f"{view.shape}")
            np.copyto(view, value, casting="unsafe")
        program.run(self.backend.pool, self.backend.isa, self.backend.native_options.profile)
        return dict(output_views)
