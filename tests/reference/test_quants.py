"""ggml tensor types: dequantization and quantization, cross-checked against the `gguf` package's reference."""
from __future__ import annotations

from collections.abc import Iterator

import gguf
import gguf.quants
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from llmfw.core.errors import QuantError
from llmfw.core.gguf import open_gguf
from llmfw.core.quants import (
    SUPPORTED_DEQUANT,
    SUPPORTED_QUANT,
    TYPE_INFO,
    GGMLType,
    block_view,
    dequantize,
    dequantize_rows,
    quantize,
    tensor_nbytes,
)

from support.block_fields import F16_FIELDS

T = GGMLType
# Types the gguf package can decode (the cross-check reference); I8..I64 and F64 are checked against numpy.
GGUF_DEQUANT_TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
                      T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
INTEGER_TYPES = {T.I8: np.int8, T.I16: np.int16, T.I32: np.int32, T.I64: np.int64, T.F64: np.float64}
GGUF_QUANT_TYPES = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]

# Per element type: (numpy uint dtype of its bits, exponent mask, one exponent bit to clear to make it finite)
FLOAT_BITS = {T.F16: (np.uint16, 0x7C00, 0x4000), T.BF16: (np.uint16, 0x7F80, 0x4000),
              T.F32: (np.uint32, 0x7F800000, 0x40000000)}


def reference_dequantize(raw: np.ndarray, qtype: GGMLType, ne: tuple[int, ...]) -> np.ndarray:
    """gguf's dequantize of bytes laid out as rows (numpy shape reversed(ne[1:]) + (row_bytes,))."""
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(*reversed(ne[1:]), -1)
    return np.asarray(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(int(qtype))), dtype=np.float32)


def reference_quantize(values: np.ndarray, qtype: GGMLType) -> np.ndarray:
    with np.errstate(all="ignore"):  # gguf warns where a block's scale underflows; its bytes are still ggml's
        quantized = gguf.quants.quantize(values, gguf.GGMLQuantizationType(int(qtype)))
    return np.ascontiguousarray(quantized).view(np.uint8)


def make_finite(bits: np.ndarray, exponent_mask: int, clear_bit: int) -> np.ndarray:
    """Turn every inf/NaN bit pattern into a finite value by clearing one exponent bit."""
    mask = bits.dtype.type(exponent_mask)
    bits[(bits & mask) == mask] &= bits.dtype.type(~clear_bit & np.iinfo(bits.dtype).max)
    return bits


def random_tensor_bytes(rng: np.random.Generator, qtype: GGMLType, ne: tuple[int, ...]) -> np.ndarray:
    """Random bytes of a tensor, every float field (scales, or the elements of F16/BF16/F32) finite."""
    raw = rng.integers(0, 256, tensor_nbytes(qtype, ne), dtype=np.uint8)
    if qtype in FLOAT_BITS:
        dtype, exponent_mask, clear_bit = FLOAT_BITS[qtype]
        make_finite(raw.view(dtype), exponent_mask, clear_bit)
    for offset in F16_FIELDS.get(qtype, []):
        blocks = raw.reshape(-1, TYPE_INFO[qtype].type_size)
        scales = np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.uint16)
        blocks[:, offset:offset + 2] = make_finite(scales, 0x7C00, 0x4000).view(np.uint8)
    return raw


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(20261129)


# ---------------------------------------------------------------------------------------------- dequantization

@pytest.mark.parametrize("qtype", GGUF_DEQUANT_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_gguf(qtype: GGMLType, rng: np.random.Generator) -> None:
    ne = (TYPE_INFO[qtype].block_size * 3, 5, 7)  # three dimensions: checks the ggml -> numpy shape order too
    raw = random_tensor_bytes(rng, qtype, ne)
    ours = dequantize(raw, qtype, ne)
    assert ours.dtype == np.float32 and ours.shape == (7, 5, ne[0])
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, reference_dequantize(raw, qtype, ne), rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", list(INTEGER_TYPES), ids=lambda t: t.name)
def test_integer_and_f64_types_convert_to_float32(qtype: GGMLType, rng: np.random.Generator) -> None:
    values = rng.integers(-100_000, 100_000, size=(3, 4)).astype(INTEGER_TYPES[qtype])
    ours = dequantize(values.tobytes(), qtype, (4, 3))
    np.testing.assert_array_equal(ours, values.astype(np.float32))


def test_supported_sets_cover_the_issue() -> None:
    assert set(GGUF_DEQUANT_TYPES) | set(INTEGER_TYPES) <= SUPPORTED_DEQUANT
    assert {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F32, T.F16, T.BF16} <= SUPPORTED_QUANT


def test_accepts_bytes_memoryview_and_arrays_alike(rng: np.random.Generator) -> None:
    ne = (64, 3)
    raw = random_tensor_bytes(rng, T.Q8_0, ne)
    expected = dequantize(raw, T.Q8_0, ne)
    for form in (raw.tobytes(), bytearray(raw.tobytes()), memoryview(raw.tobytes()), raw.view(np.int8)):
        np.testing.assert_array_equal(dequantize(form, int(T.Q8_0), list(ne)), expected)


def test_dequantize_returns_a_new_writable_array(rng: np.random.Generator) -> None:
    raw = random_tensor_bytes(rng, T.F32, (8,))
    values = dequantize(raw, T.F32, (8,))
    values[:] = 0
    assert raw.view(np.float32).any()  # the caller's bytes were not aliased


def row_chunks(n_rows: int, row_elements: int, max_elements: int = 1 << 22) -> Iterator[slice]:
    step = max(1, max_elements // max(1, row_elements))
    for start in range(0, n_rows, step):
        yield slice(start, min(n_rows, start + step))


def open_raw_tensors(path) -> Iterator[tuple[str, GGMLType, tuple[int, ...], np.ndarray]]:
    """(name, type, ne, raw bytes as rows) for every tensor, read with llmfw's GGUF reader (mmap views).

    gguf.GGUFReader would do too, but it needs 15 s (SmolLM2) to 80 s (Gemma-3) here to parse the vocabularies;
    the two readers' bytes are compared by tests/reference/test_gguf_crosscheck.py."""
    with open_gguf(path) as model:
        for info in model.tensors.values():
            raw = model.tensor_bytes(info.name)
            yield info.name, info.ggml_type, info.shape, raw.reshape(-1, tensor_nbytes(info.ggml_type, info.shape[:1]))


def read_tensor(path, name: str) -> tuple[GGMLType, tuple[int, ...], np.ndarray]:
    with open_gguf(path) as model:
        info = model.tensor_info(name)
        return info.ggml_type, info.shape, np.array(model.tensor_bytes(name))


@pytest.mark.parametrize("model, types", [
    ("smollm2_path", {T.F32, T.Q4_1, T.Q8_0}),
    ("gemma3_path", {T.F32, T.Q5_0, T.Q4_K, T.Q6_K, T.Q8_0}),
])
def test_every_tensor_of_the_real_models_matches_gguf(model: str, types: set[GGMLType],
                                                       request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(model)
    n_tensors, seen_types = 0, set()
    for name, qtype, ne, rows in open_raw_tensors(path):
        # Large tables (Gemma's 262144 x 640 token_embd) go in row chunks to keep memory modest.
        for chunk in row_chunks(rows.shape[0], ne[0]):
            part = rows[chunk]
            part_ne = (ne[0], part.shape[0])
            ours = dequantize(part, qtype, part_ne)
            reference = reference_dequantize(part, qtype, part_ne)
            np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=0, err_msg=f"{name} ({qtype.name})")
        n_tensors += 1
        seen_types.add(qtype)
    assert n_tensors > 100 and seen_types == types


def test_whole_tensor_shape_of_a_real_model(smollm2_path) -> None:
    qtype, ne, raw = read_tensor(smollm2_path, "blk.0.ffn_down.weight")
    values = dequantize(raw, qtype, ne)
    assert qtype == T.Q4_1 and values.shape == tuple(reversed(ne)) == (576, 1536)
    np.testing.assert_allclose(values, reference_dequantize(raw, qtype, ne), rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------- selected rows

def test_dequantize_rows_of_a_quantized_embedding_table(smollm2_path) -> None:
    qtype, ne, raw = read_tensor(smollm2_path, "token_embd.weight")
    token_ids = np.array([[0, 1, 49151], [17, 17, 3000]])
    rows = dequantize_rows(raw, qtype, ne, token_ids)
    assert rows.shape == (2, 3, ne[0])
    full = reference_dequantize(raw, qtype, ne)
    np.testing.assert_array_equal(rows, full[token_ids])


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_0, T.F16], ids=lambda t: t.name)
def test_dequantize_rows_counts_rows_over_all_higher_dimensions(qtype: GGMLType, rng) -> None:
    ne = (TYPE_INFO[qtype].block_size, 4, 3)
    raw = random_tensor_bytes(rng, qtype, ne)
    full = dequantize(raw, qtype, ne).reshape(-1, ne[0])
    np.testing.assert_array_equal(dequantize_rows(raw, qtype, ne, [11, 0, 5]), full[[11, 0, 5]])
    assert dequantize_rows(raw, qtype, ne, np.array([], dtype=np.int64)).shape == (0, ne[0])


@pytest.mark.parametrize("bad_rows", [[12], [-1], [0.5]])
def test_dequantize_rows_rejects_bad_indices(bad_rows, rng) -> None:
    ne = (32, 4, 3)
    raw = random_tensor_bytes(rng, T.Q8_0, ne)
    with pytest.raises(QuantError, match="row ind"):
        dequantize_rows(raw, T.Q8_0, ne, np.array(bad_rows))


# ---------------------------------------------------------------------------------------------- quantization

def test_quantize_matches_gguf_bytes_on_random_data(rng: np.random.Generator) -> None:
    rows = rng.standard_normal((48, 256)).astype(np.float32)
    rows[1] *= 1e-4
    rows[2] *= 3e3
    rows[3] = 0.0                          # all-zero blocks: d = 0, id = 0
    rows[4] = 1.25                         # constant blocks: Q4_1/Q5_1 range 0
    rows[5, ::5] *= 50                     # outliers
    rows[6] = np.round(rows[6] * 8) / 8    # exact ties at the rounding boundaries
    rows[7, :32] = -rows[7, :32]
    for qtype in GGUF_QUANT_TYPES:
        ours = quantize(rows, qtype)
        assert ours.dtype == np.uint8 and ours.shape == (48, tensor_nbytes(qtype, (256,)))
        np.testing.assert_array_equal(ours, reference_quantize(rows, qtype), err_msg=qtype.name)


finite_blocks = hnp.arrays(
    np.float32, st.tuples(st.integers(1, 4), st.just(64)),
    elements=st.floats(-6e4, 6e4, width=32, allow_nan=False, allow_infinity=False) | st.sampled_from([0.0, 1e-40]),
)


@settings(max_examples=60, deadline=None)
@given(values=finite_blocks)
def test_quantize_matches_gguf_bytes_on_any_finite_values(values: np.ndarray) -> None:
    # ggml keeps +0.0 as the max of an all-zero block where gguf may pick up a -0.0 from the data; the decoded
    # values are the same, only the sign bit of d differs, so signed zeros are left out here.
    values = values + np.float32(0.0)
    for qtype in GGUF_QUANT_TYPES:
        ours = quantize(values, qtype)
        np.testing.assert_array_equal(ours, reference_quantize(values, qtype), err_msg=qtype.name)


def block_stats(values: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    blocks = values.reshape(-1, block_size)
    return np.abs(blocks).max(axis=1, keepdims=True), np.ptp(blocks, axis=1, keepdims=True)


# Worst-case error of one element, from its block's max |x| and range: half a quantization step (a full
# step for the symmetric types' one-sided clamp), plus the f16 rounding of the stored scale and minimum.
# Then the typical error: the largest per-row RMS error relative to the row's RMS, for Gaussian rows (the values
# measured are about two thirds of these limits: 0.089, 0.083, 0.045, 0.041, 0.0057, 2.2e-4, 1.8e-3).
ERROR_BOUNDS = {
    T.Q4_0: (lambda amax, span: amax / 8 + amax * 2.0 ** -10, 0.13),
    T.Q4_1: (lambda amax, span: span / 30 + (span + amax) * 2.0 ** -10, 0.12),
    T.Q5_0: (lambda amax, span: amax / 16 + amax * 2.0 ** -10, 0.065),
    T.Q5_1: (lambda amax, span: span / 62 + (span + amax) * 2.0 ** -10, 0.06),
    T.Q8_0: (lambda amax, span: amax / 254 + amax * 2.0 ** -10, 0.008),
    T.F16: (lambda amax, span: amax * 2.0 ** -11, 3e-4),
    T.BF16: (lambda amax, span: amax * 2.0 ** -8, 2.5e-3),
    T.F32: (lambda amax, span: 0 * amax, 0.0),
}


@pytest.mark.parametrize("qtype", list(ERROR_BOUNDS), ids=lambda t: t.name)
def test_quantize_round_trip_error_is_bounded(qtype: GGMLType, rng: np.random.Generator) -> None:
    values = (rng.standard_normal((16, 512)) * rng.uniform(1e-3, 10, size=(16, 1))).astype(np.float32)
    decoded = dequantize(quantize(values, qtype), qtype, (512, 16))
    worst_case, typical = ERROR_BOUNDS[qtype]
    block_size = max(TYPE_INFO[qtype].block_size, 32)
    amax, span = block_stats(values, block_size)
    error = decoded - values
    assert (np.abs(error).reshape(-1, block_size) <= worst_case(amax, span) * 1.0001).all()
    relative_rms = np.sqrt(np.mean(error ** 2, axis=1) / np.mean(values ** 2, axis=1))
    assert relative_rms.max() <= typical


def test_quantize_keeps_leading_dimensions_and_accepts_float64(rng: np.random.Generator) -> None:
    values = rng.standard_normal((2, 3, 64))
    raw = quantize(values, T.Q8_0)
    assert raw.shape == (2, 3, 2 * 34)
    np.testing.assert_array_equal(raw, quantize(values.astype(np.float32), T.Q8_0))


# ---------------------------------------------------------------------------------------------- bad input

def test_wrong_byte_length_is_rejected() -> None:
    with pytest.raises(QuantError, match=r"Q8_0 tensor of shape \(64, 2\) needs 136 bytes, got 135"):
        dequantize(np.zeros(135, np.uint8), T.Q8_0, (64, 2))
    with pytest.raises(QuantError, match="needs"):
        dequantize_rows(b"\0" * 10, T.F32, (4,), [0])


def test_unknown_type_id_is_rejected() -> None:
    with pytest.raises(QuantError, match="unknown ggml tensor type id 99"):
        dequantize(b"\0" * 4, 99, (1,))
    with pytest.raises(QuantError, match="unknown ggml tensor type id 4"):
        quantize(np.zeros(32, np.float32), 4)  # 4 and 5 were Q4_2/Q4_3, removed from ggml


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.Q8_K, T.TQ2_0])
def test_unsupported_dequant_type_is_named(qtype: GGMLType) -> None:
    ne = (256,)
    with pytest.raises(QuantError, match=f"dequantization of {qtype.name} tensors is not supported"):
        dequantize(np.zeros(tensor_nbytes(qtype, ne), np.uint8), qtype, ne)


def test_unsupported_quant_type_is_named() -> None:
    with pytest.raises(QuantError, match="quantization of Q4_K tensors is not supported"):
        quantize(np.zeros(256, np.float32), T.Q4_K)


def test_rows_that_are_not_whole_blocks_are_rejected() -> None:
    with pytest.raises(QuantError, match="row length 48 is not a multiple of the block size 32"):
        dequantize(np.zeros(100, np.uint8), T.Q4_0, (48, 2))
    with pytest.raises(QuantError, match="row length 128 is not a multiple of the block size 256"):
        dequantize(b"", T.Q6_K, (128, 0))
    with pytest.raises(QuantError, match="not a multiple of the block size 32"):
        quantize(np.zeros((2, 48), np.float32), T.Q5_0)


@pytest.mark.parametrize("shape", [(), (-32, 2), ("a",)])
def test_malformed_shapes_are_rejected(shape) -> None:
    with pytest.raises(QuantError, match="shape"):
        dequantize(b"", T.F32, shape)


@pytest.mark.parametrize("bad", [np.array([1.0, np.nan] * 16), np.array([np.inf] * 32)])
def test_non_finite_values_cannot_be_block_quantized(bad: np.ndarray) -> None:
    with pytest.raises(QuantError, match="non-finite"):
        quantize(bad, T.Q4_0)


def test_quantize_rejects_scalars_and_non_numbers() -> None:
    with pytest.raises(QuantError, match="scalar"):
        quantize(np.float32(1.0), T.Q8_0)
    with pytest.raises(QuantError, match="dtype"):
        quantize(np.array(["a"] * 32), T.Q8_0)


def test_raw_data_of_the_wrong_kind_is_rejected() -> None:
    with pytest.raises(QuantError, match="bytes or a numpy array"):
        dequantize([0, 1, 2, 3], T.I8, (4,))
    with pytest.raises(QuantError, match="dtype object"):
        dequantize(np.array([b"ab", None], dtype=object), T.I8, (2,))


def test_nan_and_inf_scales_decode_as_in_ggml() -> None:
    block = np.zeros(34, np.uint8)
    block[:2] = np.array([np.inf], np.float16).view(np.uint8)
    block[2:4] = [0, 1]  # q = 0 -> 0 * inf = NaN, q = 1 -> inf
    values = dequantize(block, T.Q8_0, (32,))
    assert np.isnan(values[0]) and values[1] == np.inf


# ---------------------------------------------------------------------------------------------- block view

def test_block_view_is_zero_copy_and_shaped_by_rows_and_blocks(rng: np.random.Generator) -> None:
    ne = (64, 3, 2)
    raw = random_tensor_bytes(rng, T.Q4_1, ne)
    blocks = block_view(raw, T.Q4_1, ne)
    assert blocks.shape == (2, 3, 2, 20) and np.shares_memory(blocks, raw)
    first_block = dequantize(blocks[0, 0, 0], T.Q4_1, (32,))
    np.testing.assert_array_equal(first_block, dequantize(raw, T.Q4_1, ne)[0, 0, :32])
