"""Bad input through koordrp: it answers as containerd does, whether it can read the request or not.

Requests are sent as raw bytes (no serializers), the way a broken or hostile client could: random
bytes, truncations and byte flips of valid requests, from a seeded generator so that every run
sends the same few hundred of them. Each is also sent to containerd directly, and the two answers
must agree: a request koordrp cannot read goes to containerd as it came, without hooks. Only a
Fail-policy hook server that must see such a request makes koordrp refuse it (INVALID_ARGUMENT).
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from cri_api.v1 import api_pb2
from google.protobuf.message import DecodeError, Message

from koordrp.api.cri.v1 import api_pb2 as koordrp_cri
from tests.fake.hook_server import HOOK_RPCS, FakeHookServer
from tests.support.compare import normalized
from tests.support.containerd import Containerd
from tests.support.cri_objects import container_config, linux_resources, pod_sandbox_config
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF
from tests.support.koordrp_process import KoordrpProcess

RUNTIME = "/runtime.v1.RuntimeService/"
IMAGES = "/runtime.v1.ImageService/"
TIMEOUT = 20.0
SEED = 20240611

# An id containerd cannot know, that no prefix of a real (hex) id can match either.
UNKNOWN_ID = "koordrp-no-such-id"

Answer = tuple[grpc.StatusCode, str | None, Any]


def valid_intercepted(logs: Path) -> dict[str, tuple[type[Message], list[Message]]]:
    """Each intercepted method: its request type, and well-formed requests to cut and flip."""
    pod = pod_sandbox_config("fuzz-pod", uid="fuzz-uid", log_directory=logs / "fuzz-pod", labels={"a": "b"})
    container = container_config(
        "fuzz-ctr",
        image=BUSYBOX_REF,
        command=["sleep", "1"],
        env={"A": "1", "B": "2"},
        annotations={"x": "y"},
        resources=linux_resources(cpu_shares=512, cpu_quota=50000, cpu_period=100000, cpuset_cpus="0"),
    )
    unknown_sandbox = "0" * 64  # hex, but no sandbox exists while these run
    return {
        "RunPodSandbox": (
            api_pb2.RunPodSandboxRequest,
            [api_pb2.RunPodSandboxRequest(config=pod, runtime_handler="")],
        ),
        "CreateContainer": (
            api_pb2.CreateContainerRequest,
            [api_pb2.CreateContainerRequest(pod_sandbox_id=unknown_sandbox, config=container, sandbox_config=pod)],
        ),
        "StartContainer": (api_pb2.StartContainerRequest, [api_pb2.StartContainerRequest(container_id=UNKNOWN_ID)]),
        "StopContainer": (
            api_pb2.StopContainerRequest,
            [api_pb2.StopContainerRequest(container_id=UNKNOWN_ID, timeout=3)],
        ),
        "StopPodSandbox": (api_pb2.StopPodSandboxRequest, [api_pb2.StopPodSandboxRequest(pod_sandbox_id=UNKNOWN_ID)]),
        "RemoveContainer": (api_pb2.RemoveContainerRequest, [api_pb2.RemoveContainerRequest(container_id=UNKNOWN_ID)]),
        "RemovePodSandbox": (
            api_pb2.RemovePodSandboxRequest,
            [api_pb2.RemovePodSandboxRequest(pod_sandbox_id=UNKNOWN_ID)],
        ),
        "UpdateContainerResources": (
            api_pb2.UpdateContainerResourcesRequest,
            [
                api_pb2.UpdateContainerResourcesRequest(
                    container_id=UNKNOWN_ID,
                    linux=linux_resources(cpu_shares=1024, memory_limit_in_bytes=64 << 20, unified={"memory.high": "max"}),
                    annotations={"k": "v"},
                )
            ],
        ),
    }


PASS_THROUGH: dict[str, tuple[type[Message], type[Message], list[Message]]] = {
    RUNTIME + "ContainerStatus": (
        api_pb2.ContainerStatusRequest,
        api_pb2.ContainerStatusResponse,
        [api_pb2.ContainerStatusRequest(container_id=UNKNOWN_ID, verbose=True)],
    ),
    RUNTIME + "ListContainers": (
        api_pb2.ListContainersRequest,
        api_pb2.ListContainersResponse,
        [
            api_pb2.ListContainersRequest(
                filter=api_pb2.ContainerFilter(id="x", pod_sandbox_id="y", label_selector={"a": "b"})
            )
        ],
    ),
    RUNTIME + "PodSandboxStatus": (
        api_pb2.PodSandboxStatusRequest,
        api_pb2.PodSandboxStatusResponse,
        [api_pb2.PodSandboxStatusRequest(pod_sandbox_id=UNKNOWN_ID, verbose=True)],
    ),
    IMAGES + "ImageStatus": (
        api_pb2.ImageStatusRequest,
        api_pb2.ImageStatusResponse,
        [
            api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=BUSYBOX_REF), verbose=True),
            api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image="localhost/no/such:image")),
        ],
    ),
}


def fuzzed(rng: random.Random, valid: list[Message], random_cases: int, flips: int, cuts: int) -> list[bytes]:
    """Random bytes, byte flips and truncations of the valid requests, and the empty request."""
    cases: list[bytes] = [b""]
    cases += [rng.randbytes(rng.randint(1, 48)) for _ in range(random_cases)]
    for message in valid:
        wire = message.SerializeToString()
        # Every cut of a short request; an even spread of cuts of a long one. Never the whole request.
        lengths = range(1, len(wire)) if len(wire) <= cuts else sorted(rng.sample(range(1, len(wire)), cuts))
        cases += [wire[:length] for length in lengths]
        for _ in range(flips):
            data = bytearray(wire)
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            cases.append(bytes(data))
    return cases


# Past containerd's 16 MiB receive limit: koordrp sets none of its own, so it must not refuse
# what containerd would refuse differently (or accept).
LARGE = 17 << 20


def large_cases(kind: type[Message], rng: random.Random) -> list[bytes]:
    """A large request that parses (a huge id or selector), and large junk that does not."""
    if kind is api_pb2.ImageStatusRequest:
        parsing: Message = api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image="a" * LARGE))
    elif kind is api_pb2.ListContainersRequest:
        parsing = api_pb2.ListContainersRequest(filter=api_pb2.ContainerFilter(label_selector={"k": "v" * LARGE}))
    elif kind is api_pb2.RunPodSandboxRequest:
        parsing = api_pb2.RunPodSandboxRequest(runtime_handler="h" * LARGE)
    elif kind is api_pb2.CreateContainerRequest:
        parsing = api_pb2.CreateContainerRequest(pod_sandbox_id="0" * LARGE)
    else:
        field = kind.DESCRIPTOR.fields[0]  # container_id or pod_sandbox_id
        parsing = kind(**{field.name: "0" * LARGE})
    junk = b"\xff" * 16 + rng.randbytes(64) * (LARGE // 64)
    return [parsing.SerializeToString(), junk]


def parses(kind: type[Message], data: bytes) -> bool:
    try:
        kind.FromString(data)
    except DecodeError:
        return False
    return True


def shown(data: bytes) -> str:
    return data.hex() if len(data) <= 256 else f"{data[:64].hex()}... ({len(data)} bytes)"


def raw_call(channel: grpc.Channel, method: str, data: bytes) -> Answer:
    """``method`` called with ``data`` as the request bytes: (code, details, response bytes or None)."""
    try:
        response = channel.unary_unary(method, request_serializer=None, response_deserializer=None)(data, timeout=TIMEOUT)
    except grpc.RpcError as error:
        return error.code(), error.details(), None
    return grpc.StatusCode.OK, None, response


def comparable(answer: Answer, response_type: type[Message] | None) -> Any:
    """An answer as compared between the two paths: a successful response parsed, ids and times blanked."""
    code, details, response = answer
    if response is None or response_type is None:
        return code, details
    return code, normalized(response_type.FromString(response))


@dataclass
class Pods:
    """What the runtime has, so that anything a fuzzed request created can be found and removed."""

    sandboxes: set[str]
    containers: set[str]


def pods_of(containerd: Containerd) -> Pods:
    sandboxes, containers = containerd.listed_ids()
    return Pods(set(sandboxes), set(containers))


def remove_new(containerd: Containerd, before: Pods) -> Pods:
    """Remove, through containerd directly, every pod and container that was not there ``before``."""
    now = pods_of(containerd)
    runtime = containerd.runtime()
    for container_id in now.containers - before.containers:
        runtime.StopContainer(api_pb2.StopContainerRequest(container_id=container_id, timeout=0), timeout=TIMEOUT)
        runtime.RemoveContainer(api_pb2.RemoveContainerRequest(container_id=container_id), timeout=TIMEOUT)
    for sandbox_id in now.sandboxes - before.sandboxes:
        runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=TIMEOUT)
        runtime.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=TIMEOUT)
    return Pods(now.sandboxes - before.sandboxes, now.containers - before.containers)


@pytest.fixture
def channels(containerd: Containerd, koordrp: KoordrpProcess) -> Iterator[tuple[grpc.Channel, grpc.Channel]]:
    """(through koordrp, direct); anything the test leaves in containerd is removed afterwards."""
    before = pods_of(containerd)
    proxied = koordrp.channel()
    direct = grpc.insecure_channel(containerd.endpoint)
    try:
        yield proxied, direct
    finally:
        proxied.close()
        direct.close()
        remove_new(containerd, before)


def assert_koordrp_is_well(koordrp: KoordrpProcess, proxied: grpc.Channel) -> None:
    assert koordrp.process is not None and koordrp.process.poll() is None, f"koordrp exited:\n{koordrp.log()}"
    version = api_pb2.VersionResponse.FromString(
        channel_call(proxied, RUNTIME + "Version", api_pb2.VersionRequest().SerializeToString())
    )
    assert version.runtime_name == "containerd"
    # twistd rotates its log at 1 MB: look through every part of it.
    for part in sorted(koordrp.logfile.parent.glob(koordrp.logfile.name + "*")):
        text = part.read_text(errors="replace")
        assert "Traceback" not in text and "Unhandled" not in text, f"{part}:\n{text[-5000:]}"


def channel_call(channel: grpc.Channel, method: str, data: bytes) -> bytes:
    response: bytes = channel.unary_unary(method, request_serializer=None, response_deserializer=None)(data, timeout=TIMEOUT)
    return response


def test_fuzzed_requests_are_answered_as_containerd_does(
    containerd: Containerd, koordrp: KoordrpProcess, workdir: Path, channels: tuple[grpc.Channel, grpc.Channel]
) -> None:
    proxied, direct = channels
    rng = random.Random(SEED)
    mismatches: list[str] = []
    unreadable = compared = 0
    before = pods_of(containerd)

    for name, (kind, valid) in valid_intercepted(workdir / "logs").items():
        method = RUNTIME + name
        ours = getattr(koordrp_cri, kind.__name__)
        for data in fuzzed(rng, valid, random_cases=20, flips=8, cuts=16) + large_cases(kind, rng):
            # Whatever containerd says to these bytes, koordrp must say the same, whether it can
            # read them or not. A flipped byte can make a pod that runs: it is removed before the
            # same bytes go to containerd, whose answer would otherwise be that the name is taken.
            compared += 1
            unreadable += not parses(ours, data)
            through = raw_call(proxied, method, data)
            remove_new(containerd, before)
            alone = raw_call(direct, method, data)
            remove_new(containerd, before)
            if comparable(through, None) != comparable(alone, None):
                mismatches.append(f"{name} {shown(data)}: koordrp {through[:2]}, containerd {alone[:2]}")

    for method, (kind, response_type, valid) in PASS_THROUGH.items():
        for data in fuzzed(rng, valid, random_cases=15, flips=6, cuts=10) + large_cases(kind, rng):
            through, alone = raw_call(proxied, method, data), raw_call(direct, method, data)
            compared += 1
            if comparable(through, response_type) != comparable(alone, response_type):
                mismatches.append(f"{method} {shown(data)}: koordrp {through[:2]}, containerd {alone[:2]}")

    assert not mismatches, "\n".join(mismatches)
    assert pods_of(containerd) == before
    # The generator must give koordrp both what it can read and what it cannot, or the test proves little.
    assert unreadable >= 100 and compared - unreadable >= 100, (unreadable, compared)
    assert_koordrp_is_well(koordrp, proxied)


def cut_run_pod_sandbox() -> bytes:
    valid = api_pb2.RunPodSandboxRequest(config=pod_sandbox_config("cut", uid=str(uuid.uuid4()))).SerializeToString()
    return valid[:-1]


def test_what_koordrp_cannot_read_goes_to_containerd_with_one_warning(
    containerd: Containerd, koordrp: KoordrpProcess, channels: tuple[grpc.Channel, grpc.Channel]
) -> None:
    proxied, direct = channels
    data = cut_run_pod_sandbox()
    assert not parses(koordrp_cri.RunPodSandboxRequest, data)
    assert raw_call(proxied, RUNTIME + "RunPodSandbox", data)[:2] == raw_call(direct, RUNTIME + "RunPodSandbox", data)[:2]
    warnings = [line for line in koordrp.log().splitlines() if "cannot read the RunPodSandbox request" in line]
    assert len(warnings) == 1 and "without hooks" in warnings[0], warnings
    assert_koordrp_is_well(koordrp, proxied)


# ---------------------------------------------------------------------------------------------
# Ids nobody knows, with a hook server registered for every hook


@pytest.fixture
def hook_server(workdir: Path, koordrp: KoordrpProcess) -> Iterator[FakeHookServer]:
    server = FakeHookServer(str(workdir / "all-hooks.sock")).start()
    try:
        register(
            workdir / "hookserver.d",
            "all-hooks",
            server.path,
            [rpc.removesuffix("Hook") for rpc in sorted(HOOK_RPCS)],
            policy="Fail",
        )
        deadline = time.monotonic() + 5
        while koordrp.registered_servers() != 1:
            assert time.monotonic() < deadline, f"koordrp did not register the hook server:\n{koordrp.log()}"
            time.sleep(0.02)
        yield server
    finally:
        server.stop()


def unknown_calls(workdir: Path) -> list[tuple[str, Message]]:
    pod = pod_sandbox_config("nobody", uid=str(uuid.uuid4()), log_directory=workdir / "logs" / "nobody")
    container = container_config("nobody", image=BUSYBOX_REF, command=["sleep", "1"], log_path="nobody.log")
    calls: list[tuple[str, Message]] = []
    for identifier in ("", UNKNOWN_ID):
        calls += [
            ("StartContainer", api_pb2.StartContainerRequest(container_id=identifier)),
            ("StopContainer", api_pb2.StopContainerRequest(container_id=identifier, timeout=1)),
            ("RemoveContainer", api_pb2.RemoveContainerRequest(container_id=identifier)),
            ("UpdateContainerResources", api_pb2.UpdateContainerResourcesRequest(
                container_id=identifier, linux=linux_resources(cpu_shares=256))),
            ("StopPodSandbox", api_pb2.StopPodSandboxRequest(pod_sandbox_id=identifier)),
            ("RemovePodSandbox", api_pb2.RemovePodSandboxRequest(pod_sandbox_id=identifier)),
            ("CreateContainer", api_pb2.CreateContainerRequest(
                pod_sandbox_id=identifier, config=container, sandbox_config=pod)),
        ]
    return calls


def test_what_a_fail_policy_server_must_see_but_koordrp_cannot_read_is_refused(
    containerd: Containerd, koordrp: KoordrpProcess, hook_server: FakeHookServer, channels: tuple[grpc.Channel, grpc.Channel]
) -> None:
    proxied, _ = channels
    before = pods_of(containerd)
    code, details, _ = raw_call(proxied, RUNTIME + "RunPodSandbox", cut_run_pod_sandbox())
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details is not None and details.startswith("koordrp: cannot read the RunPodSandbox request, which hook server all-hooks.json (Fail policy) must see"), details
    assert pods_of(containerd) == before
    assert hook_server.rpcs() == []
    assert_koordrp_is_well(koordrp, proxied)


def test_unknown_and_empty_ids_get_containerds_answer_and_no_hook_call(
    containerd: Containerd,
    koordrp: KoordrpProcess,
    workdir: Path,
    hook_server: FakeHookServer,
    channels: tuple[grpc.Channel, grpc.Channel],
) -> None:
    proxied, direct = channels
    differences = []
    for name, request in unknown_calls(workdir):
        data = request.SerializeToString()
        identifier = getattr(request, "container_id", None) or getattr(request, "pod_sandbox_id", "")
        through, alone = raw_call(proxied, RUNTIME + name, data), raw_call(direct, RUNTIME + name, data)
        print("ANSWER", name, repr(identifier), through[:2])
        if through[:2] != alone[:2]:
            differences.append(f"{name}({identifier!r}): koordrp {through[:2]}, containerd {alone[:2]}")
    assert not differences, "\n".join(differences)
    # Post hooks leave after the answer; a call's line names every one it sent.
    lines = koordrp.log_lines("[koordrp.calls#info]", count=len(unknown_calls(workdir)))
    assert len(lines) == len(unknown_calls(workdir)) and all(line.endswith("hooks: none") for line in lines), lines
    assert hook_server.rpcs() == []
    assert_koordrp_is_well(koordrp, proxied)
