"""benchmarks/onnx_matmul_limits.py (docs/backends.md's case for what closes the onnx backend's gaps): its four forms of
an affine 4-bit matrix compute what they claim, and its probe of ORT's saved packed weights finds the block sums."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import onnx_matmul_limits as limits

#: int8 activations (accuracy level 4) leave about 1% of the product's scale
INT8_ERROR = 0.03


def test_exact_forms_match_the_float_product_and_the_symmetric_bound_does_not():
    blocks = limits.affine_blocks(48, 96)
    forms = limits.time_forms(blocks, rows=[1, 5], reps=1)
    assert forms["offsets"]["max_err"] < INT8_ERROR  # the backend's form (translate.py) is exact
    assert forms["float_zp"]["max_err"] < INT8_ERROR
    assert forms["uint8_zp"]["max_err"] < INT8_ERROR  # against its own rounded minimums
    # the same codes read as symmetric blocks are another matrix: the bound is not a form to ship
    symmetric_vs_q41 = np.abs(limits.dense(blocks, -8 * blocks["scales"]) - limits.dense(blocks)).max()
    assert symmetric_vs_q41 > 0.01
    assert all(value > 0 for row in forms.values() for key, value in row.items() if key.startswith("us_"))


def test_packed_form_is_at_least_the_codes_and_the_probe_finds_every_block_sum(tmp_path):
    blocks = limits.affine_blocks(32, 64)
    bytes_per_32, where = limits.packed_bytes_per_block(blocks, tmp_path)
    assert bytes_per_32 >= 16  # 4-bit codes alone take 16 bytes per 32 weights
    assert where["length"] > 0 and (tmp_path / "saved.bin").stat().st_size >= where["offset"] + where["length"]
    probe_folder = tmp_path / "probe"
    probe_folder.mkdir()
    probe = limits.probe_serialized(blocks, probe_folder)
    assert probe["block_sums_found"]
    assert probe["accepted"] == (probe["error"] == "")
    assert probe["reload_s"] > 0 and probe["repack_s"] > 0
