"""Comparing a CRI answer got through koordrp with the same call made directly."""

from typing import Any, Mapping

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

# Fields that differ between two otherwise identical calls: when and how much, not what. They are left
# out, not blanked: protobuf leaves a zero out, and one measure may still be zero when the other is not.
VOLATILE_KEYS = frozenset(
    {
        "created_at",
        "started_at",
        "finished_at",
        "timestamp",
        "used_bytes",
        "inodes_used",
        "usage_core_nano_seconds",
        "usage_nano_cores",
        "working_set_bytes",
        "available_bytes",
        "usage_bytes",
        "rss_bytes",
        "page_faults",
        "major_page_faults",
    }
)


def normalized(message: Message, replacements: Mapping[str, str] = {}) -> Any:
    """``message`` as plain data with ids and names replaced by placeholders and volatile values left out."""
    data = MessageToDict(message, preserving_proto_field_name=True)
    return _normalize(data, replacements)


def _normalize(value: Any, replacements: Mapping[str, str]) -> Any:
    if isinstance(value, dict):
        return {
            _replace(key, replacements): _normalize(item, replacements)
            for key, item in value.items()
            if key not in VOLATILE_KEYS
        }
    if isinstance(value, list):
        return [_normalize(item, replacements) for item in value]
    if isinstance(value, str):
        return _replace(value, replacements)
    return value


def _replace(text: str, replacements: Mapping[str, str]) -> str:
    # Longest first, so an id is not half-replaced by a name it contains.
    for original in sorted(replacements, key=len, reverse=True):
        text = text.replace(original, replacements[original])
    return text


def changed_fields(before: Message, after: Message, prefix: str = "") -> set[str]:
    """Dotted paths of the fields (map entries by key) whose value differs between two messages."""
    changed: set[str] = set()
    for field in after.DESCRIPTOR.fields:
        path = prefix + field.name
        old, new = getattr(before, field.name), getattr(after, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            changed.update(f"{path}[{key}]" for key in set(old) | set(new) if old.get(key) != new.get(key))
        elif field.message_type is not None and not field.is_repeated:
            changed.update(changed_fields(old, new, path + "."))
        elif old != new:
            changed.add(path)
    return changed
