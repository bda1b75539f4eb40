"""What koordrp takes of a hook server's answer: the rules an answer's fields must keep before they are merged
(``koordrp.hooks.messages``), in every mode (docs/hook-server/merging.md).

A value the kernel, the runtime or the runtime's transport would refuse, or a cgroup parent outside the pod's
cgroup root, must never reach the runtime: there it fails the pod long after the answer, with nobody named.
``check`` reads an answer once, before it is used, and gives what may be merged: the answer itself, or, when
a field breaks a rule, a copy without that field, and each field it refused with why (``Refused``). The
dispatcher then applies the server's failure policy: Fail fails the call naming the server and the field,
Ignore merges the rest of the answer.

Only what an answer would change is checked: a value it echoes from the request (``reply(request)`` copies
the whole request) is kubelet's own and goes to the runtime as kubelet sent it, whatever it is.

The text here (``refused_text``, ``escaped``) is how log lines and refusal messages name what was refused:
bounded, with control characters and NUL written as Python writes them (``\\x00``, ``\\n``).
"""

import posixpath
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, MutableMapping

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.hooks.messages import (
    CPUSET_FIELDS,
    NON_ZERO_FIELDS,
    POSITIVE_FIELDS,
    IMAGE_NAME_ANNOTATION,
    Change,
    ContainerHookRequest,
    HookRequest,
    HookResponse,
    PodHookRequest,
    Resources,
    copied,
)
from koordrp.text import escaped, listed, quoted

# ---------------------------------------------------------------------------------------------
# The numbers, each the limit of whatever would refuse the value later

CPU_SHARES = (2, 262144)
"""The kernel's cpu.shares (cgroup v1's MIN_SHARES and MAX_SHARES; runc maps them onto cgroup v2's weight)."""
CPU_QUOTA = (1000, (1 << 44) - 1)
"""µs: the kernel's CFS bandwidth (at least 1 ms; at most its max_cfs_runtime); -1 is unlimited."""
CPU_PERIOD = (1000, 1000000)
"""µs: the kernel's CFS period, 1 ms to 1 s."""
MEMORY_MINIMUM = 4096
"""A memory (or memory+swap) limit below one page leaves nothing to run in."""
OOM_SCORE_ADJ = (-1000, 1000)
MAX_CPU = 8191
"""The highest CPU number a kernel can have (NR_CPUS is at most 8192)."""
MAX_MEMORY_NODE = 1023
"""The highest NUMA node number a kernel can have (MAX_NUMNODES is at most 1024)."""
MAX_CPU_LIST = 65536
"""Characters of a cpuset: the kernel takes a write of 100 + 6 × NR_CPUS at most."""
MAX_HUGEPAGE_SIZES = 16
PATH_MAX = 4096
NAME_MAX = 255
MAX_UNIFIED_VALUE = 4096
"""A cgroup file takes a page per write."""
MAX_ENV_ENTRY = 131072
"""Bytes of one ``K=V`` with its NUL: the kernel's MAX_ARG_STRLEN; exec fails with E2BIG beyond it."""
MAX_LABEL = 4096
"""Bytes of a label's key and value together: containerd refuses a larger label."""
MAX_MAP_CHANGES = 256 << 10
"""Bytes of keys and values one answer may change in one map (Kubernetes' limit on all of a pod's annotations)."""
TRANSPORT_LIMIT = 4 << 20
"""Bytes of one message of ttrpc, containerd's NRI transport: the smallest a runtime koordrp speaks carries (CRI's
gRPC takes 16 MiB)."""
TRANSPORT_ROOM = 256 << 10
"""What a runtime's message about a container holds besides what a hook request shows (mounts, args, devices)."""
MAX_REQUEST = TRANSPORT_LIMIT - TRANSPORT_ROOM
"""Bytes a hook request may come to as answered: so that the runtime's message about it stays within ttrpc's."""

_CPU_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")
_SLICE = re.compile(r"[A-Za-z0-9:_.\\]+(?:-[A-Za-z0-9:_.\\]+)*\.slice")
_PAGE_SIZE = re.compile(r"[1-9][0-9]{0,5}(?:KB|MB|GB)")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class Refused:
    """One field of an answer koordrp refuses, and why."""

    path: str
    """As ``messages.Change`` names it: ``container_resources.cpuset_cpus``, ``container_envs[KEY]``, or a map
    as a whole (``container_annotations``)."""
    value: object
    """What the answer said, where a log line may show it (resources, cgroup parents); None for environment
    variables, labels and annotations, which may hold secrets."""
    why: str


@dataclass(frozen=True)
class Checked:
    """An answer as koordrp may merge it, and what it refused of it."""

    response: HookResponse
    """The answer itself when nothing is refused; else a copy without the fields refused."""
    refused: tuple[Refused, ...] = ()

    @property
    def reason(self) -> str:
        """What was refused, for a warning and a refusal's message: the first few fields, then how many more."""
        return listed([refused_text(refused.path, refused.value, refused.why) for refused in self.refused], 3, "; ")

    def changes(self) -> list[Change]:
        """The fields refused, as the call's line names them (never applied)."""
        return [Change(refused.path, None, refused.value, applied=False, why=refused.why, refused=True) for refused in self.refused]


# ---------------------------------------------------------------------------------------------
# The rules, one value at a time (None: the value keeps them; else why not)


def cpu_list_error(value: str, highest: int = MAX_CPU, what: str = "cpu") -> str | None:
    """A cpuset as the kernel reads one (``0-3,5``): numbers and ranges, comma-separated; the empty string clears it."""
    if value == "":
        return None
    if len(value) > MAX_CPU_LIST:
        return f"not a {what} list: {len(value)} characters"
    for part in value.split(","):
        found = _CPU_RANGE.fullmatch(part)
        if found is None:
            return f"not a {what} list"
        low = int(found[1])
        high = low if found[2] is None else int(found[2])
        if high < low:
            return f"not a {what} list: {part} runs backwards"
        if high > highest:
            return f"{what} {high} is beyond the kernel's {highest}"
    return None


def _range_error(value: int, limits: tuple[int, int], unit: str = "") -> str | None:
    low, high = limits
    return None if low <= value <= high else f"outside the kernel's {low}..{high}{unit}"


def _number_error(name: str, value: int) -> str | None:
    if name == "cpu_shares":
        return _range_error(value, CPU_SHARES)
    if name == "cpu_period":
        return _range_error(value, CPU_PERIOD, " µs")
    if name == "cpu_quota":
        if value == -1:
            return None
        low, high = CPU_QUOTA
        return None if low <= value <= high else f"neither -1 (unlimited) nor within the kernel's {low}..{high} µs"
    if name == "oom_score_adj":
        return _range_error(value, OOM_SCORE_ADJ)
    # memory_limit_in_bytes, memory_swap_limit_in_bytes
    if value < 0:
        return "a negative limit"
    return None if value >= MEMORY_MINIMUM else f"below one page ({MEMORY_MINIMUM} bytes)"


def _cgroup_root(own: str) -> tuple[str, str] | None:
    """The form (``path`` or ``slice``) and root of the request's own cgroup parent; None: it has none to keep."""
    if _SLICE.fullmatch(own):
        return "slice", own[: -len(".slice")].split("-")[0]
    if own.startswith("/"):
        first = next((part for part in own.split("/") if part), "")
        return ("path", "/" + first) if first else None
    return None


def cgroup_parent_error(value: str, own: str) -> str | None:
    """A cgroup parent an answer may give: absolute and normalised (no empty, ``.`` or ``..`` part), or a systemd slice
    name; within the root the request's own parent ``own`` lives under: its first path component (``/kubepods``),
    or, for a slice name (``kubepods-besteffort-pod1.slice``), the same top slice (``kubepods``). Where the request
    has no parent of its own (none, ``/``, or one of neither form), any well-formed parent is within it."""
    if len(value) > PATH_MAX:
        return f"{len(value)} characters, beyond PATH_MAX ({PATH_MAX})"
    if _CONTROL.search(value):
        return "has a control character"
    root = _cgroup_root(own)
    if _SLICE.fullmatch(value):
        if root is None or root == ("slice", value[: -len(".slice")].split("-")[0]):
            return None
        if root[0] == "path":
            return f"a systemd slice name, where the request's own parent {quoted(own)} is a path"
        return f"outside the top slice {root[1]}.slice, where the request's own parent {quoted(own)} lives"
    if not value.startswith("/"):
        return "neither an absolute path nor a systemd slice name"
    parts = value.split("/")[1:]
    if ".." in parts:
        return "has a .. part"
    if value == "/" or posixpath.normpath(value) != value or value.startswith("//"):
        return "not normalised (an empty or . part)" if value != "/" else "the hierarchy's root, no cgroup of its own"
    if root is None:
        return None
    if root[0] == "slice":
        return f"a path, where the request's own parent {quoted(own)} is a systemd slice name"
    if value != root[1] and not value.startswith(root[1] + "/"):
        return f"outside {root[1]}, where the request's own parent {quoted(own)} lives"
    return None


def _key_error(key: str, what: str) -> str | None:
    if key == "":
        return f"an empty {what}"
    if "\x00" in key:
        return f"a {what} with a NUL byte"
    return None


def env_error(key: str, value: str) -> str | None:
    """An environment variable the kernel can give a process."""
    error = _key_error(key, "name")
    if error is not None:
        return error
    if "=" in key:
        return "a name with ="
    if "\x00" in value:
        return "a value with a NUL byte"
    size = _size(key) + _size(value) + 2
    return None if size <= MAX_ENV_ENTRY else f"{size} bytes, beyond the kernel's {MAX_ENV_ENTRY} for one variable"


def _entry_error(key: str, value: str, limit: int, whose: str) -> str | None:
    """A map entry's key, and the entry within ``limit`` bytes (``whose`` limit it is, for the message)."""
    error = _key_error(key, "key")
    if error is not None:
        return error
    size = _size(key) + _size(value)
    return None if size <= limit else f"{size} bytes, beyond {whose}"


def label_error(key: str, value: str) -> str | None:
    return _entry_error(key, value, MAX_LABEL, f"containerd's {MAX_LABEL} for a label")


def annotation_error(key: str, value: str) -> str | None:
    return _entry_error(key, value, MAX_MAP_CHANGES, f"the {MAX_MAP_CHANGES} one answer may change in a map")


def unified_error(key: str, value: str) -> str | None:
    """A cgroup v2 file (a name in the container's own cgroup) and what is written to it."""
    if key in ("", ".", "..") or _CONTROL.search(key) or "/" in key:
        return "not a cgroup file name"
    if len(key) > NAME_MAX:
        return f"a file name beyond NAME_MAX ({NAME_MAX})"
    if "\x00" in value or "\n" in value:
        return "a value with a NUL byte or a newline"
    size = _size(value)
    return None if size <= MAX_UNIFIED_VALUE else f"{size} bytes, beyond the {MAX_UNIFIED_VALUE} a cgroup file takes"


def _size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


# ---------------------------------------------------------------------------------------------
# An answer, field by field

UNSET = -1
"""What koordlet answers for a limit it leaves unset (a best-effort container's memory): the merge, as
Koordinator's, takes no value below 1 for these fields, so it is not refused either."""
"""The numbers of resources: 0 is "not mentioned" (the merge takes what is > 0, or ≠ 0), anything else is checked."""


class _Checking:
    """One answer being checked: the copy made at its first refusal, and what was refused."""

    def __init__(self, request: HookRequest, response: HookResponse) -> None:
        self.request = request
        self.response = response
        self._copy: HookResponse | None = None
        self.refused: list[Refused] = []
        self.growth: list[_Growth] = []
        """What each map's changes would add to the request, for the transport's rule."""

    def kept(self) -> HookResponse:
        if self._copy is None:
            self._copy = copied(self.response)
        return self._copy

    def refuse(self, path: str, value: object, why: str, drop: Callable[[HookResponse], None]) -> None:
        self.refused.append(Refused(path, value, why))
        drop(self.kept())

    def result(self) -> Checked:
        return Checked(self._copy if self._copy is not None else self.response, tuple(self.refused))

    def map(
        self,
        name: str,
        request: Mapping[str, str],
        answer: Mapping[str, str],
        error: Callable[[str, str], str | None],
        shown: bool = False,
        prefix: str = "",
        skip: str | None = None,
    ) -> None:
        """A map merged key by key: each entry it would change, then what they come to together."""
        path = prefix + name
        changed: list[str] = []
        size = 0
        for key, value in answer.items():
            if key == skip or request.get(key) == value:
                continue
            why = error(key, value)
            if why is None:
                changed.append(key)
                size += _size(key) + _size(value)
                continue
            self.refuse(f"{path}[{key}]", value if shown else None, why, _dropping_entry(prefix, name, key))
        if size > MAX_MAP_CHANGES:
            why = f"its changes come to {size} bytes, beyond the {MAX_MAP_CHANGES} one answer may change in a map"
            self.refuse(path, None, why, _dropping_entries(prefix, name, changed))
        elif changed:
            self.growth.append(_Growth(prefix, name, tuple(changed), size + 8 * len(changed)))  # each entry's tags and lengths

    def resources(self, request: Resources, answer: Resources, prefix: str) -> None:
        # Checked is what the merge would take (POSITIVE_FIELDS above 0, NON_ZERO_FIELDS but 0), and any other
        # negative, which no kernel takes: only koordlet's UNSET passes unsaid, as Koordinator's merge ignores it.
        for name in POSITIVE_FIELDS + NON_ZERO_FIELDS:
            value = getattr(answer, name)
            ignored = value == 0 or (name in POSITIVE_FIELDS and value == UNSET)
            if not ignored and value != getattr(request, name):
                self._number(prefix, name, value)
        for name in CPUSET_FIELDS:
            value = getattr(answer, name)
            if value != getattr(request, name):
                highest, what = (MAX_CPU, "cpu") if name == "cpuset_cpus" else (MAX_MEMORY_NODE, "memory node")
                why = cpu_list_error(value, highest, what)
                if why is not None:
                    kept = getattr(request, name)
                    self.refuse(prefix + name, value, why, _resetting(prefix, name, kept))
        if answer.hugepage_limits and list(answer.hugepage_limits) != list(request.hugepage_limits):
            why = _hugepages_error(answer)
            if why is not None:
                shown = [f"{limit.page_size}:{limit.limit}" for limit in answer.hugepage_limits[:MAX_HUGEPAGE_SIZES]]
                self.refuse(prefix + "hugepage_limits", shown, why, _clearing(prefix, "hugepage_limits"))
        self.map("unified", request.unified, answer.unified, unified_error, shown=True, prefix=prefix)

    def _number(self, prefix: str, name: str, value: int) -> None:
        why = _number_error(name, value)
        if why is not None:
            self.refuse(prefix + name, value, why, _resetting(prefix, name, 0))

    def cgroup_parent(self, name: str, value: str, own: str) -> None:
        if value and value != own:
            why = cgroup_parent_error(value, own)
            if why is not None:
                self.refuse(name, value, why, _resetting("", name, ""))

    def transport(self) -> None:
        """The request as answered must stay within what the runtime's message about it can carry: beyond, the maps
        that would grow it most are refused until it fits."""
        if not self.growth:
            return
        grown = self.request.ByteSize() + sum(growth.size for growth in self.growth)
        if grown <= MAX_REQUEST:
            return
        why = (
            f"the request would come to about {grown} bytes, beyond the {MAX_REQUEST} that leave room for the rest of "
            f"the runtime's message within ttrpc's {TRANSPORT_LIMIT >> 20} MiB"
        )
        for growth in sorted(self.growth, key=lambda growth: -growth.size):
            self.refuse(growth.prefix + growth.name, None, why, _dropping_entries(growth.prefix, growth.name, growth.keys))
            grown -= growth.size
            if grown <= MAX_REQUEST:
                return


@dataclass(frozen=True)
class _Growth:
    prefix: str
    name: str
    keys: tuple[str, ...]
    size: int


def _hugepages_error(answer: Resources) -> str | None:
    limits = answer.hugepage_limits
    if len(limits) > MAX_HUGEPAGE_SIZES:
        return f"{len(limits)} page sizes, beyond {MAX_HUGEPAGE_SIZES}"
    sizes = [limit.page_size for limit in limits]
    for size in sizes:
        if not _PAGE_SIZE.fullmatch(size):
            return f"page size {quoted(size, 20)} is not one the kernel names (such as 2MB, 1GB)"
    if len(set(sizes)) != len(sizes):
        return "a page size given twice"
    return None


def _holder(response: HookResponse, prefix: str) -> object:
    return getattr(response, prefix[:-1]) if prefix else response


def _dropping_entry(prefix: str, name: str, key: str) -> Callable[[HookResponse], None]:
    def drop(response: HookResponse) -> None:
        target: MutableMapping[str, str] = getattr(_holder(response, prefix), name)
        del target[key]

    return drop


def _dropping_entries(prefix: str, name: str, keys: Iterable[str]) -> Callable[[HookResponse], None]:
    dropped = list(keys)

    def drop(response: HookResponse) -> None:
        target: MutableMapping[str, str] = getattr(_holder(response, prefix), name)
        for key in dropped:
            target.pop(key, None)

    return drop


def _resetting(prefix: str, name: str, value: object) -> Callable[[HookResponse], None]:
    """The field set to what changes nothing: 0 or "" (not mentioned), or for a cpuset the request's own."""
    return lambda response: setattr(_holder(response, prefix), name, value)


def _clearing(prefix: str, name: str) -> Callable[[HookResponse], None]:
    def drop(response: HookResponse) -> None:
        del getattr(_holder(response, prefix), name)[:]

    return drop


def check(request: HookRequest, response: HookResponse, apply_pod_resources: bool = False) -> Checked:
    """What of ``response`` may be merged into ``request`` (as ``messages.merge_response`` merges it), and what not.

    Pod-level resources are checked only for a server whose answer applies them (``apply_pod_resources``): others
    are left alone by the merge, unused.
    """
    checking = _Checking(request, response)
    if isinstance(request, PodHookRequest):
        assert isinstance(response, hook.PodSandboxHookResponse)
        checking.map("labels", request.labels, response.labels, label_error)
        checking.map("annotations", request.annotations, response.annotations, annotation_error)
        checking.cgroup_parent("cgroup_parent", response.cgroup_parent, request.cgroup_parent)
        if apply_pod_resources and response.HasField("resources"):
            checking.resources(request.resources, response.resources, "resources.")
    else:
        assert isinstance(request, ContainerHookRequest) and isinstance(response, hook.ContainerResourceHookResponse)
        checking.map(
            "container_annotations",
            request.container_annotations,
            response.container_annotations,
            annotation_error,
            skip=IMAGE_NAME_ANNOTATION,  # the merge leaves another image name alone, and names it
        )
        checking.map("container_envs", request.container_envs, response.container_envs, env_error)
        if response.HasField("container_resources"):
            checking.resources(request.container_resources, response.container_resources, "container_resources.")
        checking.cgroup_parent("pod_cgroup_parent", response.pod_cgroup_parent, request.pod_cgroup_parent)
    checking.transport()
    return checking.result()


# ---------------------------------------------------------------------------------------------
# Naming what was refused

# How a line names a hook message's fields: as an operator thinks of them.
_NAMES = (
    ("container_resources.", "resources."),
    ("pod_cgroup_parent", "cgroup_parent"),
    ("container_envs", "envs"),
    ("container_annotations", "annotations"),
)


def field_text(path: str) -> str:
    """A field as log lines name it (``resources.cpuset_cpus``, ``envs[KEY]``), its map key escaped."""
    for long, short in _NAMES:
        if path.startswith(long):
            path = short + path[len(long) :]
            break
    name, bracket, key = path.partition("[")
    return f"{name}[{escaped(key[:-1], 80)}]" if bracket else name


def refused_text(path: str, value: object, why: str) -> str:
    """``refused resources.cpuset_cpus "abc": not a cpu list``: the field, the value where it may be shown, why."""
    shown = "" if value is None else " " + value_text(value)
    return f"refused {field_text(path)}{shown}: {why}"


def value_text(value: object, limit: int = 80) -> str:
    """A value as a log line shows it: a string quoted and escaped, anything else as Python writes it; bounded."""
    if isinstance(value, str):
        return quoted(value, limit)
    return escaped(str(value), limit)


