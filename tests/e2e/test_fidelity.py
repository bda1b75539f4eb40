"""What a real koordlet and a current kubelet put on the wire, through koordrp to a real containerd.

koordlet's registration is written byte for byte as koordlet writes it; hook servers answer as
koordlet does (a copy of the request with changes, koordrp.sdk.reply); kubelet's requests are raw
bytes where the package's stubs could not say them (env values as bytes, newer methods), and
repeated as kubelet repeats them.
"""

import json
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest
from cri_api.v1 import api_pb2

from koordrp.api.cri.v1 import api_pb2 as koordrp_cri
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from tests.e2e.conftest import hook_server, wait_registered
from tests.fake.hook_server import FakeHookServer, koordlet_cpuset_rule
from tests.support import koordlet
from tests.support.containerd import Containerd
from tests.support.cri_objects import container_config, linux_resources, pod_sandbox_config
from tests.support.dockerd import remove_cgroup
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import TIMEOUT, remove_pod, running_container, runtime_spec, start_container

RUNTIME = "/runtime.v1.RuntimeService/"
BEST_EFFORT_PARENT = "/koordrp-e2e-besteffort"
POST_STOP = "PostStopContainerHook"
POST_STOP_POD = "PostStopPodSandboxHook"


# ---------------------------------------------------------------------------------------------
# koordlet's registration


def test_koordlets_registration_with_a_stage_that_has_no_hook_point(
    koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "koordlet")
    koordlet.register(hooks_dir, koordlet.registration(server.path, koordlet.RESCTRL_STAGES))
    wait_registered(koordrp, 1)
    with running_container(runtime, "koordlet-stages", workdir) as pod:
        update = api_pb2.UpdateContainerResourcesRequest(container_id=pod.container_id, linux=linux_resources(cpu_shares=300))
        runtime.UpdateContainerResources(update, timeout=TIMEOUT)
    assert server.rpcs() == ["PreRunPodSandboxHook", "PreCreateContainerHook", "PreUpdateContainerResourcesHook"]
    remarks = [line for line in koordrp.log().splitlines() if "no hook point for" in line]
    assert len(remarks) == 1 and remarks[0].endswith('ignored: "PreRemoveRunPodSandbox"'), remarks


def test_an_empty_failure_policy_ignores_failures(
    koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    broken = hook_server(servers, workdir, "koordlet")
    broken.failures["PreCreateContainerHook"] = grpc.StatusCode.INTERNAL
    koordlet.register(hooks_dir, koordlet.registration(broken.path, ["PreCreateContainer"], policy=""))
    wait_registered(koordrp, 1)
    with running_container(runtime, "empty-policy", workdir):
        pass
    assert broken.rpcs() == ["PreCreateContainerHook"]


# ---------------------------------------------------------------------------------------------
# An answer like koordlet's: a copy of the request, the cpuset cleared for best-effort pods


def test_a_koordlet_like_answer_clears_kubelets_cpuset_for_a_best_effort_pod(
    containerd: Containerd,
    koordrp: KoordrpProcess,
    runtime: Any,
    servers: dict[str, FakeHookServer],
    workdir: Path,
    hooks_dir: Path,
) -> None:
    server = hook_server(servers, workdir, "koordlet")
    for rpc in ("PreCreateContainerHook", "PreUpdateContainerResourcesHook"):
        server.behaviours[rpc] = koordlet_cpuset_rule
    register(hooks_dir, "koordlet", server.path, ["PreCreateContainer", "PreUpdateContainerResources"])
    wait_registered(koordrp, 1)
    pinned = {"resources": linux_resources(cpu_shares=2, cpuset_cpus="0")}
    parent = f"{BEST_EFFORT_PARENT}/pod{uuid.uuid4()}"
    try:
        with running_container(runtime, "be", workdir, container_options=pinned, cgroup_parent=parent) as pod:
            assert runtime_spec(runtime, pod.container_id)["linux"]["resources"]["cpu"].get("cpus", "") == ""
            update = api_pb2.UpdateContainerResourcesRequest(
                container_id=pod.container_id, linux=linux_resources(cpu_shares=4, cpuset_cpus="0")
            )
            runtime.UpdateContainerResources(update, timeout=TIMEOUT)
            status = runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=pod.container_id)).status
            assert (status.resources.linux.cpu_shares, status.resources.linux.cpuset_cpus) == (4, "")
            assert runtime_spec(runtime, pod.container_id)["linux"]["resources"]["cpu"].get("cpus", "") == ""
        # Without koordrp, kubelet's cpuset is what the container gets: the check above can fail.
        with running_container(containerd.runtime(), "be-direct", workdir, container_options=pinned, cgroup_parent=parent) as pod:
            assert runtime_spec(containerd.runtime(), pod.container_id)["linux"]["resources"]["cpu"]["cpus"] == "0"
        assert [request.container_resources.cpuset_cpus for request in server.calls()] == ["0", "0"]
    finally:
        remove_cgroup(BEST_EFFORT_PARENT)


# ---------------------------------------------------------------------------------------------
# kubelet 1.35: env values are bytes, and need not be UTF-8


def create_with_binary_env(
    channel: grpc.Channel, sandbox_id: str, pod: Any, name: str, value: bytes
) -> tuple[grpc.StatusCode, str | None, str]:
    """CreateContainer as kubelet 1.35 may send it: BIN's value is raw bytes. (code, details, container id)."""
    config = container_config(name, image=BUSYBOX_REF, command=["sleep", "3600"], env={"A": "1", "B": "2"})
    request = koordrp_cri.CreateContainerRequest.FromString(
        api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config, sandbox_config=pod).SerializeToString()
    )
    request.config.envs.insert(1, koordrp_cri.KeyValue(key="BIN", value=value))
    try:
        create = channel.unary_unary(RUNTIME + "CreateContainer", request_serializer=None, response_deserializer=None)
        answer = create(request.SerializeToString(), timeout=TIMEOUT)
    except grpc.RpcError as error:
        return error.code(), error.details(), ""
    return grpc.StatusCode.OK, None, api_pb2.CreateContainerResponse.FromString(answer).container_id


def recorded_envs(runtime: Any, container_id: str) -> list[Any]:
    status = runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=container_id, verbose=True))
    envs: list[Any] = json.loads(status.info["info"])["config"]["envs"]
    return envs


def environ(runtime: Any, container_id: str) -> bytes:
    """The environment of the container's first process, as the kernel holds it."""
    runtime.StartContainer(api_pb2.StartContainerRequest(container_id=container_id), timeout=TIMEOUT)
    answer = runtime.ExecSync(api_pb2.ExecSyncRequest(container_id=container_id, cmd=["cat", "/proc/1/environ"], timeout=10))
    return bytes(answer.stdout)


def binary_entries(environ: bytes) -> list[bytes]:
    return [entry for entry in environ.split(b"\0") if entry.startswith(b"BIN=")]


@pytest.mark.parametrize("hooked", [False, True], ids=["no hook", "PreCreateContainer hook"])
def test_env_values_that_are_not_utf8_get_containerds_answer_and_what_containerd_does_with_them(
    hooked: bool,
    containerd: Containerd,
    koordrp: KoordrpProcess,
    servers: dict[str, FakeHookServer],
    workdir: Path,
    hooks_dir: Path,
) -> None:
    server = hook_server(servers, workdir, "envs")
    if hooked:
        server.behaviours["PreCreateContainerHook"] = lambda request: hook.ContainerResourceHookResponse(
            container_envs={"HOOKED": "1"}
        )
        register(hooks_dir, "envs", server.path, ["PreCreateContainer"])
        wait_registered(koordrp, 1)
    direct, alone = containerd.runtime(), containerd.channel()
    with koordrp.channel() as through:
        pod = pod_sandbox_config("binary-env", log_directory=workdir / "binary-env")
        sandbox_id = direct.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
        try:
            # With a NUL in it the value can reach no process (runc refuses it); containerd takes the
            # create all the same, and koordrp must too.
            proxied = create_with_binary_env(through, sandbox_id, pod, "nul-through", b"\xff\xfe\x00abc")
            plain = create_with_binary_env(alone, sandbox_id, pod, "nul-direct", b"\xff\xfe\x00abc")
            assert proxied[:2] == plain[:2] == (grpc.StatusCode.OK, None)
            through_envs = recorded_envs(direct, proxied[2])
            assert [e for e in through_envs if e["key"] == "BIN"] == [e for e in recorded_envs(direct, plain[2]) if e["key"] == "BIN"]
            assert [e["key"] for e in through_envs] == (["A", "BIN", "B", "HOOKED"] if hooked else ["A", "BIN", "B"])
            # Without a NUL the process starts. containerd 1.6 writes the value into the OCI spec, a
            # JSON file, with U+FFFD for the bytes that are not UTF-8: the container must get exactly
            # that through koordrp too.
            through_id = create_with_binary_env(through, sandbox_id, pod, "binary-through", b"\xff\xfeabc")[2]
            direct_id = create_with_binary_env(alone, sandbox_id, pod, "binary-direct", b"\xff\xfeabc")[2]
            binary = [b"BIN=\xef\xbf\xbd\xef\xbf\xbdabc"]
            assert binary_entries(environ(direct, through_id)) == binary_entries(environ(direct, direct_id)) == binary
        finally:
            remove_pod(direct, sandbox_id)
    if hooked:
        seen = server.calls("PreCreateContainerHook")
        assert len(seen) == 2 and all(dict(request.container_envs) == {"A": "1", "B": "2"} for request in seen)


# ---------------------------------------------------------------------------------------------
# Post hooks once per stop and per start, whatever kubelet repeats


@pytest.fixture
def post_hooks(koordrp: KoordrpProcess, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path) -> FakeHookServer:
    server = hook_server(servers, workdir, "post")
    register(hooks_dir, "post", server.path, ["PostStartContainer", "PostStopContainer", "PostStopPodSandbox"])
    wait_registered(koordrp, 1)
    return server


def settled(koordrp: KoordrpProcess, server: FakeHookServer, last_call: str, earlier: int = 0) -> list[str]:
    """What ``server`` was sent, once koordrp has written the line of ``last_call`` (the test's last call,
    a log line's start) and every post hook its call lines name as sent has arrived (after ``earlier``
    ones, sent by another koordrp)."""
    assert koordrp.log_lines(f"[koordrp.calls#info] {last_call}"), f"no line for {last_call}:\n{koordrp.log()}"
    sent = sum(line.count(": sent") for line in koordrp.log_lines("[koordrp.calls#info]"))
    return server.rpcs_once(earlier + sent)


def stop(runtime: Any, container_id: str) -> None:
    runtime.StopContainer(api_pb2.StopContainerRequest(container_id=container_id, timeout=0), timeout=TIMEOUT)


def stop_pod(runtime: Any, sandbox_id: str) -> None:
    runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=TIMEOUT)


def test_repeated_stops_call_post_hooks_once(
    koordrp: KoordrpProcess, runtime: Any, post_hooks: FakeHookServer, workdir: Path
) -> None:
    with running_container(runtime, "twice", workdir) as pod:
        stop(runtime, pod.container_id)
        stop(runtime, pod.container_id)
        stop_pod(runtime, pod.sandbox_id)
        stop_pod(runtime, pod.sandbox_id)
    # running_container stops the pod once more on its way out.
    assert settled(koordrp, post_hooks, "RemovePodSandbox pod default/twice") == [
        "PostStartContainerHook",
        POST_STOP,
        POST_STOP_POD,
    ]
    # Repeats name what they are about, from the store, like the first stop.
    stops = [line for line in koordrp.log_lines("[koordrp.calls#info] Stop") if "Stop" in line.split("]", 1)[1][:16]]
    assert len(stops) == 5 and all(f" pod default/twice ({pod.pod_config.metadata.uid})" in line for line in stops), stops
    assert sum(" container twice:" in line for line in stops) == 2, stops


def test_a_new_attempt_is_a_new_stop(runtime: Any, post_hooks: FakeHookServer, workdir: Path) -> None:
    pod = pod_sandbox_config("attempts", log_directory=workdir / "attempts")
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
    try:
        for attempt in (0, 1):
            container = container_config("attempts", command=["sleep", "3600"], attempt=attempt, log_path=f"a{attempt}.log")
            container_id = start_container(runtime, sandbox_id, pod, container)
            stop(runtime, container_id)
            stop(runtime, container_id)
    finally:
        remove_pod(runtime, sandbox_id)
    stopped = [request.container_meta.attempt for request in post_hooks.calls(POST_STOP)]
    assert sorted(stopped) == [0, 1]


def test_stopping_a_pod_stops_its_running_containers_first(
    koordrp: KoordrpProcess, runtime: Any, post_hooks: FakeHookServer, workdir: Path
) -> None:
    pod = pod_sandbox_config("two", log_directory=workdir / "two")
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
    try:
        started = [
            start_container(runtime, sandbox_id, pod, container_config(name, command=["sleep", "3600"], log_path=f"{name}.log"))
            for name in ("first", "second")
        ]
        stop_pod(runtime, sandbox_id)
    finally:
        remove_pod(runtime, sandbox_id)
    assert settled(koordrp, post_hooks, "RemovePodSandbox pod default/two")[2:] == [POST_STOP, POST_STOP, POST_STOP_POD]
    assert sorted(request.container_meta.id for request in post_hooks.calls(POST_STOP)) == sorted(started)


def test_after_a_restart_a_container_that_already_stopped_gets_no_second_post_stop(
    containerd: Containerd, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "post")
    register(hooks_dir, "post", server.path, ["PostStopContainer", "PostStopPodSandbox"])
    first = KoordrpProcess(workdir, containerd.endpoint)
    first.start()
    sandbox_id = ""
    try:
        first.wait_for_servers(1)
        with first.channel() as channel:
            runtime = first.runtime(channel)
            pod = pod_sandbox_config("restarted", log_directory=workdir / "restarted")
            sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
            container_id = start_container(runtime, sandbox_id, pod, container_config("restarted", command=["sleep", "3600"]))
            stop(runtime, container_id)
        assert settled(first, server, "StopContainer pod default/restarted") == [POST_STOP]
        assert first.terminate() == 0
        second = KoordrpProcess(workdir, containerd.endpoint)
        second.start()
        try:
            with second.channel() as channel:
                stop(second.runtime(channel), container_id)
                stop_pod(second.runtime(channel), sandbox_id)
            rpcs = settled(second, server, "StopPodSandbox pod default/restarted", earlier=1)
        finally:
            second.stop()
    finally:
        first.stop()
        if sandbox_id:
            remove_pod(containerd.runtime(), sandbox_id)
    # The first koordrp's PostStopContainer, and the second's PostStopPodSandbox alone.
    assert rpcs == [POST_STOP, POST_STOP_POD]


# ---------------------------------------------------------------------------------------------
# Methods newer than koordrp's stubs


def test_update_pod_sandbox_resources_gets_containerds_answer(containerd: Containerd, koordrp: KoordrpProcess) -> None:
    # UpdatePodSandboxResourcesRequest{pod_sandbox_id: "abc"}, as a kubelet of 1.33 or later sends it.
    data = b"\n\x03abc"
    answers: list[tuple[grpc.StatusCode, str | None]] = []
    with koordrp.channel() as through:
        for channel in (through, containerd.channel()):
            try:
                update = channel.unary_unary(
                    RUNTIME + "UpdatePodSandboxResources", request_serializer=None, response_deserializer=None
                )
                update(data, timeout=TIMEOUT)
                answers.append((grpc.StatusCode.OK, None))
            except grpc.RpcError as error:
                answers.append((error.code(), error.details()))
    assert answers[0] == answers[1]
    assert answers[0][0] is grpc.StatusCode.UNIMPLEMENTED  # containerd 1.6 does not know it


# ---------------------------------------------------------------------------------------------
# Pods made with text that is not UTF-8 (containerd 1.6 takes it)


def test_a_pod_python_cannot_parse_does_not_stop_the_store_rebuild(
    containerd: Containerd, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "update")
    register(hooks_dir, "update", server.path, ["PreUpdateContainerResources"])
    direct = containerd.runtime()
    pod = pod_sandbox_config("odd", labels={"odd": "ODD"}, log_directory=workdir / "odd")
    raw = api_pb2.RunPodSandboxRequest(config=pod).SerializeToString().replace(b"ODD", b"\xff\xfe\xfd")
    run_pod_sandbox = containerd.channel().unary_unary(
        RUNTIME + "RunPodSandbox", request_serializer=None, response_deserializer=None
    )
    answer = run_pod_sandbox(raw, timeout=TIMEOUT)
    odd_id = api_pb2.RunPodSandboxResponse.FromString(answer).pod_sandbox_id
    plain = pod_sandbox_config("plain", log_directory=workdir / "plain")
    sandbox_id = direct.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=plain), timeout=TIMEOUT).pod_sandbox_id
    try:
        container_id = start_container(direct, sandbox_id, plain, container_config("plain", command=["sleep", "3600"]))
        proxy = KoordrpProcess(workdir, containerd.endpoint)
        proxy.start()
        try:
            deadline = time.monotonic() + 10
            while "store rebuilt from the runtime" not in proxy.log():
                assert time.monotonic() < deadline, proxy.log()
                time.sleep(0.05)
            assert f"pod {odd_id} cannot be read from the runtime; left out" in proxy.log()
            proxy.wait_for_servers(1)
            with proxy.channel() as channel:
                update = api_pb2.UpdateContainerResourcesRequest(
                    container_id=container_id, linux=api_pb2.LinuxContainerResources(cpu_shares=256)
                )
                proxy.runtime(channel).UpdateContainerResources(update, timeout=TIMEOUT)
        finally:
            proxy.stop()
    finally:
        for identifier in (odd_id, sandbox_id):
            remove_pod(direct, identifier)
    # The pod beside the odd one is known: its container's hooks see it.
    [updated] = server.calls("PreUpdateContainerResourcesHook")
    assert (updated.pod_meta.name, updated.container_meta.id) == ("plain", container_id)
