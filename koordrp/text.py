"""Words for log lines and error messages: values named as an operator reads them, and kept short."""

LIMIT = 200


def shortened(text: str, limit: int = LIMIT) -> str:
    """``text`` on one line, at most ``limit`` characters; a 16 MiB id must not become a 16 MiB log line."""
    flat = " ".join(text.split())
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
