"""Fuzzing at scale (issue 17): mutated headers, tensor tables and vocabularies of the two real models, and
quantized blocks with NaN / inf scales. Not a timed test; tests/reference/test_fuzz_sample.py runs a small sample.

    python benchmarks/fuzz_gguf.py                              # 10,000 headers + 1,000 vocabs + every quant type
    python benchmarks/fuzz_gguf.py --headers 500 --vocabs 50 --json /tmp/fuzz.json

What one case is:

* **header** — the real model's header (every key, the whole tensor table; the four big tokenizer arrays cut to
  their first 512 entries so a case takes milliseconds, not a second, and ``{arch}.vocab_size`` added to keep
  the model's vocabulary size) with 1-4 byte edits, half of them in the
  tensor table, sometimes truncated, written before a sparse stretch of zero bytes as long as the real tensor data.
  The case opens it with the GGUF reader (every tensor's bytes touched), then does everything ``load_model`` does
  before converting weights: architecture, hyperparameters, vocabulary, layer placement, the check of every
  declared tensor against the table.
* **vocab** — the model's full tokenizer keys with one to three semantic mutations (token texts replaced,
  duplicated, emptied or huge; token types and special ids out of range; NaN scores; malformed merges; arrays of
  the wrong length or element type; another tokenizer model or pre-tokenizer), built into a :class:`Vocab`, then
  used: tokenize with and without special parsing, detokenize, token_to_piece.
* **quant** — every dequantizable type, blocks whose every 16-bit word is NaN, +inf, -inf or random bits with
  NaN / inf words mixed in, through ``dequantize`` and ``dequantize_rows``.

* **repack** — mutated headers (as above) whose file the GGUF reader opens: each tensor the mutation changed, and one that it did
  not, repacked by the native backend and multiplied on each of its ISA paths in turn; **repack_tensors** —
  damaged tensor descriptions (any type id, odd / zero / huge dimensions, byte lengths that miss) straight into the
  repacker. Both need the native extension built (skipped without it).

Each case must end normally or with an :class:`LLMFWError` (anything else is a crash), within 30 s (a
watchdog interrupts it: a hang; the slowest case's time is reported too), and allocate at most the size of its input file: the tracemalloc peak of a second run
(tracing slows Python several times, so the timed run is untraced); every header case is traced, every 10th
vocab case.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import struct
import sys
import tempfile
import time
import tracemalloc
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from llmfw.core.arch.architecture import get_architecture  # noqa: E402
from llmfw.core.errors import LLMFWError  # noqa: E402
from llmfw.core.format.gguf import GGUFValueType, GGUFWriter, open_gguf  # noqa: E402
from llmfw.core.runtime.loader import open_loader  # noqa: E402
from llmfw.core.runtime.model import Model, ModelParams, _place_layers, plan_weights, read_hparams  # noqa: E402
from llmfw.core.format.quants import SUPPORTED_DEQUANT, TYPE_INFO, dequantize, dequantize_rows  # noqa: E402
from llmfw.core.tokenizer.vocab import Vocab  # noqa: E402

#: a case still running after this long counts as a hang: generous, because a hang never ends while a loaded machine
#: may take seconds over a case (the slowest case's time is reported apart, as max_seconds)
TIME_LIMIT_S = 30.0
VOCAB_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges")
KEPT_VOCAB_ENTRIES = 512
VOCAB_TRACE_EVERY = 10
INTERESTING = [0, 1, 2, 3, 5, 7, 8, 9, 13, 31, 32, 33, 255, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62,
               2**63 - 1, 2**63, 2**64 - 1]
TEXTS = ["Hello, world! 123", "<|im_start|>user\nhi<|im_end|>", "<start_of_turn>model\n", "  \t\n ", "",
         "ünïcödé 日本語 🙂", "a" * 300]
F16_SPECIAL = {"nan": 0x7E00, "+inf": 0x7C00, "-inf": 0xFC00}


class Hang(BaseException):
    """Raised by the watchdog; a BaseException, so no ``except Exception`` in the code under test swallows it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise Hang()


@dataclass
class Tally:
    """Outcomes of one kind of case."""

    outcomes: Counter = field(default_factory=Counter)
    crashes: list[str] = field(default_factory=list)
    max_seconds: float = 0.0
    max_peak_fraction: float = 0.0  # tracemalloc peak / input size
    traced: int = 0

    def record(self, outcome: str, seconds: float, detail: str = "") -> None:
        self.outcomes[outcome] += 1
        self.max_seconds = max(self.max_seconds, seconds)
        if outcome in ("crash", "hang", "over-allocation") and len(self.crashes) < 20:
            self.crashes.append(f"{outcome}: {detail}")

    @property
    def cases(self) -> int:
        return sum(self.outcomes.values())

    @property
    def failures(self) -> int:
        return sum(self.outcomes[k] for k in ("crash", "hang", "over-allocation"))

    def summary(self) -> dict[str, Any]:
        return {"cases": self.cases, "outcomes": dict(self.outcomes.most_common()), "failures": self.failures,
                "max_seconds": round(self.max_seconds, 3), "max_alloc_fraction_of_input": round(self.max_peak_fraction, 4),
                "traced_cases": self.traced, "first_failures": self.crashes}


def run_guarded(action: Callable[[], None], limit_s: float = TIME_LIMIT_S) -> tuple[str, float, str]:
    """(outcome, seconds, detail): "ok", "error:<LLMFWError class>", "crash" or "hang"."""
    signal.signal(signal.SIGALRM, _on_alarm)
    start = time.perf_counter()
    try:
        signal.setitimer(signal.ITIMER_REAL, limit_s)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                action()
        finally:  # a Hang may still arrive before the timer is off: the outer handler counts it
            signal.setitimer(signal.ITIMER_REAL, 0)
        outcome, detail = "ok", ""
    except Hang:
        outcome, detail = "hang", f"over {limit_s} s"
    except LLMFWError as exc:
        outcome, detail = f"error:{type(exc).__name__}", ""
    except Exception as exc:  # noqa: BLE001 - what the fuzzer is looking for
        where = traceback.extract_tb(exc.__traceback__)[-1]
        outcome = "crash"
        detail = f"{type(exc).__name__}: {exc} @ {where.filename.split('llmfw/')[-1]}:{where.lineno}"
    return outcome, time.perf_counter() - start, detail


def traced_peak(action: Callable[[], None]) -> int:
    """The tracemalloc peak of ``action`` (its errors ignored; the untraced run already judged them)."""
    tracemalloc.start()
    try:
        run_guarded(action, limit_s=60.0)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------------------------------------------ headers
@dataclass(frozen=True)
class HeaderSeed:
    """A real model's header, re-emitted with the tokenizer arrays cut, as bytes to mutate."""

    name: str
    header: bytes
    table_start: int  # where the tensor table begins
    data_bytes: int  # length of the (sparse) tensor data after the header


def header_seed(model_path: Path, work: Path) -> HeaderSeed:
    target = work / f"seed-{model_path.stem}.gguf"
    with open_gguf(model_path) as gguf:
        writer = GGUFWriter(target)
        for key, value in gguf.metadata.items():
            if key == "general.alignment":
                continue
            kept = value[:KEPT_VOCAB_ENTRIES] if key in VOCAB_ARRAYS else value
            writer.add(key, kept, gguf.metadata_types[key], array_type=gguf.metadata_array_types.get(key))
        vocab_size_key = f"{gguf.metadata['general.architecture']}.vocab_size"
        if vocab_size_key not in gguf.metadata:  # the cut token list must not shrink the model's vocabulary
            writer.add(vocab_size_key, len(gguf.metadata["tokenizer.ggml.tokens"]), GGUFValueType.UINT32)
        data_bytes = 0
        for name, info in gguf.tensors.items():
            relative = info.offset - gguf.data_offsets[info.file_index]
            writer.add_raw_tensor_info(name, info.shape, int(info.ggml_type), relative)
            data_bytes = max(data_bytes, relative + info.nbytes)
        first_tensor = next(iter(gguf.tensors))
        writer.write()
    header = target.read_bytes()
    encoded_name = struct.pack("<Q", len(first_tensor)) + first_tensor.encode()
    return HeaderSeed(model_path.stem, header, header.rindex(encoded_name), data_bytes)


def mutate_header(seed: HeaderSeed, rng: random.Random) -> bytes:
    buf = bytearray(seed.header)
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.5:
            where = rng.randrange(seed.table_start, len(buf))
        else:
            where = rng.randrange(0, seed.table_start)
        kind = rng.random()
        if kind < 0.4:
            new = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 8)))
        elif kind < 0.7:
            new = struct.pack("<I", rng.choice(INTERESTING) & 0xFFFFFFFF)
        else:
            new = struct.pack("<Q", rng.choice(INTERESTING))
        buf[where:where + len(new)] = new[:len(buf) - where]
    if rng.random() < 0.1:
        del buf[rng.randrange(1, len(buf)):]
    return bytes(buf)


def write_sparse(path: Path, header: bytes, data_bytes: int) -> int:
    """The header followed by ``data_bytes`` zero bytes that take no disk space; returns the file size."""
    with path.open("wb") as out:
        out.write(header)
        out.truncate(len(header) + data_bytes)
    return len(header) + data_bytes


def load_like_load_model(path: Path) -> None:
    """Everything ``load_model`` does before converting weights; plus every tensor's bytes, through the reader."""
    with open_gguf(path) as gguf:
        for name, info in gguf.tensors.items():
            assert gguf.tensor_bytes(name).size == info.nbytes
    loader = open_loader(path)
    try:
        arch = get_architecture(loader.arch_name)
        hparams = read_hparams(arch, loader)
        vocab = Vocab.from_metadata(loader.metadata)
        specs = arch.tensors(hparams)
        model = Model(path=path, params=ModelParams(backend="numpy"), metadata=loader.metadata, arch=arch,
                      hparams=hparams, vocab=vocab, tensor_specs=specs)
        _place_layers(model, model.params, declined={})
        plan_weights(model, loader, specs)
    finally:
        loader.close()


def fuzz_headers(seeds: list[HeaderSeed], n_cases: int, work: Path, rng: random.Random,
                 keep: Path | None = None) -> Tally:
    """``keep``: a folder that receives the header of every failing case (``<case>-<seed>.header``)."""
    tally = Tally()
    path = work / "mutated.gguf"
    for i in range(n_cases):
        seed = seeds[i % len(seeds)]
        header = mutate_header(seed, rng)
        size = write_sparse(path, header, seed.data_bytes)
        outcome, seconds, detail = run_guarded(lambda: load_like_load_model(path))
        if outcome not in ("crash", "hang"):
            peak = traced_peak(lambda: load_like_load_model(path))
            tally.traced += 1
            tally.max_peak_fraction = max(tally.max_peak_fraction, peak / size)
            if peak > size:
                outcome, detail = "over-allocation", f"{peak} bytes for a {size}-byte file"
        tally.record(outcome, seconds, f"{seed.name}: {detail}")
        if keep is not None and outcome in ("crash", "hang", "over-allocation"):
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{i}-{seed.name}.header").write_bytes(header)
    return tally


# ------------------------------------------------------------------------------------------------ vocabs
def tokenizer_keys(model_path: Path) -> tuple[dict[str, Any], int]:
    """The model's tokenizer keys (plus general.architecture) and the file's size."""
    with open_gguf(model_path) as gguf:
        keys = {k: v for k, v in gguf.metadata.items() if k.startswith("tokenizer.") or k == "general.architecture"}
    return keys, model_path.stat().st_size


def _random_text(rng: random.Random) -> str:
    pool = ["", " ", "\n", "<0x0A>", "<|im_start|>", "▁", "Ġ", "a b", "\ud800", "\x00", "🙂", "x" * 10_000,
            "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randint(1, 12)))]
    return rng.choice(pool)


def _sequence(keys: dict[str, Any], key: str) -> list[Any]:
    """The array under ``key`` as a list (an earlier mutation may have replaced it by something else)."""
    value = keys.get(key)
    return list(value) if isinstance(value, (list, tuple, np.ndarray)) else []


def _scatter(keys: dict[str, Any], key: str, rng: random.Random, make: Callable[[], Any]) -> None:
    """Overwrite 1-64 random entries of the array under ``key`` with ``make()``."""
    values = _sequence(keys, key)
    for _ in range(rng.randint(1, 64) if values else 0):
        values[rng.randrange(len(values))] = make()
    keys[key] = values


def _token_texts(keys: dict[str, Any], rng: random.Random) -> None:
    _scatter(keys, "tokenizer.ggml.tokens", rng, lambda: _random_text(rng))


def _duplicate_tokens(keys: dict[str, Any], rng: random.Random) -> None:
    tokens = _sequence(keys, "tokenizer.ggml.tokens") or [""]
    _scatter(keys, "tokenizer.ggml.tokens", rng, lambda: tokens[rng.randrange(min(300, len(tokens)))])


def _token_types(keys: dict[str, Any], rng: random.Random) -> None:
    _scatter(keys, "tokenizer.ggml.token_type", rng, lambda: rng.choice([-1, 0, 2, 3, 4, 5, 6, 7, 255, 2**31 - 1]))


def _nan_scores(keys: dict[str, Any], rng: random.Random) -> None:
    _scatter(keys, "tokenizer.ggml.scores", rng, lambda: rng.choice([float("nan"), float("inf"), -1e38]))


def _bad_merges(keys: dict[str, Any], rng: random.Random) -> None:
    _scatter(keys, "tokenizer.ggml.merges", rng,
             lambda: rng.choice(["", " ", "ab", " a b", "a  b", "\u0120 \u0120", _random_text(rng)]))


def _special_ids(keys: dict[str, Any], rng: random.Random) -> None:
    key = rng.choice(["bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "seperator_token_id"])
    n_tokens = len(_sequence(keys, "tokenizer.ggml.tokens"))
    keys["tokenizer.ggml." + key] = rng.choice([-1, 0, 2**31 - 1, 2**32 - 1, n_tokens, n_tokens - 1])


def _short_array(keys: dict[str, Any], rng: random.Random) -> None:
    key = rng.choice(VOCAB_ARRAYS)
    values = _sequence(keys, key)
    keys[key] = values[:rng.randint(0, len(values))]


def _wrong_element_type(keys: dict[str, Any], rng: random.Random) -> None:
    keys[rng.choice(VOCAB_ARRAYS)] = rng.choice([[1, 2, 3], ["x", "y"], 7, "text", [None], [[1]], [b"x"]])


def _wrong_flag_type(keys: dict[str, Any], rng: random.Random) -> None:
    key = rng.choice(["add_bos_token", "add_eos_token", "add_space_prefix", "pre", "model",
                      "normalizer.lowercase"])
    keys["tokenizer.ggml." + key] = rng.choice([1, "yes", 2.5, [True], None])


def _other_model(keys: dict[str, Any], rng: random.Random) -> None:
    keys["tokenizer.ggml.model"] = rng.choice(["gpt2", "llama", "bert", "gemma4", "t5", "rwkv", "", "no-such"])


def _other_pre(keys: dict[str, Any], rng: random.Random) -> None:
    keys["tokenizer.ggml.pre"] = rng.choice(["qwen35", "deepseek-v3", "gemma4", "chameleon", "bloom", "", "??"])


def _drop_key(keys: dict[str, Any], rng: random.Random) -> None:
    keys.pop(rng.choice(sorted(keys)), None)


VOCAB_MUTATIONS: dict[str, Callable[[dict[str, Any], random.Random], None]] = {
    f.__name__.lstrip("_"): f for f in (_token_texts, _duplicate_tokens, _token_types, _nan_scores, _bad_merges,
                                        _special_ids, _short_array, _wrong_element_type, _wrong_flag_type,
                                        _other_model, _other_pre, _drop_key)
}


def use_vocab(keys: dict[str, Any], rng_seed: int) -> None:
    vocab = Vocab.from_metadata(keys)
    rng = random.Random(rng_seed)
    for text in TEXTS:
        for parse_special in (False, True):
            ids = vocab.tokenize(text, add_special=True, parse_special=parse_special)
            vocab.detokenize(ids, remove_special=True, unparse_special=parse_special)
    for token in (rng.randrange(vocab.n_vocab) for _ in range(64)):
        vocab.token_to_piece(token, special=bool(token % 2))


def fuzz_vocabs(bases: list[tuple[dict[str, Any], int]], n_cases: int, rng: random.Random) -> Tally:
    tally = Tally()
    names = sorted(VOCAB_MUTATIONS)
    for i in range(n_cases):
        base, size = bases[i % len(bases)]
        keys = dict(base)
        for name in rng.sample(names, rng.randint(1, 3)):
            VOCAB_MUTATIONS[name](keys, rng)
        seed = rng.getrandbits(32)
        outcome, seconds, detail = run_guarded(lambda keys=keys, seed=seed: use_vocab(keys, seed))
        if i % VOCAB_TRACE_EVERY == 0 and outcome not in ("crash", "hang"):
            peak = traced_peak(lambda keys=keys, seed=seed: use_vocab(keys, seed))
            tally.traced += 1
            tally.max_peak_fraction = max(tally.max_peak_fraction, peak / size)
            if peak > size:
                outcome, detail = "over-allocation", f"{peak} bytes for a {size}-byte file"
        tally.record(outcome, seconds, detail)
    return tally


# ------------------------------------------------------------------------------------------------ quants
def special_blocks(ggml_type: Any, n_blocks: int, fill: str, rng: np.random.Generator) -> np.ndarray:
    """Raw bytes of ``n_blocks`` blocks: every 16-bit word set to ``fill`` (nan / +inf / -inf), or random bits
    with a quarter of the words NaN or inf ("mixed")."""
    n_bytes = TYPE_INFO[ggml_type].type_size * n_blocks
    words = rng.integers(0, 1 << 16, size=(n_bytes + 1) // 2, dtype=np.uint16)
    if fill == "mixed":
        hit = rng.random(words.size) < 0.25
        words[hit] = rng.choice(np.array(list(F16_SPECIAL.values()), dtype=np.uint16), size=int(hit.sum()))
    else:
        words[:] = F16_SPECIAL[fill]
    return words.view(np.uint8)[:n_bytes].copy()


def fuzz_quants(rng_seed: int) -> Tally:
    tally = Tally()
    rng = np.random.default_rng(rng_seed)
    for ggml_type in sorted(SUPPORTED_DEQUANT, key=int):
        block = TYPE_INFO[ggml_type].block_size
        for fill in (*F16_SPECIAL, "mixed"):
            raw = special_blocks(ggml_type, 32, fill, rng)

            def decode(raw: np.ndarray = raw, t: Any = ggml_type, block: int = block) -> None:
                dequantize(raw, t, (block * 4, 8))
                dequantize_rows(raw, t, (block * 4, 8), [0, 3, 7])

            outcome, seconds, detail = run_guarded(decode)
            tally.record(outcome, seconds, f"{ggml_type.name} {fill}: {detail}")
    return tally


# ------------------------------------------------------------------------------------------------ native repacking
#: widest activation row a repack case multiplies (a mutated row length may be huge; the repack is still checked)
MAX_MATMUL_COLS = 1 << 18


def native_kernels() -> Any:
    """The native backend's kernels module with its library loaded, or None where the extension is not built."""
    from llmfw.core.errors import BackendUnavailable
    from llmfw.plugins.backends.native import kernels

    try:
        kernels.load_library()
    except BackendUnavailable:
        return None
    return kernels


def repack_and_multiply(raw: np.ndarray, ggml_type: int, ne: tuple[int, ...], kernels: Any, pool: Any,
                        isa: str) -> None:
    """What the native backend does with a matmul weight: repack it (which must refuse a bad one with an
    LLMFWError before any C code runs), then one product of two activation rows on the given ISA path."""
    from llmfw.plugins.backends.native.repack import repack

    packed = repack(raw, ggml_type, ne)
    if packed.n_cols <= MAX_MATMUL_COLS:
        x = np.linspace(-2.0, 2.0, 2 * packed.n_cols, dtype=np.float32).reshape(2, packed.n_cols)
        kernels.mul_mat(packed, x, pool, isa)


def seed_tensors(seed: HeaderSeed, work: Path) -> dict[str, tuple[int, tuple[int, ...]]]:
    """The unmutated tensor table of a seed: name → (type, shape)."""
    path = work / f"table-{seed.name}.gguf"
    write_sparse(path, seed.header, seed.data_bytes)
    with open_gguf(path) as gguf:
        return {name: (int(info.ggml_type), tuple(info.shape)) for name, info in gguf.tensors.items()}


def fuzz_repack(seeds: list[HeaderSeed], n_cases: int, work: Path, rng: random.Random, kernels: Any,
                limit_s: float = 10.0) -> Tally:
    """Mutated headers (as ``fuzz_headers``) whose file the GGUF reader opens (it has checked every tensor's
    extent): every tensor the mutation changed (type or shape; the data is the sparse file's zeros, or the bytes
    the table now points at) and one unchanged tensor go through :func:`repack_and_multiply`, on each ISA path in
    turn — a stricter test than the load itself, which also refuses shapes the architecture does not expect.
    Files the reader refuses are not counted."""
    tally = Tally()
    tables = {seed.name: seed_tensors(seed, work) for seed in seeds}
    isas = kernels.available_isas()
    pool = kernels.ThreadPool(2)
    path = work / "mutated-repack.gguf"
    try:
        attempts = 0
        while tally.cases < n_cases and attempts < 50 * n_cases:
            attempts += 1
            seed = seeds[attempts % len(seeds)]
            write_sparse(path, mutate_header(seed, rng), seed.data_bytes)
            if run_guarded(lambda: open_gguf(path).close())[0] != "ok":
                continue
            with open_gguf(path) as gguf:
                table = {name: (int(info.ggml_type), tuple(info.shape)) for name, info in gguf.tensors.items()}
                changed = [name for name, entry in table.items() if tables[seed.name].get(name) != entry]
                names = changed + [rng.choice(sorted(table))]
                for name in names:
                    isa = isas[tally.cases % len(isas)]
                    ggml_type, ne = table[name]

                    def case(name: str = name, ggml_type: int = ggml_type, ne: tuple[int, ...] = ne,
                             isa: str = isa) -> None:
                        repack_and_multiply(gguf.tensor_bytes(name), ggml_type, ne, kernels, pool, isa)

                    outcome, seconds, detail = run_guarded(case, limit_s)
                    kind = "changed" if name in changed else "unchanged"
                    tally.record(f"{kind}:{outcome}", seconds, f"{seed.name} {name} type {ggml_type} ne {ne}: {detail}")
    finally:
        pool.close()
    return tally


def mutated_tensor(rng: random.Random) -> tuple[np.ndarray, int, tuple[int, ...]]:
    """A small tensor description of the kind a damaged table gives: any type number (known or not), dimensions
    that are odd, zero, huge or one too many, and a byte length that fits the description or misses it."""
    from llmfw.core.format.quants import GGMLType, tensor_nbytes

    types = [int(t) for t in GGMLType] + [31, 40, 99, 2**31 - 1, -1]
    ggml_type = rng.choice(types)
    ne: list[int] = [rng.choice([32, 64, 96, 256, 512, 33, 100, 1, 0]), rng.choice([1, 3, 8, 9, 17, 64])]
    if rng.random() < 0.3:
        ne[rng.randrange(2)] = rng.choice(INTERESTING)
    if rng.random() < 0.1:
        ne.append(rng.choice([1, 2, 0]))
    try:
        size = tensor_nbytes(ggml_type, tuple(ne))
    except LLMFWError:
        size = rng.randrange(0, 4096)
    if size > 1 << 22 or rng.random() < 0.3:
        size = min(size, 1 << 22) + rng.choice([-1, 1, -17, 0])
    raw = np.frombuffer(rng.randbytes(max(size, 0)), dtype=np.uint8)
    return raw, ggml_type, tuple(ne)


def fuzz_repack_tensors(n_cases: int, rng: random.Random, kernels: Any) -> Tally:
    """Damaged tensor descriptions straight into :func:`repack_and_multiply` (random bytes: NaN / inf scales
    included), on each ISA path in turn."""
    tally = Tally()
    isas = kernels.available_isas()
    pool = kernels.ThreadPool(2)
    try:
        for i in range(n_cases):
            raw, ggml_type, ne = mutated_tensor(rng)

            def case(raw: np.ndarray = raw, ggml_type: int = ggml_type, ne: tuple[int, ...] = ne,
                     isa: str = isas[i % len(isas)]) -> None:
                with np.errstate(all="ignore"):
                    repack_and_multiply(raw, ggml_type, ne, kernels, pool, isa)

            outcome, seconds, detail = run_guarded(case)
            tally.record(outcome, seconds, f"type {ggml_type} ne {ne} bytes {raw.size}: {detail}")
    finally:
        pool.close()
    return tally


# ------------------------------------------------------------------------------------------------ main
def default_models() -> list[Path]:
    from llmfw.core.format.catalog import resolve_model

    return [Path(resolve_model("smollm2")), Path(resolve_model("gemma-3-270m"))]


def run(models: list[Path], n_headers: int, n_vocabs: int, seed: int, keep: Path | None = None,
        n_repack: int = 0, n_repack_tensors: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="llmfw-fuzz-") as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        seeds = [header_seed(m, work) for m in models]
        summary = {"headers": fuzz_headers(seeds, n_headers, work, rng, keep).summary(),
                   "vocabs": fuzz_vocabs([tokenizer_keys(m) for m in models], n_vocabs, rng).summary(),
                   "quants": fuzz_quants(seed).summary()}
        kernels = native_kernels() if n_repack or n_repack_tensors else None
        if kernels is not None:
            summary["repack"] = fuzz_repack(seeds, n_repack, work, rng, kernels).summary()
            summary["repack_tensors"] = fuzz_repack_tensors(n_repack_tensors, rng, kernels).summary()
        elapsed = time.perf_counter() - start
    return {"models": [m.name for m in models], "seed": seed, "seconds": round(elapsed, 1), **summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--headers", type=int, default=10_000, help="mutated header / tensor-table cases")
    parser.add_argument("--vocabs", type=int, default=1_000, help="mutated vocabulary cases")
    parser.add_argument("--repack", type=int, default=300,
                        help="native repacking of the tensors of mutated headers that load (needs the built extension)")
    parser.add_argument("--repack-tensors", type=int, default=2_000, help="native repacking of damaged tensors")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    parser.add_argument("--keep", type=Path, help="save the headers of failing cases in this folder")
    parser.add_argument("models", nargs="*", type=Path, help="GGUF files (default: the two catalog models)")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # damaged vocabularies log a warning per bad token
    summary = run(args.models or default_models(), args.headers, args.vocabs, args.seed, args.keep, args.repack,
                  args.repack_tensors)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    failures = sum(part["failures"] for part in summary.values() if isinstance(part, dict))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
