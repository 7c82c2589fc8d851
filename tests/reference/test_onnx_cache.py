"""The onnx backend's converted-weight cache on a real model: restored loads map it and compute the same logits;
a corrupt, truncated or foreign entry is rebuilt from the model file, never trusted and never a crash."""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

import llmfw
from llmfw.plugins.backends.onnx.weights import BlockWeight

PROMPT = [1, 504, 3458, 282, 4098, 314, 253, 2734]


@pytest.fixture
def cache_root(tmp_path):
    return tmp_path / "onnx-cache"


@dataclass
class Scored:
    logits: np.ndarray
    #: which of the onnx backend's weights are mapped from the cache (looked at right after the load)
    mapped: dict[str, bool]
    #: weights the load converted from the model file (0: everything came from the cache)
    converted: int
    #: initializers the session read from the cache file itself
    from_file: int


def load_and_score(path, root, before_decode=None) -> Scored:
    """The prompt's logits of one fresh load and where its weights came from; ``before_decode(root)`` runs
    between the load and the first decode (which builds the session)."""
    options = {"cache": False} if root is None else {"cache_dir": str(root)}
    model = llmfw.load_model(path, backend="onnx", backend_options={"onnx": options})
    try:
        backend = model.backends["onnx"]
        mapped = {name: mapped_from_cache(w) for name, w in backend.weights.items()}
        if before_decode is not None:
            before_decode(root)
        ctx = model.new_context(n_ctx=64)
        assert ctx.decode(llmfw.Batch(tokens=PROMPT, logits=True)) == 0, ctx.last_error
        logits = np.array(ctx.get_logits())
        ctx.close()
        return Scored(logits, mapped, backend.weights_converted, backend.initializers_from_file)
    finally:
        model.close()


def entry_of(root):
    (entry,) = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return entry


def mapped_from_cache(weight) -> bool:
    return is_mapped(weight.packed if isinstance(weight, BlockWeight) else weight.array)


def is_mapped(array) -> bool:
    while array is not None and not isinstance(array, np.memmap):
        array = array.base
    return array is not None


@pytest.fixture(scope="module")
def fresh_logits(smollm2_path):
    """The logits of a load that converts every weight (no cache at all)."""
    fresh = load_and_score(smollm2_path, None)
    assert fresh.from_file == 0 and not any(fresh.mapped.values())
    return fresh.logits


def test_second_load_maps_every_weight_and_computes_the_same_logits(smollm2_path, cache_root, fresh_logits):
    first = load_and_score(smollm2_path, cache_root)
    # converted, written, then mapped back from the entry: the converted copies are not kept
    assert first.converted == len(first.mapped) and all(first.mapped.values())
    index = json.loads((entry_of(cache_root) / "index.json").read_text())
    assert set(index["weights"]) == set(first.mapped)
    # a fused weight's parts are stored as its rows, not twice
    fused = next(name for name in index["weights"] if name.startswith("blk.0.attn_q.weight+"))
    start, _, _ = index["weights"][fused]["arrays"]["packed"]
    offset, _, shape = index["weights"]["blk.0.attn_k.weight"]["arrays"]["packed"]
    q_rows = index["weights"]["blk.0.attn_q.weight"]["arrays"]["packed"][2][0]
    assert offset == start + q_rows * shape[1] * shape[2]
    second = load_and_score(smollm2_path, cache_root)
    assert second.converted == 0 and all(second.mapped.values())
    # the session reads the mapped weights from the cache file itself
    assert first.from_file > 0 and second.from_file == first.from_file
    np.testing.assert_array_equal(first.logits, fresh_logits)
    np.testing.assert_array_equal(second.logits, fresh_logits)


def test_transposed_offsets_are_stored_and_mapped(smollm2_path, cache_root):
    """SmolLM2's Q4_1 matrices add their block offsets with a Gemm over ``offsets.T``: the transposed copy is made
    at load and kept in the cache like the other arrays (mapped, so ONNX Runtime reads it from the file), for
    fused weights too; a fused weight's parts do not keep one of their own."""
    load_and_score(smollm2_path, cache_root)
    model = llmfw.load_model(smollm2_path, backend="onnx", backend_options={"onnx": {"cache_dir": str(cache_root)}})
    try:
        weights = model.backends["onnx"].weights
        fused = next(name for name in weights if name.startswith("blk.0.ffn_up.weight+"))
        for name in ("blk.0.ffn_down.weight", fused):
            weight = weights[name]
            assert weight.offsets_t is not None and weight.offsets_t.flags.c_contiguous
            np.testing.assert_array_equal(weight.offsets_t, weight.offsets.T)
            assert is_mapped(weight.offsets_t)
        assert weights["blk.0.ffn_up.weight"].offsets_t is None
    finally:
        model.close()


def replace_blob(root):
    blob = entry_of(root) / "weights.bin"
    replacement = blob.with_name("replacement")
    shutil.copyfile(blob, replacement)
    with replacement.open("r+b") as fh:  # same size, other bytes: read at our offsets it gives garbage
        fh.write(b"\x5a" * blob.stat().st_size)
    replacement.replace(blob)


def remove_entry(root):
    shutil.rmtree(entry_of(root))


@pytest.mark.parametrize("change", [replace_blob, remove_entry], ids=["replaced", "removed"])
def test_entry_changed_while_loaded_is_not_read_by_later_sessions(smollm2_path, cache_root, fresh_logits, change):
    """Another process may rewrite or evict the entry of a model this one has mapped: a session built afterwards
    must not read the new file at the old offsets (here it holds other bytes), nor fail for want of the file,
    but use the weights this process mapped."""
    load_and_score(smollm2_path, cache_root)
    scored = load_and_score(smollm2_path, cache_root, before_decode=change)
    assert scored.converted == 0 and scored.from_file == 0
    np.testing.assert_array_equal(scored.logits, fresh_logits)


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
        scored = load_and_score(smollm2_path, cache_root)
    assert "corrupt" in caplog.text
    assert scored.converted == len(scored.mapped)  # converted again from the model file
    np.testing.assert_array_equal(scored.logits, fresh_logits)
    assert entry_of(cache_root).joinpath("weights.bin").stat().st_size == blob_bytes  # rewritten whole
    restored = load_and_score(smollm2_path, cache_root)
    assert restored.converted == 0 and all(restored.mapped.values())


def test_entry_of_another_converter_format_is_not_read(smollm2_path, cache_root, monkeypatch):
    """Entries are keyed by the converter's format (and llmfw's version): code that converts differently
    writes its own entry instead of reading an old one, and removes the outdated entry of the same file."""
    from llmfw.plugins.backends.onnx import cache

    load_and_score(smollm2_path, cache_root)
    old = entry_of(cache_root)
    monkeypatch.setattr(cache, "CACHE_FORMAT", cache.CACHE_FORMAT + 1)
    scored = load_and_score(smollm2_path, cache_root)
    assert scored.converted == len(scored.mapped)
    names = [p.name for p in cache_root.iterdir() if not p.name.startswith(".")]
    assert names == [old.name.replace(f"-f{cache.CACHE_FORMAT - 1}", f"-f{cache.CACHE_FORMAT}")]  # the old one goes


def test_unwritable_cache_root_still_loads(smollm2_path, tmp_path, fresh_logits):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    scored = load_and_score(smollm2_path, blocker / "cache")
    assert scored.from_file == 0 and not any(scored.mapped.values())
    np.testing.assert_array_equal(scored.logits, fresh_logits)


def test_cancelled_load_writes_no_entry(smollm2_path, cache_root, fresh_logits):
    """A load cancelled halfway (progress callback returning False) leaves no cache entry behind; the next load
    converts, writes a whole entry and computes the same logits."""
    from llmfw.core.errors import LoadCancelled

    with pytest.raises(LoadCancelled):
        llmfw.load_model(smollm2_path, backend="onnx", backend_options={"onnx": {"cache_dir": str(cache_root)}},
                         progress=lambda fraction: fraction < 0.5)
    assert not cache_root.exists() or not [p for p in cache_root.iterdir() if not p.name.startswith(".")]
    scored = load_and_score(smollm2_path, cache_root)
    assert scored.converted == len(scored.mapped)
    np.testing.assert_array_equal(scored.logits, fresh_logits)
    assert load_and_score(smollm2_path, cache_root).converted == 0
