"""Registering hook servers the way an operator or a plugin does: a JSON file in hookserver.d."""

import json
import os
from pathlib import Path
from typing import Any, Iterable


def register(
    directory: Path,
    name: str,
    endpoint: str,
    hooks: Iterable[str],
    policy: str | None = "Ignore",
    **extra: Any,
) -> Path:
    """Write ``<name>.json`` atomically (temp file + rename), as a careful plugin would."""
    directory.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {"remote-endpoint": endpoint, "runtime-hooks": list(hooks), **extra}
    if policy is not None:
        document["failure-policy"] = policy
    path = directory / f"{name}.json"
    temporary = directory / f".{name}.json.tmp"
    temporary.write_text(json.dumps(document))
    os.chmod(temporary, 0o644)
    os.replace(temporary, path)
    return path
