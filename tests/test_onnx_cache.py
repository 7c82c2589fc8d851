"""The onnx backend's converted-weight cache on a real model: restored loads map it and compute the same logits;
a corrupt, truncated or foreign entry is rebuilt from the model file, never trusted and never a crash."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import llmfw  # noqa: E402
from llmfw.plugins.backends.onnx.weights import BlockWeight  # noqa: E402

PROMPT = [1, 504, 3458, 282, 4098, 314, 253, 2734]


@pytest.fixture
def cache_root(tmp_path):
    return tmp_path / "onnx-cache"


def load_and_score(path, root) -> tuple[np.ndarray, dict[str, bool]]:
    """The prompt's logits of one fresh load, and which of the onnx backend's weights were mapped from the cache
    (looked at right after the load: fusing matmuls at the first decode moves weights into fused copies)."""
    options = {"cache": False} if root is None else {"cache_dir": str(root)}
    model = llmfw.load_model(path, backend="onnx", backend_options={"onnx": options})
    try:
        mapped = {name: mapped_from_cache(w) for name, w in model.backends["onnx"].weights.items()}
        ctx = model.new_context(n_ctx=64)
        assert ctx.decode(llmfw.Batch(tokens=PROMPT, logits=True)) == 0, ctx.last_error
        logits = np.array(ctx.get_logits())
        ctx.close()
        return logits, mapped
    finally:
        model.close()


def entry_of(root):
    (entry,) = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return entry


def mapped_from_cache(weight) -> bool:
    array = weight.packed if isinstance(weight, BlockWeight) else weight.array
    while array is not None and not isinstance(array, np.memmap):
        array = array.base
    return array is not None


@pytest.fixture(scope="module")
def fresh_logits(smollm2_path):
    """The logits of a load that converts every weight (no cache at all)."""
    return load_and_score(smollm2_path, None)[0]


def test_second_load_maps_every_weight_and_computes_the_same_logits(smollm2_path, cache_root, fresh_logits):
    first, first_weights = load_and_score(smollm2_path, cache_root)
    assert not any(first_weights.values())  # converted, then written
    index = json.loads((entry_of(cache_root) / "index.json").read_text())
    assert set(index["weights"]) == set(first_weights)
    # a fused weight's parts are stored as its rows, not twice
    fused = next(name for name in index["weights"] if name.startswith("blk.0.attn_q.weight+"))
    start, _, _ = index["weights"][fused]["arrays"]["packed"]
    offset, _, shape = index["weights"]["blk.0.attn_k.weight"]["arrays"]["packed"]
    q_rows = index["weights"]["blk.0.attn_q.weight"]["arrays"]["packed"][2][0]
    assert offset == start + q_rows * shape[1] * shape[2]
    second, second_weights = load_and_score(smollm2_path, cache_root)
    assert all(second_weights.values())
    np.testing.assert_array_equal(first, fresh_logits)
    np.testing.assert_array_equal(second, fresh_logits)


@pytest.mark.parametrize("damage", ["truncated blob", "garbage index", "foreign sha256", "object dtype"])
def test_damaged_entry_is_rebuilt(smollm2_path, cache_root, fresh_logits, damage, caplog):
    load_and_score(smollm2_path, cache_root)
    entry = entry_of(cache_root)
    blob, index_path = entry / "weights.bin", entry / "index.json"
    blob_bytes = blob.stat().st_size
    if damage == "truncated blob":
        with blob.open("r+b") as fh:
            fh.truncate(blob_bytes // 2)
    elif damage == "garbage index":
        index_path.write_bytes(b"\x00{not json")
    else:
        index = json.loads(index_path.read_text())
        if damage == "foreign sha256":
            index["sha256"] = "0" * 64
        else:
            first = next(iter(index["weights"].values()))
            next(iter(first["arrays"].values()))[1] = "|O"
        index_path.write_text(json.dumps(index))
    with caplog.at_level(logging.WARNING, logger="llmfw.plugins.backends.onnx.cache"):
        logits, weights = load_and_score(smollm2_path, cache_root)
    assert "corrupt" in caplog.text
    assert not any(weights.values())  # converted again from the model file
    np.testing.assert_array_equal(logits, fresh_logits)
    assert entry_of(cache_root).joinpath("weights.bin").stat().st_size == blob_bytes  # rewritten whole
    _, restored = load_and_score(smollm2_path, cache_root)
    assert all(restored.values())


def test_entry_of_another_converter_format_is_not_read(smollm2_path, cache_root, monkeypatch):
    """Entries are keyed by the converter's format (and llmfw's version): code that converts differently
    writes its own entry instead of reading an old one, and removes the outdated entry of the same file."""
    from llmfw.plugins.backends.onnx import cache

    load_and_score(smollm2_path, cache_root)
    old = entry_of(cache_root)
    monkeypatch.setattr(cache, "CACHE_FORMAT", cache.CACHE_FORMAT + 1)
    _, weights = load_and_score(smollm2_path, cache_root)
    assert not any(weights.values())
    names = [p.name for p in cache_root.iterdir() if not p.name.startswith(".")]
    assert names == [old.name.replace(f"-f{cache.CACHE_FORMAT - 1}", f"-f{cache.CACHE_FORMAT}")]  # the old one goes


def test_unwritable_cache_root_still_loads(smollm2_path, tmp_path, fresh_logits):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    logits, _ = load_and_score(smollm2_path, blocker / "cache")
    np.testing.assert_array_equal(logits, fresh_logits)


def test_cancelled_load_writes_no_entry(smollm2_path, cache_root, fresh_logits):
    """A load cancelled halfway (progress callback returning False) leaves no cache entry behind; the next load
    converts, writes a whole entry and computes the same logits."""
    from llmfw.core.errors import LoadCancelled

    with pytest.raises(LoadCancelled):
        llmfw.load_model(smollm2_path, backend="onnx", backend_options={"onnx": {"cache_dir": str(cache_root)}},
                         progress=lambda fraction: fraction < 0.5)
    assert not cache_root.exists() or not [p for p in cache_root.iterdir() if not p.name.startswith(".")]
    logits, mapped = load_and_score(smollm2_path, cache_root)
    assert not any(mapped.values())
    np.testing.assert_array_equal(logits, fresh_logits)
    assert all(load_and_score(smollm2_path, cache_root)[1].values())
