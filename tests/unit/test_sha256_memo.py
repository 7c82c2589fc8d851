"""The files' sha256 memo (``catalog.file_sha256``): right digests, one entry per file, a bounded folder."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from llmfw.core.format import catalog


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_file_written_again_replaces_its_entry(tmp_path, monkeypatch):
    memo = tmp_path / "memo"
    monkeypatch.setenv(catalog.SHA256_MEMO_VARIABLE, str(memo))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"first version")
    assert catalog.file_sha256(model) == _digest(model)
    assert len(list(memo.iterdir())) == 1
    model.write_bytes(b"second version, another size")
    assert catalog.file_sha256(model) == _digest(model)
    assert len(list(memo.iterdir())) == 1


def test_the_memo_answers_without_reading_the_file(tmp_path, monkeypatch):
    """Same path, size and modification time: the remembered digest, even for other bytes (what makes the memo
    worth having; a file changed in place keeps neither its size and its mtime in practice)."""
    monkeypatch.setenv(catalog.SHA256_MEMO_VARIABLE, str(tmp_path / "memo"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"aaaa")
    first = catalog.file_sha256(model)
    stat = model.stat()
    model.write_bytes(b"bbbb")
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert catalog.file_sha256(model) == first != _digest(model)


def test_a_damaged_entry_is_read_again(tmp_path, monkeypatch):
    memo = tmp_path / "memo"
    monkeypatch.setenv(catalog.SHA256_MEMO_VARIABLE, str(memo))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    catalog.file_sha256(model)
    (entry,) = memo.iterdir()
    whole = entry.read_bytes()
    for damaged in (b"", b"zz" * 32 + whole[64:], whole[:40], b"\xff" + whole[1:]):
        entry.write_bytes(damaged)
        assert catalog.file_sha256(model) == _digest(model)
        assert entry.read_bytes() == whole  # written again


def test_the_memo_keeps_the_newest_entries_only(tmp_path, monkeypatch):
    memo = tmp_path / "memo"
    monkeypatch.setenv(catalog.SHA256_MEMO_VARIABLE, str(memo))
    monkeypatch.setattr(catalog, "SHA256_MEMO_ENTRIES", 3)
    files = []
    for i in range(5):
        path = tmp_path / f"model-{i}.gguf"
        path.write_bytes(bytes([i]) * (i + 1))
        assert catalog.file_sha256(path) == _digest(path)
        # distinct ages, whatever the file system's timestamp resolution (a new entry is younger than all of these)
        os.utime(memo / hashlib.sha256(str(path.resolve()).encode()).hexdigest(), ns=(0, 1_000_000_000 * (10 + i)))
        files.append(path)
    kept = {entry.name for entry in memo.iterdir()}
    assert kept == {hashlib.sha256(str(p.resolve()).encode()).hexdigest() for p in files[-3:]}


def test_the_default_folder_is_beside_the_models(tmp_path, monkeypatch):
    monkeypatch.delenv(catalog.SHA256_MEMO_VARIABLE, raising=False)
    monkeypatch.setenv("LLMFW_MODELS_DIR", str(tmp_path / "models"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    catalog.file_sha256(model)
    assert catalog.sha256_memo_dir() == tmp_path / "models" / ".sha256"
    assert len(list((tmp_path / "models" / ".sha256").iterdir())) == 1


def test_an_unwritable_memo_folder_still_gives_the_digest(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    monkeypatch.setenv(catalog.SHA256_MEMO_VARIABLE, str(blocker / "memo"))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"weights")
    assert catalog.file_sha256(model) == _digest(model)
