"""The one info line a lifecycle call gets (in NRI mode, one that is not ``uneventful``): what it was about, what
each hook server did to it, how it ended.

    CreateContainer pod default/web (9f1c…) container app: OK in 14.2 ms; hooks:
    PreCreateContainer@koordlet.json: ok 0.6 ms, changed cgroup_parent, resources.cpuset_cpus "0-3"→"2-3",
    envs +KOORDLET_SEEN

Each hook server called (or spared) is named with its outcome and, for a pre hook, what its answer
changed, what of it was left alone, and what koordrp refused of it (``refused resources.cpuset_cpus "abc":
not a cpu list``). Environment variables, labels and annotations are named by key only: their values may be
secrets. Whatever an answer sent is shown escaped (control characters and NUL as ``\x00``) and cut short,
and each hook call names at most ``MAX_LISTED`` changes of each kind (then ``… and K more``), so an answer
cannot make a line of any size. The same facts are the event's fields (``hook_calls``) for JSON logs.
"""

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator

from twisted.logger import Logger

from koordrp.adapters import OK_LABEL
from koordrp.hooks.messages import Change, ContainerHookRequest, HookRequest, left_alone
from koordrp.hooks.types import ERROR, LATE, NOT_ANSWERING, TIMEOUT, HookCall, HookType
from koordrp.hooks.validation import refused_text, value_text
from koordrp.text import escaped, shortened

log = Logger(namespace="koordrp.calls")

FORMAT = (
    "{method} pod {namespace}/{pod} ({uid}){container_part}: {outcome}{why_part} in {duration_ms:.1f} ms; hooks: {hooks}"
    "{asked_lost_part}"
)
ASKED_LOST = "; kubelet's values not available (its state file could not be read): hooks were shown the runtime's"

# How the log names a hook message's fields: as an operator thinks of them.
_NAMES = {"container_resources.": "resources.", "pod_cgroup_parent": "cgroup_parent"}
_KEYS_ONLY = ("container_envs[", "labels[", "annotations[", "container_annotations[")
_SHORT_MAP_NAMES = {"container_envs": "envs", "container_annotations": "annotations"}
MAX_LISTED = 10
"""Changes of each kind (changed, left alone for one reason, refused) one hook call's text names."""


def _name(path: str) -> str:
    for long, short in _NAMES.items():
        if path.startswith(long):
            return short + path[len(long) :]
    return path


def change_text(change: Change) -> str:
    if change.refused:
        return refused_text(change.path, change.after, change.why)
    if change.path.startswith(_KEYS_ONLY):
        map_name, _, key = change.path[:-1].partition("[")
        return f"{_SHORT_MAP_NAMES.get(map_name, map_name)} {'+' if change.added else '~'}{escaped(key, 80)}"
    return f"{_name(change.path)} {value_text(change.before)}→{value_text(change.after)}"


def _reason(call: HookCall, limit: int) -> str:
    return escaped(shortened(call.reason, limit), limit + 1)


def _texts(changes: list[Change]) -> str:
    return ", ".join(_bounded(changes, change_text))


def call_text(call: HookCall) -> str:
    text = f"{call.hook.value}@{call.server.name}: {call.result}"
    if call.seconds is not None:
        text += f" {call.seconds * 1000:.1f} ms"
    trial = "trial; " if call.trial else ""
    if call.result in (ERROR, TIMEOUT, NOT_ANSWERING):
        fails = call.server.must_be_heard(call.hook)
        return f"{text} ({trial}{_reason(call, 120)}; {'Fail policy: the call failed' if fails else 'went on without it'})"
    if call.result == LATE:
        text += f" ({trial}{_reason(call, 120)}: went on without it, then applied what could change)"
    elif call.trial:
        text += " (trial: it answers in time again)"
    applied = [change for change in call.changes if change.applied]
    if applied:
        text += ", changed " + _texts(applied)
    left: dict[str, list[Change]] = {}
    refused: list[Change] = []
    for change in call.changes:
        if change.refused:
            refused.append(change)
        elif not change.applied:
            left.setdefault(change.why, []).append(change)
    for why, changes in left.items():
        text += f", left alone ({why}) " + _texts(changes)
    if refused:
        text += ", " + _texts(refused)
    return text


def _bounded(changes: list[Change], text: Callable[[Change], str]) -> list[str]:
    """The first MAX_LISTED of ``changes`` as ``text`` names them, then how many more (not named: an answer may
    make thousands)."""
    texts = [text(change) for change in changes[:MAX_LISTED]]
    return texts if len(changes) <= MAX_LISTED else [*texts, f"… and {len(changes) - MAX_LISTED} more"]


def _left_alone_text(change: Change) -> str:
    return change_text(change) if change.refused else f"{change_text(change)} ({change.why})"


def field_name(change: Change) -> str:
    """The field a change is to, without a map's key (which may be anything): for metrics labels."""
    return _name(change.path.partition("[")[0])


def call_fields(call: HookCall) -> dict[str, object]:
    return {
        "hook": call.hook.value,
        "server": call.server.name,
        "result": call.result,
        "duration_ms": None if call.seconds is None else round(call.seconds * 1000, 3),
        "changed": _bounded([change for change in call.changes if change.applied], change_text),
        "left_alone": _bounded([change for change in call.changes if not change.applied], _left_alone_text),
        "reason": _reason(call, 200),
        "trial": call.trial,
    }


@dataclass
class CallRecord:
    """Filled in as a lifecycle call goes; written once it ends."""

    method: str
    subject: HookRequest | None = None
    calls: list[HookCall] = field(default_factory=list)
    why: str = ""
    """Why the call ended as it did, where the runtime tells and its outcome's word does not (NRI: why
    containerd did not do it)."""
    asked_lost: bool = False
    """What kubelet asked for the pod or container was lost (its state file could not be read)."""

    def add(self, calls: Iterable[HookCall]) -> None:
        self.calls.extend(calls)

    def leave_alone(self, hook: HookType, path_prefix: str, why: str) -> None:
        """What ``hook``'s answers changed under ``path_prefix`` was left alone (the front end could not write it)."""
        self.calls = [
            replace(call, changes=left_alone(call.changes, path_prefix, why)) if call.hook is hook else call
            for call in self.calls
        ]

    def uneventful(self, outcome: str) -> bool:
        """No hook server was called or spared, and the call ended OK with nothing to say: a line would only
        repeat the runtime's own log (NRI mode writes none for it)."""
        return not self.calls and outcome == OK_LABEL and not self.why and not self.asked_lost

    def left_alone(self) -> Iterator[tuple[HookCall, Change]]:
        return ((call, change) for call in self.calls for change in call.changes if not change.applied)

    def fields(self, outcome: str, seconds: float) -> dict[str, object]:
        subject = self.subject
        container = ""
        if isinstance(subject, ContainerHookRequest):
            container = subject.container_meta.name
        meta = subject.pod_meta if subject is not None else None
        return {
            "method": self.method,
            "namespace": meta.namespace if meta else "",
            "pod": meta.name if meta else "",
            "uid": meta.uid if meta else "",
            "container": container,
            "container_part": f" container {container}" if container else "",
            "hooks": "; ".join(call_text(call) for call in self.calls) or "none",
            "hook_calls": [call_fields(call) for call in self.calls],
            "asked_lost": self.asked_lost,
            "asked_lost_part": ASKED_LOST if self.asked_lost else "",
            "outcome": outcome,
            "why": self.why,
            "why_part": f" ({self.why})" if self.why else "",
            "duration_ms": seconds * 1000,
        }


def write(record: CallRecord, outcome: str, seconds: float) -> None:
    fields = record.fields(outcome, seconds)
    # Formatted here, once, with str.format: twisted.logger's own formatting of FORMAT costs twice the whole
    # line again, on every lifecycle call. The fields stay in the event, for JSON logs.
    log.info("{call_line}", call_line=FORMAT.format(**fields), **fields)
