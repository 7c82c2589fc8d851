"""Typed access to a model file's metadata, with ``{arch}``-templated keys and errors that name the key.

It lives with the file format because every layer above reads hyperparameters through it (``arch`` reads a
family's own keys, ``runtime`` the common ones) and none of them may import the runtime's loader.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import MissingMetadataKey, ModelError

_MISSING = object()


class MetadataView:
    """Typed access to metadata with ``{arch}`` templating and errors that name the key."""

    def __init__(self, metadata: dict[str, Any], arch: str):
        self.metadata = metadata
        self.arch = arch

    def expand(self, key: str) -> str:
        return key.replace("{arch}", self.arch)

    def get(self, key: str, default: Any = _MISSING) -> Any:
        full = self.expand(key)
        if full in self.metadata:
            return self.metadata[full]
        if default is _MISSING:
            raise MissingMetadataKey(f"missing required metadata key {full!r}")
        return default

    def as_int(self, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ModelError(f"metadata key {self.expand(key)!r}: expected an integer, found {value!r}")
        return int(value)

    def get_int(self, key: str, default: Any = _MISSING) -> int:
        value = self.get(key, default)
        return value if value is default and default is not _MISSING else self.as_int(key, value)

    def get_float(self, key: str, default: Any = _MISSING) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ModelError(f"metadata key {self.expand(key)!r}: expected a number, found {value!r}")
        return float(value)

    def get_bool(self, key: str, default: Any = _MISSING) -> bool:
        value = self.get(key, default)
        if not isinstance(value, (bool, np.bool_)):
            raise ModelError(f"metadata key {self.expand(key)!r}: expected a bool, found {value!r}")
        return bool(value)
