"""What a benchmark records of its machine (llmfw/commands/machine.py): the GPUs the NVIDIA driver lists."""
from __future__ import annotations

from pathlib import Path

from llmfw.commands.machine import _gpus, describe_machine

# the first lines of /proc/driver/nvidia/gpus/<bus id>/information, as the driver writes them
INFORMATION = """Model: \t\t NVIDIA H200
IRQ:   \t\t 77
GPU UUID: \t GPU-3fb67997-837c-6e6b-c5a2-9f48c7f631f5
Video BIOS: \t 96.00.af.00.01
Bus Type: \t PCIe
"""


def test_each_gpu_the_driver_lists_is_named_once(tmp_path: Path) -> None:
    for bus, model in (("0000:1b:00.0", "NVIDIA H200"), ("0000:43:00.0", "NVIDIA H100 80GB HBM3")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(INFORMATION.replace("NVIDIA H200", model))
    (tmp_path / "0000:99:00.0").mkdir()  # a folder without its file: skipped
    assert _gpus(tmp_path) == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]


def test_no_driver_means_no_gpus(tmp_path: Path) -> None:
    assert _gpus(tmp_path / "absent") == []
    assert isinstance(describe_machine()["gpus"], list)
