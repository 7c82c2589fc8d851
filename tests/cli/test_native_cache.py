"""The native backend's repacked-weight cache: a second load maps every repacked weight from the entry and computes
the same logits as a load without a cache; a damaged entry is rebuilt, never trusted; `llmfw models` lists it and
`--prune` removes it; a first load streams (its peak memory is a cached load's, not the whole model repacked in
memory on top of the file's pages); the entry's mapping asks the kernel for huge pages (the matmuls stream through
it at every token)."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest

import llmfw

from support.tiny_cli import invoke, write_tiny_model
from support.moe_file import measure_load
from support.mappings import huge_page_advice, vm_flags_of
from support.native import kernels_or_skip

kernels_or_skip()

PROMPT = [1, 259 + 0, 259 + 1, 72, 101]


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    """A file over the cache's 8 MiB threshold, its FFN in Q8_0 (repacked by the backend)."""
    return write_tiny_model(tmp_path_factory.mktemp("native-cache") / "big.gguf", n_ff=45056, quantized_ffn=True)


def load_and_score(path, root, isa="auto", paired=None):
    """The logits of PROMPT, whether each repacked matrix was mapped from the cache, and how many were repacked;
    paired (a dict): each matrix's layout is put in it."""
    options = {"cache": False} if root is None else {"cache_dir": str(root)}
    with llmfw.load_model(path, backend="native", backend_options={"native": {**options, "isa": isa}}) as model:
        backend = model.backends["native"]
        # per repacked matrix: a tied head shares its embedding's one copy, so it is counted once
        matrices = {id(handle): (name, handle) for name, handle in reversed(backend.weights.items())
                    if hasattr(handle, "packed")}
        mapped = {name: is_mapped(handle.packed.data) for name, handle in matrices.values()}
        if paired is not None:
            paired.update({name: handle.packed.paired for name, handle in matrices.values()})
        ctx = model.new_context(n_ctx=32)
        assert ctx.decode(llmfw.Batch(tokens=PROMPT, logits=True)) == 0, ctx.last_error
        logits = np.array(ctx.get_logits())
        ctx.close()
        return logits, mapped, backend.weights_converted


def is_mapped(array) -> bool:
    while array is not None and not isinstance(array, np.memmap):
        array = array.base
    return array is not None


def entry_of(root):
    (entry,) = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return entry


@pytest.fixture(scope="module")
def fresh_logits(big_model):
    logits, mapped, converted = load_and_score(big_model, None)
    assert mapped and not any(mapped.values()) and converted == len(mapped)
    return logits


def test_second_load_maps_every_repacked_weight_and_computes_the_same_logits(big_model, tmp_path, fresh_logits):
    root = tmp_path / "cache"
    first, mapped, converted = load_and_score(big_model, root)
    assert converted == len(mapped) and all(mapped.values())  # repacked, written, mapped back
    index = json.loads((entry_of(root) / "index.json").read_text())
    stored = {name: weight["arrays"]["data"] for name, weight in index["weights"].items()}
    start, _, (fused_bytes,) = stored["blk.0.ffn_up.weight+blk.0.ffn_gate.weight"]
    up_at, _, (up_bytes,) = stored["blk.0.ffn_up.weight"]
    assert (up_at, stored["blk.0.ffn_gate.weight"][0]) == (start, start + up_bytes)  # parts: the fused rows
    assert fused_bytes == 2 * up_bytes
    second, mapped, converted = load_and_score(big_model, root)
    assert converted == 0 and all(mapped.values())
    np.testing.assert_array_equal(first, fresh_logits)
    np.testing.assert_array_equal(second, fresh_logits)


@huge_page_advice
def test_the_mapped_entry_is_advised_to_take_huge_pages(big_model, tmp_path):
    root = tmp_path / "cache"
    for _ in range(2):  # the first load repacks and maps back what it wrote, the second maps what it finds
        with llmfw.load_model(big_model, backend="native", backend_options={"native": {"cache_dir": str(root)}}) as model:
            packed = [handle.packed.data for handle in model.backends["native"].weights.values()
                      if hasattr(handle, "packed")]
            assert packed and all(is_mapped(data) for data in packed)
            assert all("hg" in vm_flags_of(int(data.ctypes.data)) for data in packed)


def _truncate_blob(entry):
    blob = entry / "weights.bin"
    with blob.open("r+b") as fh:
        fh.truncate(blob.stat().st_size // 2)


def _edit_index(entry, edit):
    index = json.loads((entry / "index.json").read_text())
    edit(index["weights"]["blk.1.ffn_down.weight"])
    (entry / "index.json").write_text(json.dumps(index))


def _more_rows(weight):
    weight["meta"]["n_rows"] += 8  # the kernels would read a row group past the stored bytes


def _bad_kind(weight):
    weight["meta"]["kind"] = 9


def _short_table(weight):
    weight["arrays"]["table"][2] = [8]


@pytest.mark.parametrize("damage", [_truncate_blob, lambda e: _edit_index(e, _more_rows),
                                    lambda e: _edit_index(e, _bad_kind), lambda e: _edit_index(e, _short_table)],
                         ids=["truncated blob", "rows past the bytes", "unknown kind", "short code table"])
def test_damaged_entry_is_rebuilt_not_trusted(big_model, tmp_path, fresh_logits, damage, caplog):
    root = tmp_path / "cache"
    load_and_score(big_model, root)
    damage(entry_of(root))
    with caplog.at_level(logging.WARNING):
        logits, mapped, converted = load_and_score(big_model, root)
    assert "corrupt" in caplog.text
    assert converted == len(mapped)  # repacked again from the model file
    np.testing.assert_array_equal(logits, fresh_logits)
    assert load_and_score(big_model, root)[2] == 0  # and the rewritten entry serves the next load


def test_models_lists_the_native_cache_and_prune_removes_it(big_model, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMFW_MODELS_DIR", str(tmp_path))
    monkeypatch.delenv("LLMFW_NATIVE_CACHE_DIR", raising=False)
    with llmfw.load_model(big_model, backend="native"):
        pass
    entry = entry_of(tmp_path / ".native")
    listed = invoke("models")
    assert listed.exit_code == 0, listed.output
    assert f"converted weights (native): {tmp_path / '.native'}" in listed.output
    assert entry.name in listed.output
    pruned = invoke("models", "--prune")
    assert pruned.exit_code == 0, pruned.output
    assert not entry.exists()
    assert f"converted weights (native): {tmp_path / '.native'} (empty)" in invoke("models").output


def test_a_stored_weight_of_another_shape_is_repacked_again(big_model, tmp_path, fresh_logits):
    """One row less still fits the stored bytes (the same row groups), so the entry checks out; the weight does not
    match its tensor, so it is repacked from the file and the entry rewritten."""
    root = tmp_path / "cache"
    load_and_score(big_model, root)
    _edit_index(entry_of(root), lambda weight: weight["meta"].update(n_rows=weight["meta"]["n_rows"] - 1))
    logits, _, converted = load_and_score(big_model, root)
    assert converted == 1
    np.testing.assert_array_equal(logits, fresh_logits)
    assert load_and_score(big_model, root)[2] == 0


def test_the_avx2_path_pairs_row_groups_and_an_entry_of_the_other_layout_is_repacked(tmp_path):
    """The AVX2 path takes Q4_1 matrices with their row groups in pairs (repack.pairable), the portable path
    apart: an entry written by one is repacked again for the other (the same logits from both), then mapped."""
    if "avx2" not in kernels_or_skip().available_isas():
        pytest.skip("this CPU has no AVX2 path")
    model = write_tiny_model(tmp_path / "q4_1.gguf", n_ff=90112, quantized_ffn=True, ffn_type="Q4_1")
    fresh_logits = load_and_score(model, None, "scalar")[0]
    root = tmp_path / "cache"
    layouts = {}
    logits, _, converted = load_and_score(model, root, "avx2", layouts)
    ffn = {name for name in layouts if "ffn" in name}
    assert ffn and all(layouts[name] for name in ffn) and not any(layouts[n] for n in set(layouts) - ffn)
    np.testing.assert_array_equal(logits, fresh_logits)
    logits, _, converted = load_and_score(model, root, "scalar", layouts)
    assert converted == len(ffn) and not any(layouts.values())  # the fused up+gate matrices stacked again too
    np.testing.assert_array_equal(logits, fresh_logits)
    _, mapped, converted = load_and_score(model, root, "scalar")
    assert converted == 0 and all(mapped.values())


def test_a_first_load_adds_no_more_memory_than_a_cached_one(tmp_path):
    """Each tensor is repacked, spilled to the cache's scratch file and its file pages dropped, so the first load's
    peak is the cached load's (both end with the entry mapped): not the repacked model in anonymous memory on top
    of the file's pages, which cost another ~1.1x the file before."""
    model = write_tiny_model(tmp_path / "wide.gguf", n_ff=180224, quantized_ffn=True)  # 37 MB, 6 MB matrices
    env = {"LLMFW_NATIVE_CACHE_DIR": str(tmp_path / "cache")}
    first = measure_load(model, "native", env)
    cached = measure_load(model, "native", env)
    assert first["added"] - cached["added"] <= 0.25 * model.stat().st_size, (first, cached)


def test_a_load_that_asks_for_some_weights_leaves_the_others_in_the_entry(big_model, tmp_path, fresh_logits):
    """An onnx load keeps the token embedding on native (the host backend): it maps that one weight from the entry
    and leaves the entry whole, so the next native load repacks nothing (dropping the rest made native and onnx
    loads of one file take turns repacking the whole model)."""
    root = tmp_path / "cache"
    load_and_score(big_model, root)
    index = entry_of(root) / "index.json"
    stored = json.loads(index.read_text())["weights"]
    options = {"native": {"cache_dir": str(root)}, "onnx": {"cache": False}}
    with llmfw.load_model(big_model, backend="onnx", backend_options=options) as model:
        on_native = set(model.backends["native"].weights)
    assert on_native and on_native < set(stored)
    assert json.loads(index.read_text())["weights"] == stored
    logits, mapped, converted = load_and_score(big_model, root)
    assert converted == 0 and all(mapped.values())
    np.testing.assert_array_equal(logits, fresh_logits)


def test_the_folder_variable_moves_a_python_api_load_and_the_option_wins_over_it(big_model, tmp_path, monkeypatch):
    """``LLMFW_NATIVE_CACHE_DIR`` moves the cache of a plain ``llmfw.load_model`` too (not only the CLI's loads);
    a ``cache_dir`` option still decides where it names one."""
    monkeypatch.setenv("LLMFW_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("LLMFW_NATIVE_CACHE_DIR", str(tmp_path / "moved"))
    with llmfw.load_model(big_model, backend="native"):
        pass
    assert entry_of(tmp_path / "moved").is_dir()
    assert not (tmp_path / "models" / ".native").exists()
    with llmfw.load_model(big_model, backend="native", backend_options={"native": {"cache_dir": str(tmp_path / "opt")}}):
        pass
    assert entry_of(tmp_path / "opt").is_dir()
