"""The native repacker against damaged tensor descriptions (benchmarks/fuzz_gguf.py's repack_tensors cases): any type
id, odd / zero / huge dimensions, byte lengths that miss, random bytes with NaN / inf scales. Every case ends
normally (repacked and multiplied on an ISA path) or with a QuantError raised before any C code runs — never
another exception, a crash of the process or a hang."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import fuzz_gguf  # noqa: E402

from llmfw.core.errors import QuantError  # noqa: E402
from llmfw.plugins.backends.native.repack import repack  # noqa: E402

from support.native import kernels_or_skip  # noqa: E402

kernels = kernels_or_skip()


def test_three_hundred_damaged_tensors_are_repacked_or_refused():
    tally = fuzz_gguf.fuzz_repack_tensors(300, random.Random(32), kernels)
    assert tally.failures == 0, tally.crashes
    assert tally.cases == 300 and set(tally.outcomes) == {"ok", "error:QuantError"}, tally.outcomes
    assert tally.outcomes["ok"] >= 20  # valid descriptions among them do reach the kernels


@pytest.mark.parametrize("ggml_type, ne, n_bytes", [
    (99, (32, 1), 18),  # an unknown type id
    (2, (32, 0), 0),  # no rows
    (2, (0, 4), 0),  # no columns
    (2, (48, 1), 27),  # a row that is not whole blocks
    (2, (32, 2), 35),  # one byte short
    (2, (2**32, 2**32), 18),  # a shape whose size overflows 64 bits
    (2, (), 0),  # no dimensions
])
def test_bad_descriptions_are_quant_errors(ggml_type, ne, n_bytes):
    with pytest.raises(QuantError):
        repack(np.zeros(n_bytes, np.uint8), ggml_type, ne)
