"""`llmfw tokenize`: a model's tokenization of a text, like llama.cpp's llama-tokenize."""
from __future__ import annotations

import json
import sys

import click

from ..core.format.catalog import resolve_model
from ..core.tokenizer.vocab import Vocab


def _show_piece(piece: bytes) -> str:
    """A piece for the terminal: UTF-8 where it is valid, \\xNN escapes for a partial character."""
    return piece.decode("utf-8", "backslashreplace")


@click.command("tokenize")
@click.argument("model")
@click.argument("text")
@click.option("--ids", "ids_only", is_flag=True, help="Print only the token ids, as a list: [1, 2, 3].")
@click.option("--pieces", "pieces_only", is_flag=True, help="Print only the pieces, one JSON string per line.")
@click.option("--no-special", is_flag=True, help="Do not add BOS/EOS (add_special=False).")
@click.option("--parse-special", is_flag=True,
              help="Turn special-token texts such as <|im_start|> into their ids (parse_special=True).")
def tokenize_cmd(model: str, text: str, ids_only: bool, pieces_only: bool, no_special: bool,
                 parse_special: bool) -> None:
    """Tokenize TEXT with the vocabulary of MODEL (a GGUF path or a catalog name; TEXT '-' reads stdin).

    By default every token is printed as `id -> 'piece'` (the piece with special tokens rendered).
    """
    if ids_only and pieces_only:
        raise click.UsageError("--ids and --pieces exclude each other")
    if text == "-":
        text = sys.stdin.read()
    vocab = Vocab.from_file(resolve_model(model))
    tokens = vocab.tokenize(text, add_special=not no_special, parse_special=parse_special)
    if ids_only:
        click.echo(json.dumps(tokens))
        return
    for token in tokens:
        piece = _show_piece(vocab.token_to_piece(token, special=True))
        if pieces_only:
            click.echo(json.dumps(piece, ensure_ascii=False))
        else:
            click.echo(f"{token:6d} -> '{piece}'")
    if not pieces_only:
        from ..core.generation.generate import plural

        click.echo(plural(len(tokens), "token"), err=True)
