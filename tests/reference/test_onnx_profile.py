"""benchmarks/onnx_profile.py on a real model: the pp profile splits the matmuls by shape and states the ceiling."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import onnx_profile  # noqa: E402


def test_pp_profile_splits_matmuls_by_shape_and_prints_the_matmul_ceiling(smollm2_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["onnx_profile.py", "-m", str(smollm2_path), "--pp", "24", "--threads", "1"])
    onnx_profile.main()
    out = capsys.readouterr().out
    assert re.search(r"pp24 [\d.]+ t/s", out), out
    # one row per projection shape: 24 prompt rows times SmolLM2's 576-wide hidden state, plus the padding row on a
    # CPU whose one-row ORT products differ (row_padding auto, docs/backends.md): 25 on AVX2 without AVX-512
    rows = re.findall(r"^\| MatMulNBits \[2[45], 576\] x \[(\d+), \d+\] \| ([\d.]+) \|", out, re.M)
    assert rows, out
    assert all(float(ms) > 0 for _, ms in rows)
    ceiling = re.search(r"MatMulNBits alone: (\d+)% of the kernel time; .* run ([\d.]+)x as fast", out)
    assert ceiling, out
    share, speedup = int(ceiling.group(1)), float(ceiling.group(2))
    assert 0 < share <= 100 and abs(speedup - 100 / share) < 0.1 * speedup


def test_tg_profile_keeps_one_row_per_op_type(smollm2_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["onnx_profile.py", "-m", str(smollm2_path), "--tg", "4", "--threads", "1"])
    onnx_profile.main()
    out = capsys.readouterr().out
    assert re.search(r"tg4 [\d.]+ t/s", out), out
    assert re.search(r"^\| MatMulNBits \| [\d.]+ \|", out, re.M), out
    assert "MatMulNBits [" not in out
