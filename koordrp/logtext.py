"""Keeping log lines lines: text from callers and plugins is cut to a readable length."""

LIMIT = 200


def shortened(text: str, limit: int = LIMIT) -> str:
    """``text`` on one line, at most ``limit`` characters; a 16 MiB id must not become a 16 MiB log line."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
