"""Cross-check the reader against the `gguf` package's GGUFReader on both real models (gguf is test-only)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llmfw.core.gguf import GGUFValueType, open_gguf

gguf = pytest.importorskip("gguf")


def _reference_value(field) -> object:
    """A GGUFReader field's value in our representation (numeric arrays as numpy, strings as str)."""
    types = [GGUFValueType(int(t)) for t in field.types]
    if types[0] != GGUFValueType.ARRAY:
        return field.contents()
    if types[1] in (GGUFValueType.STRING, GGUFValueType.ARRAY):
        return field.contents()
    return np.concatenate([field.parts[i] for i in field.data]) if field.data else np.array([])


# GGUFReader needs about half a minute for Gemma-3's 262144-token vocabulary on a busy 2-core machine
@pytest.mark.parametrize("model", ["smollm2_path", pytest.param("gemma3_path", marks=pytest.mark.slow)])
def test_matches_gguf_package(model: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(model)
    reference = gguf.GGUFReader(path)
    with open_gguf(path) as ours:
        ref_fields = {k: f for k, f in reference.fields.items() if not k.startswith("GGUF.")}
        assert list(ours.metadata) == list(ref_fields)
        for key, field in ref_fields.items():
            types = [GGUFValueType(int(t)) for t in field.types]
            assert ours.metadata_types[key] == types[0], key
            if types[0] == GGUFValueType.ARRAY:
                assert ours.metadata_array_types[key] == types[1], key
            expected, got = _reference_value(field), ours.metadata[key]
            if isinstance(got, np.ndarray):
                assert got.dtype == expected.dtype, key
                np.testing.assert_array_equal(got, expected, err_msg=key)
            elif isinstance(got, float):
                assert got == pytest.approx(float(expected), rel=0, abs=0), key
            else:
                assert got == expected, key
        assert list(ours.tensors) == [t.name for t in reference.tensors]
        for ref in reference.tensors:
            info = ours.tensors[ref.name]
            assert info.shape == tuple(int(d) for d in ref.shape), ref.name
            assert int(info.ggml_type) == int(ref.tensor_type), ref.name
            assert info.offset == ref.data_offset, ref.name
            assert info.nbytes == ref.n_bytes, ref.name
            assert info.n_elements == ref.n_elements, ref.name
        first = reference.tensors[0]
        np.testing.assert_array_equal(ours.tensor_bytes(first.name), np.asarray(first.data).view(np.uint8).ravel())
