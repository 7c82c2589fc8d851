"""Saved prompt state: a context's KV cells, token records and sampler RNG in one file (llama.cpp's
``llama_state_save_file`` / ``llama_state_load_file``, our own format).

Layout::

    magic  b"LLMFWKV\\0"            8 bytes
    version                          uint32 little-endian (FORMAT_VERSION)
    header length                    uint32
    header                           UTF-8 JSON: model sha256, architecture, context shape (n_ctx, n_seq_max,
                                     each cache's name / cells / layers), token records, sampler RNG states,
                                     and the list of arrays that follow (name, dtype, shape)
    arrays                           raw little-endian arrays, in the header's order: per cache the used cells'
                                     indices, positions, sequence bits and pending shifts, then per layer the K
                                     and V rows of those cells (float32 [n_head_kv, n_used, head_dim]); then, for
                                     a recurrent or hybrid memory, each sequence's last position (``rs.pos``) and
                                     every recurrent state whole (``rs.<kind>.<layer>``, [n_seq_max, ...])
    sha256 of the arrays             32 bytes

Only cells that hold a token are written, so a 1,000-token prompt costs 1,000 cells whatever n_ctx is.
Loading reads and checks the whole file first — magic, version, model sha256, context shape, sizes, checksum —
and only then replaces the context's cells: a bad file raises a :class:`ContextError` that names the problem
and leaves the context as it was. Logits are not saved: decode the last token again after a load
(``generate`` does, since it always re-decodes the final prompt token).
"""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
import os
from typing import Any, Protocol, Sequence

import numpy as np

from ..errors import ContextError
from .memory import CompositeMemory, KVCache, Memory
from .recurrent import HybridMemory, RecurrentMemory



class StateModel(Protocol):
    @property
    def sha256(self) -> str: ...

    @property
    def arch_name(self) -> str: ...


class SavedContext(Protocol):
    """What saving and loading read of a context (:class:`~.context.Context`, one module up, calls them)."""

    @property
    def model(self) -> StateModel: ...

    @property
    def memory(self) -> Memory: ...

    @property
    def n_ctx(self) -> int: ...

    @property
    def n_seq_max(self) -> int: ...

    @property
    def seq_tokens(self) -> list[list[int]]: ...


class SamplerRng(Protocol):
    """A sampler's random state, saved and restored with the context (``MT19937Rng`` fills it in)."""

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None: ...


class SeededSampler(Protocol):
    @property
    def rng(self) -> SamplerRng | None: ...


class SamplerChainState(Protocol):
    """What a saved state reads of a sampler chain (``llmfw.core.generation.sampling.SamplerChain``, one layer
    up): its samplers' random states."""

    @property
    def samplers(self) -> Sequence[SeededSampler]: ...

MAGIC = b"LLMFWKV\0"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")
#: a header larger than this is not ours (it holds token records: 16 MiB is millions of tokens)
MAX_HEADER_BYTES = 16 << 20
_DIGEST_BYTES = 32


# -- what is saved -------------------------------------------------------------------------------------------
def _caches(ctx: SavedContext) -> list[KVCache]:
    """The context's KV caches (one, or the parts of a composite memory such as iSWA, or a hybrid's)."""
    memory = ctx.memory
    if isinstance(memory, CompositeMemory):
        return list(memory.parts)
    if isinstance(memory, KVCache):
        return [memory]
    if isinstance(memory, HybridMemory):
        return [memory.kv] if memory.kv.layers else []
    if isinstance(memory, RecurrentMemory):
        return []
    raise ContextError(f"saving the state of a {type(memory).__name__} memory is not supported")


def _recurrent(ctx: SavedContext) -> RecurrentMemory | None:
    """The context's recurrent states (saved whole: one row per sequence per state), if it has any."""
    memory = ctx.memory
    if isinstance(memory, HybridMemory):
        return memory.recurrent
    return memory if isinstance(memory, RecurrentMemory) else None


def _shape(ctx: SavedContext) -> dict[str, Any]:
    """The context shape a state file must match to be loaded."""
    return {"n_ctx": int(ctx.n_ctx), "n_seq_max": int(ctx.n_seq_max),
            "caches": [{"name": c.name, "n_cells": int(c.n_cells), "layers": [int(il) for il in c.layers]}
                       for c in _caches(ctx)]}


def _rng_states(sampler: SamplerChainState | None) -> list[dict[str, Any] | None]:
    samplers = sampler.samplers if sampler is not None else []
    return [s.rng.get_state() if s.rng is not None else None for s in samplers]


def _arrays(ctx: SavedContext) -> list[tuple[str, np.ndarray]]:
    arrays: list[tuple[str, np.ndarray]] = []
    for cache in _caches(ctx):
        used = np.flatnonzero(cache.cells.seq).astype(np.int64)
        arrays += [(f"{cache.name}.cells", used), (f"{cache.name}.pos", cache.cells.pos[used]),
                   (f"{cache.name}.seq", cache.cells.seq[used]), (f"{cache.name}.shift", cache.cells.shift[used])]
        for il in cache.layers:
            k, v = cache._backends[il].read_kv_cells(cache.storage[(cache.name, il)], used)
            arrays += [(f"{cache.name}.{il}.k", np.asarray(k, dtype=np.float32)),
                       (f"{cache.name}.{il}.v", np.asarray(v, dtype=np.float32))]
    recurrent = _recurrent(ctx)
    if recurrent is not None:
        arrays += recurrent.state_arrays()
    return arrays


def save_state_file(ctx: SavedContext, path: str | os.PathLike[str], tokens: Sequence[int] | None = None,
                    sampler: SamplerChainState | None = None) -> int:
    """Write ``ctx``'s state to ``path``; ``tokens`` (default: the record of sequence 0) is what
    :func:`load_state_file` returns. Returns the bytes written."""
    records = {seq: [int(t) for t in r] for seq, r in enumerate(ctx.seq_tokens) if r}
    if tokens is not None:
        records[0] = [int(t) for t in tokens]
    arrays = _arrays(ctx)
    header = {"model_sha256": ctx.model.sha256, "arch": ctx.model.arch_name, "shape": _shape(ctx),
              "head": [int(c.cells.head) for c in _caches(ctx)], "has_shift": [bool(c.has_shift) for c in _caches(ctx)],
              "tokens": records.get(0, []), "records": {str(s): r for s, r in records.items()},
              "rng": _rng_states(sampler),
              "arrays": [{"name": n, "dtype": a.dtype.str, "shape": list(a.shape)} for n, a in arrays]}
    blob = json.dumps(header).encode()
    digest = hashlib.sha256()
    path = Path(path)
    try:
        with path.open("wb") as fh:
            fh.write(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(blob)))
            fh.write(blob)
            for _, a in arrays:
                data = np.ascontiguousarray(a).tobytes()
                digest.update(data)
                fh.write(data)
            fh.write(digest.digest())
            return fh.tell()
    except OSError as exc:
        raise ContextError(f"{path}: cannot write the state file: {exc.strerror or exc}") from None


# -- loading ---------------------------------------------------------------------------------------------------
def _read_header(path: Path, fh: Any, file_size: int) -> dict[str, Any]:
    prefix = fh.read(_PREFIX.size)
    if len(prefix) < _PREFIX.size:
        raise ContextError(f"{path}: not a state file (truncated: {len(prefix)} bytes)")
    magic, version, n_header = _PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ContextError(f"{path}: not an llmfw state file (bad magic {magic!r})")
    if version != FORMAT_VERSION:
        raise ContextError(f"{path}: state file version {version}, this llmfw reads version {FORMAT_VERSION}")
    if n_header > min(MAX_HEADER_BYTES, file_size - _PREFIX.size):
        raise ContextError(f"{path}: the state file is truncated or corrupt (header of {n_header} bytes)")
    try:
        header = json.loads(fh.read(n_header).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ContextError(f"{path}: the state file header is corrupt ({exc})") from None
    if not isinstance(header, dict):
        raise ContextError(f"{path}: the state file header is corrupt (not a JSON object)")
    return header


def _check_matches(path: Path, header: dict[str, Any], ctx: SavedContext) -> None:
    if header.get("model_sha256") != ctx.model.sha256:
        raise ContextError(f"{path}: the state was saved with another model (sha256 {header.get('model_sha256')}, "
                           f"this model is {ctx.model.sha256})")
    if header.get("shape") != _shape(ctx):
        raise ContextError(f"{path}: the state was saved with context shape {header.get('shape')}, this context "
                           f"is {_shape(ctx)}")


def _expected_arrays(path: Path, header: dict[str, Any], ctx: SavedContext) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """The arrays this context expects, with the counts the header declares — checked against the context
    before a byte is allocated for them."""
    declared = {a.get("name"): a for a in header.get("arrays", []) if isinstance(a, dict)}
    expected: list[tuple[str, np.dtype, tuple[int, ...]]] = []
    for cache in _caches(ctx):
        cells = declared.get(f"{cache.name}.cells", {}).get("shape", [None])
        n_used = cells[0] if isinstance(cells, list) and len(cells) == 1 else None
        if not isinstance(n_used, int) or not 0 <= n_used <= cache.n_cells:
            raise ContextError(f"{path}: the state file is corrupt (cache {cache.name!r} cell count {n_used})")
        expected += [(f"{cache.name}.cells", np.dtype("<i8"), (n_used,)), (f"{cache.name}.pos", np.dtype("<i8"), (n_used,)),
                     (f"{cache.name}.seq", np.dtype("<u8"), (n_used,)), (f"{cache.name}.shift", np.dtype("<i8"), (n_used,))]
        for il in cache.layers:
            shape = cache.layer_shape(il)
            expected += [(f"{cache.name}.{il}.k", np.dtype("<f4"), (shape.n_head_kv, n_used, shape.head_dim_k)),
                         (f"{cache.name}.{il}.v", np.dtype("<f4"), (shape.n_head_kv, n_used, shape.head_dim_v))]
    recurrent = _recurrent(ctx)
    if recurrent is not None:
        expected += [(name, a.dtype.newbyteorder("<"), a.shape) for name, a in recurrent.state_arrays()]
    found = [(a.get("name"), a.get("dtype"), tuple(a.get("shape", ()))) for a in header.get("arrays", [])
             if isinstance(a, dict)]
    if found != [(n, d.str, s) for n, d, s in expected]:
        raise ContextError(f"{path}: the state file's arrays do not match this context's caches")
    return expected


def _read_arrays(path: Path, fh: Any, expected: list[tuple[str, np.dtype, tuple[int, ...]]],
                 remaining: int) -> dict[str, np.ndarray]:
    need = sum(int(np.prod(s)) * d.itemsize for _, d, s in expected) + _DIGEST_BYTES
    if remaining != need:
        what = "truncated" if remaining < need else "has trailing bytes"
        raise ContextError(f"{path}: the state file is {what} ({remaining} bytes after the header, expected {need})")
    digest = hashlib.sha256()
    arrays: dict[str, np.ndarray] = {}
    for name, dtype, shape in expected:
        data = fh.read(int(np.prod(shape)) * dtype.itemsize)
        digest.update(data)
        arrays[name] = np.frombuffer(data, dtype=dtype).reshape(shape)
    if fh.read(_DIGEST_BYTES) != digest.digest():
        raise ContextError(f"{path}: the state file is corrupt (checksum mismatch)")
    return arrays


def _check_cells(path: Path, ctx: SavedContext, arrays: dict[str, np.ndarray]) -> None:
    for cache in _caches(ctx):
        cells = arrays[f"{cache.name}.cells"]
        seq = arrays[f"{cache.name}.seq"]
        if cells.size and (cells.min() < 0 or cells.max() >= cache.n_cells or np.unique(cells).size != cells.size):
            raise ContextError(f"{path}: the state file is corrupt (cell indices out of range or repeated)")
        if np.any(seq == 0) or np.any(seq >> np.uint64(cache.n_seq_max)) or np.any(arrays[f"{cache.name}.pos"] < 0):
            raise ContextError(f"{path}: the state file is corrupt (cells without a sequence or position)")


def _records(path: Path, header: dict[str, Any], n_seq_max: int) -> dict[int, list[int]]:
    try:
        records = {int(s): [int(t) for t in r] for s, r in header.get("records", {}).items()}
        tokens = [int(t) for t in header.get("tokens", [])]
    except (TypeError, ValueError, AttributeError):
        raise ContextError(f"{path}: the state file's token records are corrupt") from None
    if any(not 0 <= s < n_seq_max for s in records):
        raise ContextError(f"{path}: the state file's token records name sequences outside 0..{n_seq_max - 1}")
    records[0] = tokens
    return records


def _apply(ctx: SavedContext, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    for i, cache in enumerate(_caches(ctx)):
        cache.clear()
        cells = arrays[f"{cache.name}.cells"]
        cache.cells.pos[cells] = arrays[f"{cache.name}.pos"]
        cache.cells.seq[cells] = arrays[f"{cache.name}.seq"]
        cache.cells.shift[cells] = arrays[f"{cache.name}.shift"]
        cache.cells.head = int(header["head"][i])
        cache.has_shift = bool(header["has_shift"][i])
        for il in cache.layers:
            cache._backends[il].write_kv_cells(cache.storage[(cache.name, il)], cells,
                                               arrays[f"{cache.name}.{il}.k"], arrays[f"{cache.name}.{il}.v"])
    recurrent = _recurrent(ctx)
    if recurrent is not None:
        recurrent.load_state_arrays(arrays)


def _restore_rng(path: Path, header: dict[str, Any], sampler: SamplerChainState | None) -> None:
    if sampler is None:
        return
    samplers = sampler.samplers
    states = header.get("rng", [])
    if not isinstance(states, list) or len(states) != len(samplers):
        raise ContextError(f"{path}: the state holds {len(states) if isinstance(states, list) else '?'} sampler "
                           f"RNG entries; this sampler chain has {len(samplers)} samplers")
    for s, state in zip(samplers, states):
        if state is not None and s.rng is not None:
            s.rng.set_state(state)


def load_state_file(ctx: SavedContext, path: str | os.PathLike[str], sampler: SamplerChainState | None = None) -> list[int]:
    """Replace ``ctx``'s KV cells and token records with those in ``path`` (and ``sampler``'s RNG state when
    given); returns the saved tokens. Everything is checked before the context changes."""
    path = Path(path)
    try:
        file_size = path.stat().st_size
        with path.open("rb") as fh:
            header = _read_header(path, fh, file_size)
            _check_matches(path, header, ctx)
            expected = _expected_arrays(path, header, ctx)
            arrays = _read_arrays(path, fh, expected, file_size - fh.tell())
    except OSError as exc:
        raise ContextError(f"{path}: cannot read the state file: {exc.strerror or exc}") from None
    _check_cells(path, ctx, arrays)
    records = _records(path, header, ctx.n_seq_max)
    if not (isinstance(header.get("head"), list) and isinstance(header.get("has_shift"), list)
            and len(header["head"]) == len(header["has_shift"]) == len(_caches(ctx))):
        raise ContextError(f"{path}: the state file header is corrupt (cache heads)")
    if sampler is not None:
        _restore_rng(path, header, sampler)
    _apply(ctx, header, arrays)
    for seq, record in enumerate(ctx.seq_tokens):  # in place: the serving engine and generate hold these lists
        record[:] = records.get(seq, [])
    return list(records[0])
