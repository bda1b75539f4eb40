"""Properties that must hold for any input: hook registrations, merge rules, runtime info.

Hypothesis generates the inputs. The settings are fixed for CI: no deadline (a loaded CI machine is
slow, not wrong), a bounded number of examples, and derandomize=True so that every run, here and in
CI, tries the very same examples; nothing is written to a .hypothesis database.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from koordrp.api.cri.v1 import api_pb2 as cri
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.cri import translate
from koordrp.hooks import messages
from koordrp.hooks.config import MAX_SOCKET_PATH_BYTES, HookConfigError, parse_hook_server_config
from koordrp.hooks.types import HOOKS_BY_NAME, FailurePolicy, HookServerConfig, HookType
from koordrp.cri.runtime_info import (
    RuntimeInfoError,
    container_info_from_status,
    container_sandbox_id,
    pod_info_from_status,
)

CI = settings(
    deadline=None,
    max_examples=150,
    derandomize=True,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1

# ---------------------------------------------------------------------------------------------
# Shared strategies

LONE_SURROGATES = ("\ud800", "\udfff")

# Strings JSON can carry but no path or protobuf string can: lone surrogates, NUL, newlines.
hostile_text = st.lists(
    st.characters() | st.sampled_from(LONE_SURROGATES + ("\0", "\n", "\r", "\u2028", "\x85", "=", "/")),
    max_size=12,
).map("".join)
any_text = st.text(max_size=16) | hostile_text


def json_values(keys: st.SearchStrategy[str], strings: st.SearchStrategy[str] = any_text) -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.sampled_from([0, -1, 1, 2**63, -(2**63) - 1, 2**64, 10**400])
        | st.floats()  # NaN and the infinities included: json.dumps spells them NaN/Infinity
        | strings
        | st.sampled_from(LONE_SURROGATES)
    )
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=4) | st.dictionaries(keys, children, max_size=4),
        max_leaves=12,
    )


def to_json(draw: Callable[[Any], Any], document: Any) -> bytes:
    """``document`` as JSON bytes; non-ASCII left raw sometimes, so lone surrogates become bad UTF-8."""
    text = json.dumps(document, ensure_ascii=draw(st.sampled_from([True, True, False])), allow_nan=True)
    return text.encode("utf-8", "surrogatepass")


def one_line(test: SynchronousTestCase, reason: object) -> None:
    test.assertIsInstance(reason, str)
    assert isinstance(reason, str)
    test.assertTrue(reason, "the reason is empty")
    test.assertEqual(len(reason.splitlines()), 1, f"not one line: {reason!r}")
    test.assertNotIn("\n", reason)
    test.assertNotIn("\r", reason)


# ---------------------------------------------------------------------------------------------
# 1. hookserver.d registrations

HOOK_NAMES = [hook_type.value for hook_type in HookType]
CONFIG_KEYS = ["remote-endpoint", "failure-policy", "runtime-hooks", "timeout-seconds"]
DEFAULT_TIMEOUT = 2.0

config_keys = st.sampled_from(CONFIG_KEYS) | st.text(max_size=8)
junk = json_values(config_keys)

path_chars = st.sampled_from("abz09._-/") | st.characters()
absolute_paths = st.lists(path_chars, max_size=40).map(lambda chars: "/" + "".join(chars))
good_endpoints = absolute_paths | absolute_paths.map(lambda path: "unix://" + path)
endpoints = st.one_of(
    good_endpoints,
    good_endpoints,
    good_endpoints,
    st.text(min_size=100, max_size=130, alphabet="ab/").map(lambda path: "/" + path),  # around 107 bytes
    st.text(min_size=400, max_size=500, alphabet="é/").map(lambda path: "/" + path),  # multi-byte, long
    st.sampled_from(["", "/", "//", "unix://", "unix:///", "tcp://127.0.0.1:1", "unix://rel/x", "relative/x", "/a\0b"]),
    any_text,
    any_text.map(lambda text: "/" + text),
    junk,
)
policies = st.sampled_from(["Fail", "Ignore"]) | st.sampled_from(["Fail", "Ignore", "fail", "", "Ignore "]) | junk
hook_lists = st.one_of(
    st.lists(st.sampled_from(HOOK_NAMES), max_size=8),
    st.lists(st.sampled_from(HOOK_NAMES), max_size=8),
    st.lists(st.sampled_from(HOOK_NAMES) | st.sampled_from(["", "preRunPodSandbox"]) | junk, max_size=5),
    junk,
)
timeouts = st.one_of(
    st.integers(min_value=-5, max_value=10**6),
    st.floats(min_value=0.001, max_value=1e6),
    st.floats(),
    st.sampled_from([0, 0.0, -0.0, 1e-320, 5e-324, 1e308, 10**400, 2**1024, True, False, "3", None]),
    junk,
)


@st.composite
def registration_documents(draw: Callable[[Any], Any]) -> Any:
    """A JSON object mixing the four known fields (valid or not) with junk; sometimes not an object."""
    # sampled_from, not integers: hypothesis favours an integer range's ends.
    if draw(st.sampled_from([False] * 9 + [True])):
        return draw(junk)
    document: dict[str, Any] = draw(st.dictionaries(st.text(max_size=8), junk, max_size=3))
    for key, values in zip(CONFIG_KEYS, (endpoints, policies, hook_lists, timeouts)):
        if draw(st.sampled_from([True] * 5 + [False])):
            document[key] = draw(values)
    return document


@st.composite
def registration_bytes(draw: Callable[[Any], Any]) -> bytes:
    """Raw bytes: arbitrary, or a registration mangled (truncated, bytes flipped or inserted)."""
    kind = draw(st.sampled_from([0, 1, 2]))
    if kind == 0:
        return bytes(draw(st.binary(max_size=200)))
    valid = json.dumps(
        {"remote-endpoint": "/run/k.sock", "failure-policy": "Fail", "runtime-hooks": HOOK_NAMES, "timeout-seconds": 3}
    ).encode()
    if kind == 1:
        return valid[: draw(st.integers(0, len(valid)))]
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        data[at:at + draw(st.integers(0, 1))] = draw(st.binary(min_size=1, max_size=3))
    return bytes(data)


def expected_endpoint(value: str) -> str:
    return os.path.normpath(value.removeprefix("unix://"))


class HookConfigPropertyTests(SynchronousTestCase):
    def check(self, data: bytes) -> HookServerConfig | None:
        """Parse ``data``: a valid config, or a HookConfigError with a one-line reason, nothing else."""
        try:
            config = parse_hook_server_config("fuzz.json", data, DEFAULT_TIMEOUT)
        except HookConfigError as error:
            one_line(self, error.reason)
            self.assertEqual(str(error), error.reason)
            return None
        self.assertIsInstance(config, HookServerConfig)
        self.assertEqual(config.name, "fuzz.json")
        endpoint = config.endpoint
        self.assertIsInstance(endpoint, str)
        self.assertTrue(os.path.isabs(endpoint), endpoint)
        self.assertNotIn("\0", endpoint)
        self.assertLessEqual(len(endpoint.encode("utf-8")), MAX_SOCKET_PATH_BYTES)
        self.assertEqual(os.path.normpath(endpoint), endpoint)
        self.assertIsInstance(config.failure_policy, FailurePolicy)
        self.assertIsInstance(config.hooks, frozenset)
        self.assertTrue(all(isinstance(hook_type, HookType) for hook_type in config.hooks), config.hooks)
        self.assertIsInstance(config.timeout, float)
        self.assertTrue(math.isfinite(config.timeout) and config.timeout > 0, config.timeout)
        return config

    @CI
    @given(registration_bytes())
    def test_arbitrary_bytes_give_a_config_or_a_one_line_reason(self, data: bytes) -> None:
        self.check(data)

    @CI
    @given(st.data())
    def test_json_documents_give_the_config_they_describe_or_a_one_line_reason(self, data: st.DataObject) -> None:
        document = data.draw(registration_documents())
        config = self.check(to_json(data.draw, document))
        if config is None:
            return
        # What was accepted is exactly what the document says.
        assert isinstance(document, dict)
        self.assertEqual(config.endpoint, expected_endpoint(document["remote-endpoint"]))
        policy = document.get("failure-policy")
        self.assertEqual(config.failure_policy, FailurePolicy.IGNORE if policy in (None, "") else FailurePolicy(policy))
        names = document.get("runtime-hooks") or []
        self.assertEqual(config.hooks, frozenset(HookType(name) for name in names if name in HOOKS_BY_NAME))
        self.assertEqual(len(config.ignored_stages), len({name for name in names if name not in HOOKS_BY_NAME}))
        timeout = document.get("timeout-seconds")
        self.assertEqual(config.timeout, DEFAULT_TIMEOUT if timeout is None else float(timeout))


# ---------------------------------------------------------------------------------------------
# 2. Merging hook responses

# Protobuf strings are valid Unicode; keys are drawn from a few letters so that maps overlap.
proto_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=8)
map_keys = st.text("abc", max_size=2) | proto_text
string_maps = st.dictionaries(map_keys, proto_text, max_size=5)
int64s = st.one_of(st.just(0), st.integers(-3, 3), st.integers(INT64_MIN, INT64_MAX))
uint32s = st.integers(0, 2**32 - 1)
hugepages = st.lists(
    st.builds(hook.HugepageLimit, page_size=st.sampled_from(["2MB", "1GB", ""]) | proto_text, limit=st.integers(0, UINT64_MAX)),
    max_size=3,
)

NUMBER_FIELDS = ("cpu_period", "cpu_quota", "cpu_shares", "memory_limit_in_bytes", "oom_score_adj", "memory_swap_limit_in_bytes")
POSITIVE_FIELDS = ("cpu_period", "cpu_shares", "memory_limit_in_bytes", "memory_swap_limit_in_bytes")
NON_ZERO_FIELDS = ("cpu_quota", "oom_score_adj")
STRING_FIELDS = ("cpuset_cpus", "cpuset_mems")


def linux_resources(fields: dict[str, Any]) -> hook.LinuxContainerResources:
    return hook.LinuxContainerResources(**fields)


# Each field present or not, so that answers mention only some of them, as plugins' answers do.
resources = st.fixed_dictionaries(
    {},
    optional={
        **{name: int64s for name in NUMBER_FIELDS},
        **{name: st.sampled_from(["0", "0-1", "1,3"]) | proto_text for name in STRING_FIELDS},
        "hugepage_limits": hugepages,
        "unified": string_maps,
    },
).map(linux_resources)


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


_Message = TypeVar("_Message", bound=Message)


def message(cls: type[_Message], **fields: Any) -> _Message:
    """``cls`` with the fields that are not None (sub-messages left unset stay absent)."""
    return cls(**{name: value for name, value in fields.items() if value is not None})


# An unknown field (number 100, varint) a newer peer may send: merging must keep it.
UNKNOWN_FIELD = bytes([0xA0, 0x06, 0x05])


def with_unknown(cls: type[_Message], request: Message, add: bool) -> _Message:
    return cls.FromString(request.SerializeToString() + (UNKNOWN_FIELD if add else b""))


@st.composite
def pod_requests(draw: Callable[[Any], Any]) -> hook.PodSandboxHookRequest:
    request = message(
        hook.PodSandboxHookRequest,
        pod_meta=hook.PodSandboxMetadata(name=draw(proto_text), uid=draw(proto_text), namespace=draw(proto_text), attempt=draw(uint32s)),
        runtime_handler=draw(proto_text),
        labels=draw(string_maps),
        annotations=draw(string_maps),
        cgroup_parent=draw(proto_text),
        overhead=draw(optional(resources)),
        resources=draw(optional(resources)),
    )
    return with_unknown(hook.PodSandboxHookRequest, request, draw(st.booleans()))


@st.composite
def pod_responses(draw: Callable[[Any], Any]) -> hook.PodSandboxHookResponse:
    return message(
        hook.PodSandboxHookResponse,
        labels=draw(string_maps),
        annotations=draw(string_maps),
        cgroup_parent=draw(st.just("") | proto_text),
        resources=draw(optional(resources)),
    )


@st.composite
def container_requests(draw: Callable[[Any], Any]) -> hook.ContainerResourceHookRequest:
    request = message(
        hook.ContainerResourceHookRequest,
        pod_meta=hook.PodSandboxMetadata(name=draw(proto_text), uid=draw(proto_text), namespace=draw(proto_text), attempt=draw(uint32s)),
        container_meta=hook.ContainerMetadata(name=draw(proto_text), attempt=draw(uint32s), id=draw(proto_text)),
        container_annotations=draw(string_maps),
        container_resources=draw(optional(resources)),
        pod_resources=draw(optional(resources)),
        pod_annotations=draw(string_maps),
        pod_labels=draw(string_maps),
        pod_cgroup_parent=draw(proto_text),
        container_envs=draw(string_maps),
    )
    return with_unknown(hook.ContainerResourceHookRequest, request, draw(st.booleans()))


@st.composite
def container_responses(draw: Callable[[Any], Any]) -> hook.ContainerResourceHookResponse:
    return message(
        hook.ContainerResourceHookResponse,
        container_annotations=draw(string_maps),
        container_resources=draw(optional(resources)),
        pod_cgroup_parent=draw(st.just("") | proto_text),
        container_envs=draw(string_maps),
    )


def copied(original: Any) -> Any:
    duplicate = type(original)()
    duplicate.CopyFrom(original)
    return duplicate


def merged(request: Any, *responses: Any) -> Any:
    """A fresh copy of ``request`` with ``responses`` merged in turn, as the hook chain does (by a server
    that asks for its pod-level resources to apply)."""
    result = copied(request)
    for response in responses:
        messages.merge_response(result, response, apply_pod_resources=True)
    return result


def unknown(message: Any) -> list[tuple[int, int, Any]]:
    # iter(): the stubs give UnknownFieldSet only the old sequence protocol (__getitem__ and __len__).
    return [(field.field_number, field.wire_type, field.data) for field in iter(UnknownFieldSet(message))]


class MergeModel:
    """The merge rules of docs/hook-server/merging.md, written out field by field, against which merges are checked."""

    def __init__(self, test: SynchronousTestCase) -> None:
        self.test = test

    def resources(self, before: Any, response: Any, after: Any) -> None:
        for name in POSITIVE_FIELDS:
            wanted = getattr(response, name) if getattr(response, name) > 0 else getattr(before, name)
            self.test.assertEqual(getattr(after, name), wanted, name)
        for name in NON_ZERO_FIELDS:
            wanted = getattr(response, name) if getattr(response, name) != 0 else getattr(before, name)
            self.test.assertEqual(getattr(after, name), wanted, name)
        for name in STRING_FIELDS:  # the cpuset the answer carries, the empty one included
            self.test.assertEqual(getattr(after, name), getattr(response, name), name)
        self.test.assertEqual(list(after.hugepage_limits), list(response.hugepage_limits or before.hugepage_limits))
        self.test.assertEqual(dict(after.unified), {**before.unified, **response.unified})

    def same_message(self, holder_before: Any, holder_after: Any, name: str) -> None:
        """A sub-message the response has no say in: present exactly as before, with the same content."""
        self.test.assertEqual(holder_after.HasField(name), holder_before.HasField(name), f"{name} presence")
        self.test.assertEqual(getattr(holder_after, name), getattr(holder_before, name), name)

    def map(self, before: Any, response: Any, after: Any, name: str) -> None:
        self.test.assertEqual(dict(after), {**before, **response}, name)

    def resources_field(self, before: Any, response: Any, after: Any, request_name: str, response_name: str) -> None:
        if response.HasField(response_name):
            self.resources(getattr(before, request_name), getattr(response, response_name), getattr(after, request_name))
            if before.HasField(request_name):
                self.test.assertTrue(after.HasField(request_name), request_name)
        else:
            self.same_message(before, after, request_name)

    def pod(self, before: Any, response: Any, after: Any) -> None:
        self.map(before.labels, response.labels, after.labels, "labels")
        self.map(before.annotations, response.annotations, after.annotations, "annotations")
        self.test.assertEqual(after.cgroup_parent, response.cgroup_parent or before.cgroup_parent)
        self.resources_field(before, response, after, "resources", "resources")
        self.same_message(before, after, "pod_meta")
        self.same_message(before, after, "overhead")
        self.test.assertEqual(after.runtime_handler, before.runtime_handler)
        self.test.assertEqual(unknown(after), unknown(before))

    def container(self, before: Any, response: Any, after: Any) -> None:
        self.map(before.container_annotations, response.container_annotations, after.container_annotations, "annotations")
        self.map(before.container_envs, response.container_envs, after.container_envs, "envs")
        self.test.assertEqual(after.pod_cgroup_parent, response.pod_cgroup_parent or before.pod_cgroup_parent)
        self.resources_field(before, response, after, "container_resources", "container_resources")
        for name in ("pod_meta", "container_meta", "pod_resources"):
            self.same_message(before, after, name)
        self.test.assertEqual(dict(after.pod_annotations), dict(before.pod_annotations))
        self.test.assertEqual(dict(after.pod_labels), dict(before.pod_labels))
        self.test.assertEqual(unknown(after), unknown(before))


class MergePropertyTests(SynchronousTestCase):
    def check_merge(self, request: Any, responses: list[Any], model: Callable[[Any, Any, Any], None]) -> None:
        before = copied(request)
        for response in responses:
            after = merged(before, response)
            model(before, response, after)
            before = after
        # The whole chain at once gives the same as step by step, and leaves its input alone.
        self.assertEqual(merged(request, *responses), before)

    @CI
    @given(pod_requests(), st.lists(pod_responses(), min_size=1, max_size=3))
    def test_pod_merge_changes_only_what_the_answers_mention(self, request: Any, responses: list[Any]) -> None:
        self.check_merge(request, responses, MergeModel(self).pod)

    @CI
    @given(pod_requests(), pod_responses())
    def test_pod_resources_are_left_alone_unless_the_server_asks(self, request: Any, response: Any) -> None:
        result = copied(request)
        messages.merge_response(result, response)
        self.assertEqual(result.resources, request.resources)
        self.assertEqual(result.HasField("resources"), request.HasField("resources"))

    @CI
    @given(container_requests(), st.lists(container_responses(), min_size=1, max_size=3))
    def test_container_merge_changes_only_what_the_answers_mention(self, request: Any, responses: list[Any]) -> None:
        self.check_merge(request, responses, MergeModel(self).container)

    @CI
    @given(st.one_of(st.tuples(pod_requests(), pod_responses()), st.tuples(container_requests(), container_responses())))
    def test_merging_is_deterministic(self, pair: tuple[Any, Any]) -> None:
        request, response = pair
        wire, answer = request.SerializeToString(), response.SerializeToString()
        outputs = []
        for _ in range(2):
            fresh = type(request).FromString(wire)
            messages.merge_response(fresh, type(response).FromString(answer))
            outputs.append((fresh.SerializeToString(), fresh.SerializeToString(deterministic=True)))
        self.assertEqual(outputs[0], outputs[1])

    @CI
    @given(st.one_of(st.tuples(pod_requests(), pod_responses()), st.tuples(container_requests(), container_responses())))
    def test_merging_the_same_answer_twice_is_merging_it_once(self, pair: tuple[Any, Any]) -> None:
        request, response = pair
        once = merged(request, response)
        twice = merged(once, response)
        self.assertEqual(twice, once)
        self.assertEqual(twice.SerializeToString(deterministic=True), once.SerializeToString(deterministic=True))

    @CI
    @given(
        st.lists(st.tuples(st.sampled_from("ABCD") | proto_text, proto_text), max_size=8),
        st.dictionaries(st.sampled_from("ABCDE") | proto_text, proto_text, max_size=4),
    )
    def test_apply_envs_keeps_kubelets_order(self, pairs: list[tuple[str, str]], answer: dict[str, str]) -> None:
        envs = [cri.KeyValue(key=key, value=value.encode()) for key, value in pairs]
        before = {key: value for key, value in pairs}  # what the hook request says: the last value wins
        after = {**before, **answer}
        result = [(env.key, env.value.decode()) for env in translate.apply_envs(envs, before, after)]
        changed = {key for key, value in after.items() if before.get(key) != value}
        # kubelet's entries stay where they were, duplicates included; unchanged keys keep their values.
        self.assertEqual([key for key, _ in result[: len(pairs)]], [key for key, _ in pairs])
        for (key, value), (_, now) in zip(pairs, result):
            self.assertEqual(now, after[key] if key in changed else value, key)
        # New keys come after them, sorted, once each.
        self.assertEqual([key for key, _ in result[len(pairs):]], sorted(changed - set(before)))
        self.assertEqual(dict(result[len(pairs):]), {key: after[key] for key in changed - set(before)})

    @CI
    @given(
        st.lists(st.tuples(st.sampled_from("ABCD") | proto_text, proto_text), max_size=8),
        container_responses(),
        string_maps,
        proto_text,
    )
    def test_create_container_gets_only_the_hooks_changes(
        self, pairs: list[tuple[str, str]], response: Any, annotations: dict[str, str], parent: str
    ) -> None:
        request = cri.CreateContainerRequest(
            pod_sandbox_id="sandbox",
            config=cri.ContainerConfig(
                metadata=cri.ContainerMetadata(name="c"),
                envs=[cri.KeyValue(key=key, value=value.encode()) for key, value in pairs],
                annotations=annotations,
                labels={"keep": "me"},
            ),
            sandbox_config=cri.PodSandboxConfig(linux=cri.LinuxPodSandboxConfig(cgroup_parent=parent)),
        )
        wire = request.SerializeToString()
        pod = hook.PodSandboxHookRequest(cgroup_parent=parent)
        # As flows.create_container builds them: the container as kubelet's request has it, placed in its pod.
        sent = translate.container_hook_request(request)
        before = messages.placed_in_pod(copied(sent), pod)
        after = merged(before, response)
        changed = translate.apply_to_create_container(request, sent, after)
        self.assertEqual(changed, request.SerializeToString() != wire)
        if after == before:
            self.assertFalse(changed, "a request no hook changed must go out as kubelet's bytes")
        self.assertEqual([env.key for env in request.config.envs[: len(pairs)]], [key for key, _ in pairs])
        self.assertEqual(dict(request.config.annotations), {**annotations, **response.container_annotations})
        self.assertEqual(dict(request.config.labels), {"keep": "me"})
        self.assertEqual(request.pod_sandbox_id, "sandbox")


# ---------------------------------------------------------------------------------------------
# 3. Reading the runtime's verbose info

# Names the readers look for, so that junk lands where it is read, not only beside it.
INFO_KEYS = [
    "config", "metadata", "name", "uid", "namespace", "attempt", "linux", "resources", "overhead",
    "cgroup_parent", "labels", "annotations", "envs", "key", "value", "cpu_period", "cpu_quota",
    "cpu_shares", "memory_limit_in_bytes", "oom_score_adj", "cpuset_cpus", "hugepage_limits",
    "page_size", "limit", "unified", "security_context", "runtimeSpec", "runtimeHandler", "sandboxID",
    "process", "oomScoreAdj", "cpu", "memory", "swap", "period", "quota", "shares", "cpus", "mems",
    "hugepageLimits", "pageSize", "io.kubernetes.cri.sandbox-name", "io.kubernetes.cri.sandbox-uid",
    "io.kubernetes.cri.sandbox-namespace", "cpuPeriod", "memoryLimitInBytes",
]
info_keys = st.sampled_from(INFO_KEYS) | st.text(max_size=6) | st.sampled_from(LONE_SURROGATES)
info_junk = json_values(info_keys)

CONTAINER_FIXTURES = [
    "container_status_created.json",
    "container_status_updated.json",
    "container_status_hugepages.json",
]
POD_FIXTURES = ["pod_sandbox_status.json", "pod_sandbox_status_bare.json"]


def load(name: str, message_class: Any) -> Any:
    return json_format.Parse((FIXTURES / name).read_text(), message_class())


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document, the root included."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths(item, prefix + (index,))
    return found


def replaced(document: Any, path: tuple[Any, ...], new: Any) -> Any:
    """``document`` with ``new`` at ``path``; missing (or non-container) places on the way are made."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(head, int):
        copy: Any = list(document) if isinstance(document, list) and document else [{}]
        head = min(head, len(copy) - 1)
    else:
        copy = dict(document) if isinstance(document, dict) else {}
    copy[head] = replaced(copy[head] if isinstance(copy, list) else copy.get(head), rest, new)
    return copy


# Where the readers look: junk is also put there, whether or not the fixture has that place.
READ_PATHS: list[tuple[Any, ...]] = [
    ("sandboxID",),
    ("runtimeHandler",),
    ("config",),
    ("config", "metadata"),
    ("config", "metadata", "name"),
    ("config", "metadata", "attempt"),
    ("config", "labels", "app"),
    ("config", "annotations"),
    ("config", "annotations", "x"),
    ("config", "envs"),
    ("config", "envs", 0),
    ("config", "envs", 0, "key"),
    ("config", "envs", 0, "value"),
    ("config", "linux"),
    ("config", "linux", "cgroup_parent"),
    ("config", "linux", "overhead"),
    ("config", "linux", "resources"),
    ("config", "linux", "resources", "cpu_shares"),
    ("config", "linux", "resources", "cpuset_cpus"),
    ("config", "linux", "resources", "oom_score_adj"),
    ("config", "linux", "resources", "hugepage_limits"),
    ("config", "linux", "resources", "hugepage_limits", 0, "limit"),
    ("config", "linux", "resources", "unified"),
    ("runtimeSpec",),
    ("runtimeSpec", "annotations"),
    ("runtimeSpec", "annotations", "io.kubernetes.cri.sandbox-name"),
    ("runtimeSpec", "annotations", "io.kubernetes.cri.sandbox-uid"),
    ("runtimeSpec", "process"),
    ("runtimeSpec", "process", "oomScoreAdj"),
    ("runtimeSpec", "linux", "resources"),
    ("runtimeSpec", "linux", "resources", "cpu"),
    ("runtimeSpec", "linux", "resources", "cpu", "shares"),
    ("runtimeSpec", "linux", "resources", "cpu", "quota"),
    ("runtimeSpec", "linux", "resources", "cpu", "cpus"),
    ("runtimeSpec", "linux", "resources", "memory", "limit"),
    ("runtimeSpec", "linux", "resources", "memory", "swap"),
    ("runtimeSpec", "linux", "resources", "hugepageLimits"),
    ("runtimeSpec", "linux", "resources", "hugepageLimits", 0),
    ("runtimeSpec", "linux", "resources", "hugepageLimits", 0, "pageSize"),
    ("runtimeSpec", "linux", "resources", "hugepageLimits", 0, "limit"),
    ("runtimeSpec", "linux", "resources", "unified"),
    ("runtimeSpec", "linux", "resources", "unified", "memory.high"),
]


def removed(document: Any, path: tuple[Any, ...]) -> Any:
    """``document`` without the member at ``path`` (unchanged if there is none)."""
    if not path or not isinstance(document, dict) or path[0] not in document:
        return document
    if len(path) == 1:
        return {key: value for key, value in document.items() if key != path[0]}
    return {**document, path[0]: removed(document[path[0]], path[1:])}


@st.composite
def info_documents(draw: Callable[[Any], Any], base: Any) -> str:
    """The fixture's info with a few places replaced by junk, added or removed, as text (maybe cut short)."""
    # sampled_from, not integers: hypothesis favours an integer range's ends, these are the rare cases.
    kind = draw(st.sampled_from(["mutated"] * 8 + ["text", "junk"]))
    if kind == "text":
        return str(draw(proto_text))  # not JSON, or not an object
    if kind == "junk":
        return json.dumps(draw(info_junk), allow_nan=True)
    document = base
    for _ in range(draw(st.integers(1, 4))):
        path = draw(st.sampled_from(READ_PATHS) if draw(st.booleans()) else st.sampled_from(paths(document)))
        action = draw(st.integers(0, 4))
        if action == 0:
            document = removed(document, path)
        elif action == 1:
            document = replaced(document, path + (draw(info_keys),), draw(info_junk))
        elif action == 2:
            # A string JSON can spell and Python can hold, but protobuf cannot: "\ud800".
            document = replaced(document, path, draw(st.sampled_from(LONE_SURROGATES) | hostile_text))
        else:
            document = replaced(document, path, draw(info_junk))
    # Reading the spec happens only without resources in the config: take them away sometimes.
    if draw(st.booleans()):
        document = removed(document, ("config", "linux", "resources"))
    text = json.dumps(document, allow_nan=True)
    if draw(st.sampled_from([False] * 9 + [True])):
        return text[: draw(st.integers(0, len(text)))]  # cut short
    return text


def with_info(response: Any, info: str | None) -> Any:
    changed = copied(response)
    changed.info.clear()
    if info is not None:
        changed.info["info"] = info
    return changed


class RuntimeInfoPropertyTests(SynchronousTestCase):
    def raises_only_runtime_info_error(self, call: Callable[[], Any]) -> None:
        try:
            call()
        except RuntimeInfoError as error:
            one_line(self, error.reason)

    @CI
    @given(st.data())
    def test_pod_info_raises_only_runtime_info_error(self, data: st.DataObject) -> None:
        response = load(data.draw(st.sampled_from(POD_FIXTURES)), cri.PodSandboxStatusResponse)
        base = json.loads(response.info["info"])
        changed = with_info(response, data.draw(st.none() | info_documents(base)))
        if data.draw(st.booleans()):
            changed.status.ClearField("metadata")
        self.raises_only_runtime_info_error(lambda: pod_info_from_status(changed))

    @CI
    @given(st.data())
    def test_container_info_raises_only_runtime_info_error(self, data: st.DataObject) -> None:
        response = load(data.draw(st.sampled_from(CONTAINER_FIXTURES)), cri.ContainerStatusResponse)
        base = json.loads(response.info["info"])
        changed = with_info(response, data.draw(st.none() | info_documents(base)))
        if data.draw(st.booleans()):
            changed.status.ClearField("metadata")
        if data.draw(st.booleans()):
            changed.status.ClearField("resources")  # read from the spec instead
        pod = data.draw(st.none() | pod_requests())
        self.raises_only_runtime_info_error(lambda: container_info_from_status(changed, pod))
        self.raises_only_runtime_info_error(lambda: container_sandbox_id(changed))

    # What the properties above found, pinned: strings JSON can spell ("\ud800") but protobuf
    # cannot hold. containerd (Go) never writes them, a broken or hostile runtime could.

    def container_with(self, change: Callable[[dict[str, Any]], Any], *, from_spec: bool = False) -> Any:
        response = load("container_status_created.json", cri.ContainerStatusResponse)
        info = json.loads(response.info["info"])
        change(info)
        if from_spec:  # no resources in the status or the config: they are read from the runtime spec
            response.status.ClearField("resources")
            del info["config"]["linux"]["resources"]
        return with_info(response, json.dumps(info))

    def test_unknown_key_with_a_lone_surrogate_in_the_config(self) -> None:
        response = load("pod_sandbox_status.json", cri.PodSandboxStatusResponse)
        info = json.loads(response.info["info"])
        info["config"]["metadata"]["\ud800"] = 1
        self.raises_only_runtime_info_error(lambda: pod_info_from_status(with_info(response, json.dumps(info))))

    def test_runtime_handler_with_a_lone_surrogate(self) -> None:
        response = load("pod_sandbox_status.json", cri.PodSandboxStatusResponse)
        response.status.runtime_handler = ""
        info = json.loads(response.info["info"])
        info["runtimeHandler"] = "\ud800"
        self.raises_only_runtime_info_error(lambda: pod_info_from_status(with_info(response, json.dumps(info))))

    def test_sandbox_annotation_with_a_lone_surrogate(self) -> None:
        def change(info: dict[str, Any]) -> None:
            info["runtimeSpec"]["annotations"]["io.kubernetes.cri.sandbox-name"] = "\ud800"

        self.raises_only_runtime_info_error(lambda: container_info_from_status(self.container_with(change), None))

    def test_spec_resources_with_a_lone_surrogate(self) -> None:
        def cpus(info: dict[str, Any]) -> None:
            info["runtimeSpec"]["linux"]["resources"]["cpu"]["cpus"] = "\udfff"

        def unified(info: dict[str, Any]) -> None:
            info["runtimeSpec"]["linux"]["resources"]["unified"] = {"\udfff": "1"}

        for change in (cpus, unified):
            response = self.container_with(change, from_spec=True)
            self.raises_only_runtime_info_error(lambda: container_info_from_status(response, None))
