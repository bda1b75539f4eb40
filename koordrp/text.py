"""Words for log lines and error messages: values named as an operator reads them, and kept short."""

from typing import Sequence

LIMIT = 200


def shortened(text: str, limit: int = LIMIT) -> str:
    """``text`` on one line, at most ``limit`` characters, nothing unprintable in it (``escaped``); a 16 MiB id must
    not become a 16 MiB log line, nor a peer's control characters reach a terminal."""
    flat = " ".join(text.split())
    if not flat.isprintable():
        return escaped(flat, limit)
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def json_type(value: object) -> str:
    """The JSON name of ``value``'s type, as the file it came from spells it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _escape(character: str) -> str:
    return repr(character)[1:-1] if character not in "\"\\" else "\\" + character


def escaped(text: str, limit: int = 80) -> str:
    """``text`` on one line as a log line may show it: at most ``limit`` characters (then ``…``), every character
    that is not printable (control characters, NUL, line separators) written as Python writes it (``\\x00``)."""
    cut = text[:limit]
    shown = cut if cut.isprintable() else "".join(character if character.isprintable() else repr(character)[1:-1] for character in cut)
    return shown + "…" if len(text) > limit else shown


def quoted(text: str, limit: int = 80) -> str:
    """``text`` in double quotes, escaped as ``escaped`` does, and its quotes and backslashes too."""
    cut = text[:limit]
    plain = cut.isprintable() and '"' not in cut and "\\" not in cut
    shown = cut if plain else "".join(character if character.isprintable() and character not in "\"\\" else _escape(character) for character in cut)
    return f'"{shown}"' + ("…" if len(text) > limit else "")


def listed(texts: Sequence[str], most: int, separator: str = ", ") -> str:
    """The first ``most`` of ``texts``, then how many more: a line names at most so many things."""
    shown = separator.join(texts[:most])
    return shown if len(texts) <= most else f"{shown}{separator}… and {len(texts) - most} more"
