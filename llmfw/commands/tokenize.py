"""`llmfw tokenize`: a model's tokenization of a text, like llama.cpp's llama-tokenize."""
from __future__ import annotations

import json
import sys

import click

from ..core.format.catalog import resolve_model
from ..core.tokenizer.vocab import Vocab
from .model_arg import model_from, model_option

#: characters a piece shows escaped: a newline or tab inside ``id -> '...'`` would break or hide the line, and a
#: backslash is escaped so that ``\\n`` (two characters) and ``\n`` (a newline) stay apart
_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v", "\f": "\\f"}


def _show_piece(piece: bytes) -> str:
    """A piece for the terminal: UTF-8 where it is valid, \\xNN escapes for a partial character."""
    return piece.decode("utf-8", "backslashreplace")


def escape_piece(piece: bytes) -> str:
    """A piece for ``id -> '...'``: newlines, tabs, other control characters and backslashes escaped (``'\\n'``),
    and the bytes of a partial UTF-8 character as ``\\xNN``."""
    shown = []
    for char in piece.decode("utf-8", "surrogateescape"):
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:  # a byte that is not valid UTF-8 (surrogateescape's stand-in)
            shown.append(f"\\x{code - 0xDC00:02x}")
        elif char in _ESCAPES:
            shown.append(_ESCAPES[char])
        elif code < 0x20 or code == 0x7F:
            shown.append(f"\\x{code:02x}")
        else:
            shown.append(char)
    return "".join(shown)


def model_and_text(args: tuple[str, ...], option: str | None) -> tuple[str | None, str]:
    """``[-m MODEL] TEXT``, or the older ``MODEL TEXT`` (two arguments cannot mean anything else)."""
    if len(args) == 2:
        return model_from(args[0], option), args[1]
    if len(args) == 1:
        return option, args[0]
    raise click.UsageError("give TEXT to tokenize (llmfw tokenize [-m MODEL] TEXT)")


@click.command("tokenize")
@click.argument("args", nargs=-1, metavar="[MODEL] TEXT")
@model_option
@click.option("--ids", "ids_only", is_flag=True, help="Print only the token ids, as a list: [1, 2, 3].")
@click.option("--pieces", "pieces_only", is_flag=True, help="Print only the pieces, one JSON string per line.")
@click.option("--no-special", is_flag=True, help="Do not add BOS/EOS (add_special=False).")
@click.option("--parse-special", is_flag=True,
              help="Turn special-token texts such as <|im_start|> into their ids (parse_special=True).")
def tokenize_cmd(args: tuple[str, ...], model: str | None, ids_only: bool, pieces_only: bool, no_special: bool,
                 parse_special: bool) -> None:
    """Tokenize TEXT with the vocabulary of -m MODEL (a GGUF path or a catalog name; TEXT '-' reads stdin).

    By default every token is printed as `id -> 'piece'` (the piece with special tokens rendered, newlines,
    tabs and other control characters escaped). `llmfw tokenize MODEL TEXT` works too.
    """
    model, text = model_and_text(args, model)
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
        piece = vocab.token_to_piece(token, special=True)
        if pieces_only:
            click.echo(json.dumps(_show_piece(piece), ensure_ascii=False))
        else:
            click.echo(f"{token:6d} -> '{escape_piece(piece)}'")
    if not pieces_only:
        from ..core.generation.generate import plural

        click.echo(plural(len(tokens), "token"), err=True)
