"""GGUF reader/writer: round trips, real models, split files and malformed files."""
from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from llmfw.core.errors import GGUFError, LLMFWError, QuantError
from llmfw.core.gguf import (
    KEY_ALIGNMENT,
    GGUFFile,
    GGUFValueType as VT,
    GGUFWriter,
    TensorInfo,
    most_common_type,
    open_gguf,
    split_file_name,
)
from llmfw.core.quants import GGMLType
from support.gguf_files import write_small_model

MODES = ("mmap", "read")
#: the most a malformed file may make the reader allocate (tracemalloc peak)
ALLOCATION_LIMIT = 4 << 20


# ----------------------------------------------------------------------------------------------- helpers


def _u32(v: int) -> bytes:
    return struct.pack("<I", v)


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def _gguf_string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return _u64(len(raw)) + raw


@pytest.fixture
def small_model(tmp_path: Path) -> Path:
    return write_small_model(tmp_path / "small.gguf")


def expect_error(path: Path, *match: str, error: type[Exception] = GGUFError, mode: str = "mmap") -> str:
    """Opening must raise ``error`` with every ``match`` fragment in its message, allocating little."""
    tracemalloc.start()
    try:
        with pytest.raises(error) as info:
            open_gguf(path, mode).close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    for fragment in match:
        assert fragment in message, message
    assert peak < ALLOCATION_LIMIT, f"opening a malformed file allocated {peak} bytes"
    return message


def patched(source: Path, target: Path, offset: int, new: bytes) -> Path:
    data = bytearray(source.read_bytes())
    data[offset:offset + len(new)] = new
    target.write_bytes(bytes(data))
    return target


def header_file(tmp_path: Path, body: bytes, *, n_tensors: int = 0, n_kv: int = 1, version: int = 3) -> Path:
    """A hand-built file: preamble plus ``body`` (for values no writer would produce)."""
    path = tmp_path / "hand.gguf"
    path.write_bytes(b"GGUF" + _u32(version) + _u64(n_tensors) + _u64(n_kv) + body)
    return path


# ----------------------------------------------------------------------------------------------- round trips

SCALARS = [
    ("u8", 255, VT.UINT8), ("i8", -128, VT.INT8), ("u16", 65535, VT.UINT16), ("i16", -32768, VT.INT16),
    ("u32", 2**32 - 1, VT.UINT32), ("i32", -(2**31), VT.INT32), ("f32", 1.5, VT.FLOAT32), ("b", False, VT.BOOL),
    ("s", "ünïcode ✓", VT.STRING), ("u64", 2**64 - 1, VT.UINT64), ("i64", -(2**63), VT.INT64),
    ("f64", 1e300, VT.FLOAT64),
]
NUMERIC_DTYPES = {VT.UINT8: "u1", VT.INT8: "i1", VT.UINT16: "u2", VT.INT16: "i2", VT.UINT32: "u4", VT.INT32: "i4",
                  VT.FLOAT32: "f4", VT.UINT64: "u8", VT.INT64: "i8", VT.FLOAT64: "f8"}


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_every_value_type_round_trips(tmp_path: Path, version: int, mode: str) -> None:
    path = tmp_path / "kv.gguf"
    with GGUFWriter(path, version=version) as w:
        for key, value, vtype in SCALARS:
            w.add(key, value, vtype)
        for vtype, dtype in NUMERIC_DTYPES.items():
            info = np.iinfo(dtype) if dtype[0] in "ui" else np.finfo(dtype)
            w.add(f"arr.{vtype.name}", np.array([info.min, 0, info.max], dtype=dtype))
        w.add("arr.bool", [True, False, True])
        w.add("arr.str", ["a", "", "ß∂", "x" * 1000])
        w.add("arr.empty", [], array_type=VT.STRING)
        w.add("arr.nested", [[1, 2, 3], [], [4]])
        w.add("arr.nested_str", [["a", "b"], ["c"]])
        w.add("arr.deep", [[[1.5], [2.5, 3.5]], [[4.5]]])
        w.add("arr.u32_from_list", [1, 2, 3], array_type=VT.UINT32)
    with open_gguf(path, mode) as g:
        assert g.version == version
        assert g.tensors == {}
        for key, value, vtype in SCALARS:
            assert g.metadata_types[key] == vtype
            got = g.metadata[key]
            assert got == (np.float32(value) if vtype == VT.FLOAT32 else value)
            assert type(got) is type(value)
        for vtype, dtype in NUMERIC_DTYPES.items():
            key = f"arr.{vtype.name}"
            arr = g.metadata[key]
            assert g.metadata_types[key] == VT.ARRAY and g.metadata_array_types[key] == vtype
            assert isinstance(arr, np.ndarray) and arr.dtype == np.dtype(dtype)
            info = np.iinfo(dtype) if dtype[0] in "ui" else np.finfo(dtype)
            assert arr.tolist() == [info.min, 0, info.max]
        assert g.metadata["arr.bool"].dtype == np.bool_ and g.metadata["arr.bool"].tolist() == [True, False, True]
        assert g.metadata["arr.str"] == ["a", "", "ß∂", "x" * 1000]
        assert g.metadata_array_types["arr.str"] == VT.STRING
        assert g.metadata["arr.empty"] == []
        nested = g.metadata["arr.nested"]
        assert g.metadata_array_types["arr.nested"] == VT.ARRAY
        assert [a.tolist() for a in nested] == [[1, 2, 3], [], [4]]
        assert g.metadata["arr.nested_str"] == [["a", "b"], ["c"]]
        assert [[a.tolist() for a in inner] for inner in g.metadata["arr.deep"]] == [[[1.5], [2.5, 3.5]], [[4.5]]]
        assert g.metadata["arr.u32_from_list"].dtype == np.uint32


def test_writer_infers_types_and_checks_ranges(tmp_path: Path) -> None:
    path = tmp_path / "infer.gguf"
    with GGUFWriter(path) as w:
        w.add("small", 7)
        w.add("big", 2**40)
        w.add("huge", 2**63)
        w.add("flag", True)
        w.add("ratio", 0.25)
        w.add("mixed", [1, 2.5])
        w.add("np_u16", np.uint16(9))
        with pytest.raises(GGUFError, match="UINT8"):
            w.add("bad", 256, VT.UINT8)
        with pytest.raises(GGUFError, match="duplicate key"):
            w.add("small", 1)
        with pytest.raises(GGUFError, match=r"UINT8 array items must lie in \[0, 255\]"):
            w.add("bad_array", np.array([1, 300]), array_type=VT.UINT8)
    with open_gguf(path) as g:
        types = g.metadata_types
        assert (types["small"], types["big"], types["huge"]) == (VT.INT32, VT.INT64, VT.UINT64)
        assert (types["flag"], types["ratio"], types["np_u16"]) == (VT.BOOL, VT.FLOAT32, VT.UINT16)
        assert g.metadata_array_types["mixed"] == VT.FLOAT32
        assert "bad" not in g.metadata


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("alignment", [32, 64, 1])
def test_tensors_round_trip(tmp_path: Path, mode: str, alignment: int) -> None:
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal((3, 5, 7)).astype(np.float32)
    f16 = rng.standard_normal((4, 6)).astype(np.float16)
    q4 = rng.integers(0, 256, 3 * 2 * 18, dtype=np.uint8)  # Q4_0: 3 rows of 64 = 2 blocks of 18 bytes each
    path = tmp_path / "t.gguf"
    with GGUFWriter(path, alignment=alignment) as w:
        w.add_tensor("f32", f32)
        w.add_tensor("f16", f16)
        w.add_tensor("q4", q4, GGMLType.Q4_0, (64, 3))
    with open_gguf(path, mode) as g:
        assert g.alignment == alignment
        assert list(g.tensors) == ["f32", "f16", "q4"]
        t = g.tensors["f32"]
        assert t == TensorInfo("f32", (7, 5, 3), GGMLType.F32, t.offset, f32.nbytes, 0)
        assert t.numpy_shape == (3, 5, 7) and t.n_elements == 105
        assert g.data_offset % alignment == 0
        assert all((info.offset - g.data_offset) % alignment == 0 for info in g.tensors.values())
        np.testing.assert_array_equal(g.tensor_array("f32"), f32)
        np.testing.assert_array_equal(g.tensor_array("f16"), f16)
        assert g.tensors["f16"].ggml_type == GGMLType.F16 and g.tensors["f16"].shape == (6, 4)
        q = g.tensors["q4"]
        assert (q.ggml_type, q.shape, q.nbytes) == (GGMLType.Q4_0, (64, 3), q4.nbytes)
        np.testing.assert_array_equal(g.tensor_bytes("q4"), q4)
        assert g.tensor_bytes("q4").dtype == np.uint8
        with pytest.raises(QuantError, match="Q4_0"):
            g.tensor_array("q4")
        with pytest.raises(GGUFError, match="no tensor named 'missing'"):
            g.tensor_bytes("missing")
    assert path.stat().st_size == g.data_offset + _padded_end(g, alignment)


def _padded_end(g: GGUFFile, alignment: int) -> int:
    last = max(g.tensors.values(), key=lambda t: t.offset)
    end = last.offset - g.data_offset + last.nbytes
    return (end + alignment - 1) // alignment * alignment


def test_mmap_views_are_zero_copy_and_close_releases(small_model: Path) -> None:
    g = open_gguf(small_model)
    view = g.tensor_bytes("token_embd.weight")
    assert not view.flags.owndata and not view.flags.writeable  # a view of the read-only mapping
    again = g.tensor_bytes("token_embd.weight")
    assert np.shares_memory(view, again)
    expected = view.copy()
    g.close()  # a live view must not make close() fail; the mapping lives on until the view dies
    assert g.closed
    np.testing.assert_array_equal(view, expected)
    with pytest.raises(GGUFError, match="closed"):
        g.tensor_bytes("token_embd.weight")
    g.close()  # idempotent


def test_lasting_views_outlive_close_in_a_mapping_of_their_own(small_model: Path) -> None:
    g = open_gguf(small_model)
    lasting = g.lasting_tensor_bytes("token_embd.weight")
    assert lasting is not None and not lasting.flags.writeable
    view = g.tensor_bytes("token_embd.weight")
    np.testing.assert_array_equal(lasting, view)
    assert not np.shares_memory(lasting, view)  # not the load's mapping, whose touched pages close() drops
    expected = view.copy()
    g.close()
    np.testing.assert_array_equal(lasting, expected)
    assert g.lasting_tensor_bytes("token_embd.weight") is None  # closed: nothing to map
    with open_gguf(small_model, "read") as r:
        assert r.lasting_tensor_bytes("token_embd.weight") is None  # read mode copies instead


def test_read_mode_returns_owned_copies(small_model: Path) -> None:
    with open_gguf(small_model, "read") as g, open_gguf(small_model) as m:
        data = g.tensor_bytes("token_embd.weight")
        assert data.flags.owndata and data.flags.writeable
        np.testing.assert_array_equal(data, m.tensor_bytes("token_embd.weight"))
        assert g.metadata.keys() == m.metadata.keys()


def test_metadata_is_independent_of_the_mapping(small_model: Path) -> None:
    g = open_gguf(small_model)
    scores = g.metadata["tokenizer.ggml.scores"]
    g.close()
    assert scores.flags.owndata and scores.tolist() == [0.0, -1.0, -2.5, 3.0, 4.0]


def test_vocab_only_file(tmp_path: Path) -> None:
    path = tmp_path / "vocab.gguf"
    with GGUFWriter(path) as w:
        w.add("tokenizer.ggml.model", "gpt2")
        w.add("tokenizer.ggml.tokens", [f"tok{i}" for i in range(1000)])
    with open_gguf(path) as g:
        assert g.tensors == {} and len(g.metadata["tokenizer.ggml.tokens"]) == 1000


def test_most_common_type_counts_elements_of_matrices() -> None:
    tensors = [TensorInfo("a", (4096, 10), GGMLType.Q8_0, 0, 0, 0), TensorInfo("b", (64, 64), GGMLType.Q4_K, 0, 0, 0),
               TensorInfo("c", (64, 64), GGMLType.Q4_K, 0, 0, 0), TensorInfo("norm", (10**6,), GGMLType.F32, 0, 0, 0)]
    assert most_common_type(tensors) == GGMLType.Q8_0
    assert most_common_type(tensors[3:]) is None


# ----------------------------------------------------------------------------------------------- splits


def write_split_model(tmp_path: Path, n_splits: int = 3) -> tuple[list[Path], dict[str, np.ndarray]]:
    rng = np.random.default_rng(2)
    arrays = {f"blk.{i}.weight": rng.standard_normal((i + 1, 4)).astype(np.float32) for i in range(7)}
    writer = GGUFWriter(tmp_path / "model.gguf", n_splits=n_splits)
    writer.add("general.architecture", "llama")
    writer.add("tokenizer.ggml.tokens", ["a", "b"])
    for name, arr in arrays.items():
        writer.add_tensor(name, arr)
    writer.write()
    return writer.written_paths, arrays


@pytest.mark.parametrize("mode", MODES)
def test_split_model_opens_as_one(tmp_path: Path, mode: str) -> None:
    paths, arrays = write_split_model(tmp_path)
    assert [p.name for p in paths] == [split_file_name("model", i, 3) for i in range(3)]
    assert paths[0].name == "model-00001-of-00003.gguf"
    for opened in (paths[0], paths[2]):  # any part opens the whole model
        with open_gguf(opened, mode) as g:
            assert g.paths == paths
            assert list(g.tensors) == list(arrays)
            assert sorted({t.file_index for t in g.tensors.values()}) == [0, 1, 2]
            assert g.metadata["general.architecture"] == "llama"
            assert g.metadata["split.count"] == 3 and g.metadata["split.tensors.count"] == 7
            for name, arr in arrays.items():
                np.testing.assert_array_equal(g.tensor_array(name), arr)
            # offsets are absolute within each tensor's own file
            for info in g.tensors.values():
                assert info.offset >= g.data_offsets[info.file_index]


def test_split_missing_part(tmp_path: Path) -> None:
    paths, _ = write_split_model(tmp_path)
    paths[1].unlink()
    expect_error(paths[0], "missing", paths[1].name)


def test_split_inconsistent_number(tmp_path: Path) -> None:
    paths, _ = write_split_model(tmp_path)
    with GGUFWriter(paths[1]) as w:  # replace part 2 by a file that claims to be part 3
        w.add("split.no", 2, VT.UINT16)
        w.add("split.count", 3, VT.UINT16)
    expect_error(paths[0], "expected split.no=1", "found split.no=2")


def test_split_tensor_count_mismatch(tmp_path: Path) -> None:
    paths, _ = write_split_model(tmp_path)
    with GGUFWriter(paths[2]) as w:  # a consistent-looking part 3 without its tensors
        w.add("split.no", 2, VT.UINT16)
        w.add("split.count", 3, VT.UINT16)
    expect_error(paths[0], "split.tensors.count is 7", "hold 5 tensors")


def test_split_count_needs_split_name(tmp_path: Path) -> None:
    paths, _ = write_split_model(tmp_path)
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(paths[0], renamed)
    expect_error(renamed, "split.count is 3", "file name")


def test_split_duplicate_tensor_across_files(tmp_path: Path) -> None:
    paths, _ = write_split_model(tmp_path)
    with GGUFWriter(paths[2]) as w:
        w.add("split.no", 2, VT.UINT16)
        w.add("split.count", 3, VT.UINT16)
        w.add_tensor("blk.0.weight", np.zeros((1, 4), np.float32))
    expect_error(paths[0], "duplicate tensor name 'blk.0.weight'")


# ----------------------------------------------------------------------------------------------- real models


@pytest.fixture(scope="module")
def smollm2(smollm2_path: Path):
    with open_gguf(smollm2_path) as g:
        yield g


@pytest.fixture(scope="module")
def gemma3(gemma3_path: Path):
    with open_gguf(gemma3_path) as g:
        yield g


def test_smollm2_metadata_and_tensors(smollm2: GGUFFile, smollm2_path: Path) -> None:
    g = smollm2
    assert (g.version, g.alignment, g.architecture) == (3, 32, "llama")
    assert g.metadata["llama.block_count"] == 30 and g.metadata_types["llama.block_count"] == VT.UINT32
    assert g.metadata["llama.embedding_length"] == 576
    assert g.metadata["llama.attention.head_count_kv"] == 3
    assert g.metadata["tokenizer.ggml.pre"] == "smollm"
    tokens = g.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and tokens[:2] == ["<|endoftext|>", "<|im_start|>"]
    assert g.metadata["tokenizer.ggml.token_type"].dtype == np.int32
    assert len(g.metadata["tokenizer.ggml.merges"]) == 48900
    assert g.metadata["tokenizer.ggml.add_bos_token"] is False
    assert len(g.tensors) == 272
    emb = g.tensors["token_embd.weight"]
    assert (emb.shape, emb.ggml_type, emb.offset) == ((576, 49152), GGMLType.Q8_0, g.data_offset)
    assert most_common_type(g.tensors.values()) == GGMLType.Q4_1
    last = max(g.tensors.values(), key=lambda t: t.offset)
    assert last.offset + last.nbytes <= smollm2_path.stat().st_size
    with smollm2_path.open("rb") as fh:
        fh.seek(emb.offset)
        assert bytes(g.tensor_bytes(emb.name)[:4096]) == fh.read(4096)


def test_gemma3_metadata_and_tensors(gemma3: GGUFFile) -> None:
    g = gemma3
    assert g.architecture == "gemma3"
    assert g.metadata["gemma3.attention.sliding_window"] == 512
    assert g.metadata["gemma3.attention.key_length"] == 256
    assert g.metadata["tokenizer.ggml.model"] == "llama"
    assert len(g.metadata["tokenizer.ggml.tokens"]) == 262144
    scores = g.metadata["tokenizer.ggml.scores"]
    assert scores.dtype == np.float32 and scores.shape == (262144,)
    assert len(g.tensors) == 236
    types = {t.ggml_type for t in g.tensors.values()}
    assert types == {GGMLType.F32, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q6_K}
    assert g.tensor_array("output_norm.weight").shape == (640,)


def test_real_model_read_mode_matches_mmap(smollm2: GGUFFile, smollm2_path: Path) -> None:
    with open_gguf(smollm2_path, "read") as r:
        assert r.tensors == smollm2.tensors
        assert r.metadata["tokenizer.ggml.merges"] == smollm2.metadata["tokenizer.ggml.merges"]
        name = "blk.0.attn_q.weight"
        np.testing.assert_array_equal(r.tensor_bytes(name), smollm2.tensor_bytes(name))


def test_without_the_c_string_reader_a_vocabulary_is_read_by_python_alike(tmp_path: Path, smollm2_path: Path) -> None:
    """A copy of the package without its C extensions reads SmolLM2's 49152 tokens and 48900 merges by the Python
    loop, and they equal what this checkout reads (with the C loop where it is built)."""
    package = Path(__file__).resolve().parents[2] / "llmfw"
    shutil.copytree(package, tmp_path / "llmfw", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    probe = ("import hashlib, sys\nfrom llmfw.core.format import gguf_header\nfrom llmfw.core.gguf import open_gguf\n"
             "assert gguf_header._c_decode_strings is None\n"
             "with open_gguf(sys.argv[1]) as f:\n"
             "    m = f.metadata\n"
             "    print(hashlib.sha256(repr((m['tokenizer.ggml.tokens'], m['tokenizer.ggml.merges'])).encode())"
             ".hexdigest())\n")
    result = subprocess.run([sys.executable, "-c", probe, str(smollm2_path)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    with open_gguf(smollm2_path) as f:
        expected = repr((f.metadata["tokenizer.ggml.tokens"], f.metadata["tokenizer.ggml.merges"]))
    assert result.stdout.strip() == hashlib.sha256(expected.encode()).hexdigest()


def test_real_model_split_round_trip(smollm2: GGUFFile, tmp_path: Path) -> None:
    """Re-write SmolLM2's metadata and first tensors as a 3-file split with the writer; it reads back equal."""
    writer = GGUFWriter(tmp_path / "smol.gguf", n_splits=3)
    for key, value in smollm2.metadata.items():
        writer.add(key, value, smollm2.metadata_types[key], array_type=smollm2.metadata_array_types.get(key))
    names = [n for n in smollm2.tensors if n.startswith("blk.0.")]
    for name in names:
        info = smollm2.tensors[name]
        writer.add_tensor(name, smollm2.tensor_bytes(name), info.ggml_type, info.shape)
    writer.write()
    with open_gguf(writer.written_paths[0]) as g:
        for key, value in smollm2.metadata.items():
            assert g.metadata_types[key] == smollm2.metadata_types[key]
            if isinstance(value, np.ndarray):
                np.testing.assert_array_equal(g.metadata[key], value)
            else:
                assert g.metadata[key] == value, key
        assert list(g.tensors) == names
        for name in names:
            assert g.tensors[name].shape == smollm2.tensors[name].shape
            np.testing.assert_array_equal(g.tensor_bytes(name), smollm2.tensor_bytes(name))


# ----------------------------------------------------------------------------------------------- malformed


def test_truncated_at_every_header_offset(small_model: Path, tmp_path: Path) -> None:
    data = small_model.read_bytes()
    with open_gguf(small_model) as g:
        data_offset = g.data_offset
    target = tmp_path / "cut.gguf"
    for cut in range(data_offset + 1):
        target.write_bytes(data[:cut])
        with pytest.raises(GGUFError) as info:
            open_gguf(target).close()
        message = str(info.value)
        assert any(word in message for word in ("empty", "truncated", "outside the file", "too short",
                                                 "remain", "follow the header")), (cut, message)


def test_truncated_in_data(small_model: Path, tmp_path: Path) -> None:
    data = small_model.read_bytes()
    with open_gguf(small_model) as g:
        data_offset = g.data_offset
        data_end = max(t.offset + t.nbytes for t in g.tensors.values())  # the trailing padding is optional
    target = tmp_path / "cut.gguf"
    for cut in np.linspace(data_offset + 1, data_end - 1, 25).astype(int):
        target.write_bytes(data[:cut])
        for mode in MODES:
            expect_error(target, "lies outside the file", mode=mode)


def test_bad_magic(small_model: Path, tmp_path: Path) -> None:
    expect_error(patched(small_model, tmp_path / "m.gguf", 0, b"GGML"), "magic b'GGML'", "expected b'GGUF'")


@pytest.mark.parametrize("version", [0, 1, 4, 0x03000000])
def test_unsupported_version(small_model: Path, tmp_path: Path, version: int) -> None:
    message = expect_error(patched(small_model, tmp_path / "v.gguf", 4, _u32(version)),
                           f"unsupported version {version}")
    assert ("big-endian" in message) == (version == 0x03000000)


@pytest.mark.parametrize("offset, what", [(8, "tensors"), (16, "key-value pairs")])
def test_huge_header_counts(small_model: Path, tmp_path: Path, offset: int, what: str) -> None:
    expect_error(patched(small_model, tmp_path / "c.gguf", offset, _u64(2**62)), str(2**62), what)


def test_huge_key_length(small_model: Path, tmp_path: Path) -> None:
    expect_error(patched(small_model, tmp_path / "k.gguf", 24, _u64(2**62)), "key 0 at offset 24 claims", str(2**62))


@pytest.mark.parametrize("elem_type", [VT.UINT8, VT.FLOAT64, VT.BOOL, VT.STRING, VT.ARRAY])
def test_huge_array_count(tmp_path: Path, elem_type: VT) -> None:
    body = _gguf_string("k") + _u32(VT.ARRAY) + _u32(elem_type) + _u64(2**62) + bytes(64)
    expect_error(header_file(tmp_path, body), "claims 4611686018427387904 items", elem_type.name)


def test_huge_string_value_and_array_item(tmp_path: Path) -> None:
    body = _gguf_string("k") + _u32(VT.STRING) + _u64(2**62) + b"abc"
    expect_error(header_file(tmp_path, body), "value of 'k' at offset", "claims 4611686018427387904 bytes")
    body = _gguf_string("k") + _u32(VT.ARRAY) + _u32(VT.STRING) + _u64(2) + _gguf_string("a") + _u64(2**62)
    expect_error(header_file(tmp_path, body), "item 1 of value of 'k'", "claims 4611686018427387904 bytes")
    body = _gguf_string("k") + _u32(VT.STRING) + _u64(1000) + b"abc"  # under the cap: the file is too short
    expect_error(header_file(tmp_path, body), "truncated value of 'k'")


@pytest.mark.parametrize("mode", ["mmap", "read"])
def test_a_string_over_the_cap_is_refused_even_inside_the_file(tmp_path: Path, mode: str) -> None:
    """A length the file could hold but no real metadata string needs is refused before anything is decoded."""
    from llmfw.core.gguf import MAX_STRING_BYTES

    n = MAX_STRING_BYTES + 1
    path = header_file(tmp_path, _gguf_string("k") + _u32(VT.STRING) + _u64(n))
    with open(path, "r+b") as f:  # the claimed bytes really follow (a sparse stretch of zeros)
        f.truncate(path.stat().st_size + n + 64)
    with pytest.raises(GGUFError, match=f"claims {n} bytes"):
        open_gguf(path, mode)


def test_huge_tensor_name_length(tmp_path: Path) -> None:
    body = _u64(2**62) + bytes(40)
    expect_error(header_file(tmp_path, body, n_tensors=1, n_kv=0), "name of tensor 0")


def test_nested_arrays_too_deep(tmp_path: Path) -> None:
    body = _gguf_string("deep") + _u32(VT.ARRAY) + (_u32(VT.ARRAY) + _u64(1)) * 40 + _u32(VT.UINT8) + _u64(0)
    expect_error(header_file(tmp_path, body), "nested deeper than")


def test_unknown_value_types(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    with GGUFWriter(path) as w:
        w.add_raw_kv("weird", 13, b"\0" * 8)
    expect_error(path, "'weird' has unknown value type 13")
    with GGUFWriter(path) as w:
        w.add_raw_kv("weird_array", VT.ARRAY, _u32(77) + _u64(0))
    expect_error(path, "unknown value type 77")


def test_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "u.gguf"
    with GGUFWriter(path) as w:
        w.add_raw_kv("s", VT.STRING, _gguf_string(b"ok\xff"))
    expect_error(path, "value of 's'", "not valid UTF-8")
    with GGUFWriter(path) as w:
        w.add_raw_kv("arr", VT.ARRAY, _u32(VT.STRING) + _u64(2) + _gguf_string("fine") + _gguf_string(b"\xc3("))
    expect_error(path, "item 1 of value of 'arr'", "not valid UTF-8")
    body = _gguf_string(b"\xe2\x82") + _u32(VT.UINT8) + b"\0"
    expect_error(header_file(tmp_path, body), "key 0", "not valid UTF-8")


def test_duplicate_key(tmp_path: Path) -> None:
    path = tmp_path / "d.gguf"
    with GGUFWriter(path, strict=False) as w:
        w.add("a", 1)
        w.add("a", 2)
    expect_error(path, "duplicate key 'a'")


def test_duplicate_tensor_name(tmp_path: Path) -> None:
    path = tmp_path / "d.gguf"
    with GGUFWriter(path, strict=False) as w:
        w.add_tensor("w", np.zeros(4, np.float32))
        w.add_tensor("w", np.ones(4, np.float32))
    expect_error(path, "duplicate tensor name 'w'")


def test_tensor_outside_file(tmp_path: Path) -> None:
    path = tmp_path / "o.gguf"
    with GGUFWriter(path) as w:
        w.add_tensor("w", np.zeros(8, np.float32))
        w.add_raw_tensor_info("far", (8,), GGMLType.F32, 2**40)
    expect_error(path, "'far'", "lies outside the file")


def test_overlapping_tensors(tmp_path: Path) -> None:
    path = tmp_path / "o.gguf"
    with GGUFWriter(path) as w:
        w.add_tensor("a", np.zeros(16, np.float32))
        w.add_tensor("b", np.zeros(16, np.float32))
        w.add_raw_tensor_info("c", (16,), GGMLType.F32, 32)  # the second half of a and the first of b
    expect_error(path, "overlap", "'c'")


def test_unaligned_tensor_offset(tmp_path: Path) -> None:
    path = tmp_path / "o.gguf"
    with GGUFWriter(path) as w:
        w.add_tensor("a", np.zeros(16, np.float32))
        w.add_raw_tensor_info("b", (1,), GGMLType.F32, 4)
    expect_error(path, "'b'", "not a multiple of the alignment 32")


@pytest.mark.parametrize("type_id", [4, 5, 99, 2**32 - 1])
def test_unknown_tensor_type(tmp_path: Path, type_id: int) -> None:
    path = tmp_path / "t.gguf"
    with GGUFWriter(path) as w:
        w.add_raw_tensor_info("w", (32,), type_id, 0)
    expect_error(path, f"unknown ggml type id {type_id}", "'w'", error=QuantError)


@pytest.mark.parametrize("shape, fragment", [
    ((1, 1, 1, 1, 1), "5 dimensions"),
    ((4, 0), "dimension 1 is 0"),
    ((2**63,), "dimension 0 is 9223372036854775808"),
    ((2**32, 2**32), "more than int64"),
    ((33,), "not a multiple of its block size 32"),
])
def test_bad_tensor_shapes(tmp_path: Path, shape: tuple[int, ...], fragment: str) -> None:
    path = tmp_path / "s.gguf"
    with GGUFWriter(path) as w:
        w.add_raw_tensor_info("w", shape, GGMLType.Q8_0 if fragment.startswith("not a") else GGMLType.F32, 0)
    expect_error(path, fragment)


def test_tensor_name_too_long(tmp_path: Path) -> None:
    path = tmp_path / "n.gguf"
    with GGUFWriter(path) as w:
        w.add_tensor("x" * 64, np.zeros(1, np.float32))
    expect_error(path, "longer than 63 bytes")


@pytest.mark.parametrize("alignment, vtype", [(48, VT.UINT32), (0, VT.UINT32), (32.0, VT.FLOAT32)])
def test_bad_alignment(tmp_path: Path, alignment, vtype: VT) -> None:
    path = tmp_path / "a.gguf"
    with GGUFWriter(path) as w:
        w.add(KEY_ALIGNMENT, alignment, vtype)
    expect_error(path, "general.alignment must be a power of two")


def test_not_a_file(tmp_path: Path) -> None:
    expect_error(tmp_path / "nope.gguf", "no such file")
    expect_error(tmp_path, "is a directory")
    (tmp_path / "empty.gguf").write_bytes(b"")
    expect_error(tmp_path / "empty.gguf", "empty file")
    (tmp_path / "tiny.gguf").write_bytes(b"GG")
    expect_error(tmp_path / "tiny.gguf", "too short")
    if Path("/dev/null").exists():
        expect_error(Path("/dev/null"), "not a regular file")
    with pytest.raises(GGUFError, match="mode must be"):
        GGUFFile(tmp_path / "x.gguf", mode="write")  # type: ignore[arg-type]


def test_errors_belong_to_the_hierarchy() -> None:
    assert issubclass(GGUFError, LLMFWError) and issubclass(QuantError, LLMFWError)
