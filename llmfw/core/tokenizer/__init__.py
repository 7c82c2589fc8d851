"""Tokenizers: vocabularies, their loaders, chat templates."""
