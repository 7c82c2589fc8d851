"""Serving: the continuous-batching :class:`Engine` (a Python API) and the OpenAI-compatible HTTP server on it.

``Engine(model, parallel=4)`` owns one Context with ``parallel`` sequences and one thread that decodes every
running request in one batch per step; ``engine.completion(...)`` / ``engine.chat_completion(...)`` take
OpenAI request fields and return OpenAI-shaped dicts (iterators of chunks with ``stream=True``). The HTTP app
(:func:`llmfw.serving.app.create_app`) calls exactly these.
"""
from __future__ import annotations

from .engine import Engine

__all__ = ["Engine"]
