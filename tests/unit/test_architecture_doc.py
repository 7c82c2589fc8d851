"""The "complete minimal architecture" in ``llmfw.core.arch.architecture``'s docstring is what authors copy: it
must be valid Python and walk the layers the way placement needs (``for il in b.layers():``, which makes each
node created in the loop belong to layer ``il``; a ``range()`` leaves them all on the input side)."""
from __future__ import annotations

import ast
import textwrap

from llmfw.core.arch import architecture

MARKER = "Example (a complete minimal architecture)::"


def example_source() -> str:
    doc = architecture.__doc__ or ""
    assert MARKER in doc
    block = doc.split(MARKER, 1)[1]
    lines = []
    for line in block.splitlines()[1:]:
        if line.strip() and not line.startswith("    "):
            break
        lines.append(line)
    return textwrap.dedent("\n".join(lines))


def test_the_example_iterates_the_builders_layers() -> None:
    tree = ast.parse(example_source())
    loops = [node for node in ast.walk(tree) if isinstance(node, ast.For)]
    assert loops, "the example has no loop over the layers"
    for loop in loops:
        call = loop.iter
        assert isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute), ast.unparse(call)
        assert ast.unparse(call.func) == "b.layers", f"the example iterates {ast.unparse(call)}, not b.layers()"


def test_the_example_defines_an_architecture() -> None:
    namespace = dict(vars(architecture))
    exec(compile(example_source(), "<architecture example>", "exec"), namespace)  # our own docstring
    arch_class = namespace["MyArch"]
    assert issubclass(arch_class, architecture.Architecture) and arch_class.name == "myarch"
