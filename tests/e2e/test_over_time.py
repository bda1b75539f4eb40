"""What kubelet and koordlet do over time, against a real containerd: slow and wedged servers, repeated
updates (and koordrp restarting between them), pods resized in place."""

import time
from pathlib import Path
from typing import Any

import grpc
from cri_api.v1 import api_pb2

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from tests.e2e.conftest import hook_server, wait_registered
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import Containerd
from tests.support.cri_objects import container_config, linux_resources, pod_sandbox_config
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import TIMEOUT, remove_pod, runtime_spec, start_container

CREATE = "PreCreateContainerHook"
UPDATE = "PreUpdateContainerResourcesHook"
# kubelet's deadline for a CRI call: 2 minutes.
KUBELET_TIMEOUT = 120.0


def halve_the_quota(request: hook.ContainerResourceHookRequest) -> hook.ContainerResourceHookResponse:
    """koordlet's CPU normalization, as far as this test goes: a copy of the request, its quota scaled."""
    answer = hook.ContainerResourceHookResponse(container_resources=request.container_resources)
    answer.container_resources.cpu_quota = request.container_resources.cpu_quota // 2
    return answer


def runtime_quota(runtime: Any, container_id: str) -> int:
    quota: int = runtime_spec(runtime, container_id)["linux"]["resources"]["cpu"]["quota"]
    return quota


def test_a_hook_scaling_kubelets_quota_scales_it_once_across_cpuset_updates_and_a_restart(
    containerd: Containerd, koordrp: KoordrpProcess, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    """kubelet's static CPU manager sends cpuset-only updates: each must leave the quota at half of kubelet's."""
    server = hook_server(servers, workdir, "normalizer")
    server.behaviours[CREATE] = server.behaviours[UPDATE] = halve_the_quota
    register(hooks_dir, "normalizer", server.path, ["PreCreateContainer", "PreUpdateContainerResources"])
    wait_registered(koordrp, 1)
    direct = containerd.runtime()
    pod = pod_sandbox_config("normalized", log_directory=workdir / "normalized")
    with koordrp.channel() as channel:
        runtime = koordrp.runtime(channel)
        sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
        try:
            resources = linux_resources(cpu_period=100000, cpu_quota=100000, cpu_shares=1024)
            container = container_config("normalized", image=BUSYBOX_REF, command=["sleep", "3600"], resources=resources)
            container_id = start_container(runtime, sandbox_id, pod, container)
            assert runtime_quota(direct, container_id) == 50000

            def cpuset_only(through: Any, cpuset: str) -> None:
                update = api_pb2.UpdateContainerResourcesRequest(
                    container_id=container_id, linux=api_pb2.LinuxContainerResources(cpuset_cpus=cpuset)
                )
                through.UpdateContainerResources(update, timeout=TIMEOUT)

            for cpuset in ("0", "0-1", "1"):
                cpuset_only(runtime, cpuset)
                assert runtime_quota(direct, container_id) == 50000
            assert koordrp.terminate() == 0
            koordrp.start()  # what kubelet asked comes back from koordrp's state directory
            wait_registered(koordrp, 1)
            with koordrp.channel() as again:
                cpuset_only(koordrp.runtime(again), "0")
            assert runtime_quota(direct, container_id) == 50000
            seen = [request.container_resources.cpu_quota for request in server.calls()]
            assert seen == [100000] * 5, seen
        finally:
            remove_pod(direct, sandbox_id)


def test_a_slow_server_within_kubelets_deadline_is_heard_with_default_flags(
    koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    """koordlet writes cgroups inside the call; on a loaded node 2-5 s happens, and a GPU pod needs its env."""
    server = hook_server(servers, workdir, "koordlet")
    server.delays[CREATE] = 3.0
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(
        container_envs={"NVIDIA_VISIBLE_DEVICES": "0"}
    )
    register(hooks_dir, "koordlet", server.path, ["PreCreateContainer"])  # as koordlet writes it: no timeout
    wait_registered(koordrp, 1)
    pod = pod_sandbox_config("gpu", log_directory=workdir / "gpu")
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=KUBELET_TIMEOUT).pod_sandbox_id
    try:
        container = container_config("gpu", image=BUSYBOX_REF, command=["sleep", "3600"])
        created = runtime.CreateContainer(
            api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=container, sandbox_config=pod),
            timeout=KUBELET_TIMEOUT,
        )
        status = runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=created.container_id, verbose=True))
        assert "NVIDIA_VISIBLE_DEVICES=0" in status.info["info"]
    finally:
        remove_pod(runtime, sandbox_id)


def create_again(runtime: Any, sandbox_id: str, pod: Any, attempt: int) -> None:
    """CreateContainer of the pod's one container, as kubelet makes it again after a failure (``attempt``)."""
    config = container_config(pod.metadata.name, image=BUSYBOX_REF, command=["sleep", "3600"], attempt=attempt)
    request = api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config, sandbox_config=pod)
    runtime.CreateContainer(request, timeout=KUBELET_TIMEOUT)


def test_a_wedged_server_costs_one_call_then_none_until_a_trial_answers_in_time(
    koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "wedged")
    server.delays[CREATE] = 3600.0
    register(hooks_dir, "wedged", server.path, ["PreCreateContainer"], policy="Ignore", **{"timeout-seconds": 1})
    wait_registered(koordrp, 1)
    pod = pod_sandbox_config("patient", log_directory=workdir / "patient")
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=KUBELET_TIMEOUT).pod_sandbox_id
    try:
        def create(attempt: int) -> None:
            create_again(runtime, sandbox_id, pod, attempt)

        for attempt in range(6):
            create(attempt)
        lines = koordrp.log_lines("] CreateContainer pod default/patient", count=6)
        # The call that finds it wedged waits its timeout; the next ones skip it at once.
        assert "PreCreateContainer@wedged.json: timeout " in lines[0] and "(no answer within 1s;" in lines[0], lines
        assert all("PreCreateContainer@wedged.json: not-answering (not answering in time for " in line for line in lines[1:]), lines
        assert "went on without it" in lines[-1]
        server.unwedge()  # back: the first create after the pause is its trial, and it answers in time
        attempt, deadline = 6, time.monotonic() + 120
        while True:
            create(attempt)
            line = koordrp.log_lines("] CreateContainer pod default/patient", count=attempt + 1)[-1]
            if "not-answering" not in line or time.monotonic() > deadline:
                break
            attempt += 1
            time.sleep(0.25)  # polling for the pause's end (on koordrp's clock), not timing anything
        assert "PreCreateContainer@wedged.json: ok" in line and "(trial: it answers in time again)" in line, line
        assert koordrp.log_lines("hook server wedged.json", count=2)[-1].endswith("calls reach it again")
        assert len(server.calls(CREATE)) == 2  # the call it did not answer, and its trial: nothing asked twice
    finally:
        remove_pod(runtime, sandbox_id)


def test_a_wedged_server_whose_registration_is_removed_is_not_called_again(
    koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    """An operator takes a wedged plugin out (its file gone from hookserver.d): no call waits for it, or skips
    it (a registered one would be named not-answering), and no trial asks it."""
    server = hook_server(servers, workdir, "wedged")
    server.delays[CREATE] = 3600.0
    registration = register(hooks_dir, "wedged", server.path, ["PreCreateContainer"], policy="Ignore", **{"timeout-seconds": 1})
    wait_registered(koordrp, 1)
    pod = pod_sandbox_config("unplugged", log_directory=workdir / "unplugged")
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=KUBELET_TIMEOUT).pod_sandbox_id
    try:
        def create(attempt: int) -> None:
            create_again(runtime, sandbox_id, pod, attempt)

        create(0)
        [first] = koordrp.log_lines("] CreateContainer pod default/unplugged")
        assert "PreCreateContainer@wedged.json: timeout " in first, first
        registration.unlink()
        koordrp.log_lines("hook server wedged.json unregistered")
        wait_registered(koordrp, 0)
        for attempt in range(1, 4):
            create(attempt)
        lines = koordrp.log_lines("] CreateContainer pod default/unplugged", count=4)
        assert all(line.endswith("hooks: none") for line in lines[1:]), lines
        assert len(server.calls(CREATE)) == 1
    finally:
        remove_pod(runtime, sandbox_id)


def test_a_pod_resize_containerd_refuses_leaves_the_pod_as_it_was(
    containerd: Containerd, koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "watcher")
    register(hooks_dir, "watcher", server.path, ["PreStartContainer"])
    wait_registered(koordrp, 1)
    pod = pod_sandbox_config("resized", log_directory=workdir / "resized")
    pod.linux.resources.CopyFrom(linux_resources(cpu_quota=100000, cpu_period=100000))
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
    try:
        # The bytes a kubelet of 1.33 or later sends, from cri-api's own message.
        resize = api_pb2.UpdatePodSandboxResourcesRequest(
            pod_sandbox_id=sandbox_id, resources=linux_resources(cpu_quota=200000, cpu_period=100000)
        ).SerializeToString()
        path = "/runtime.v1.RuntimeService/UpdatePodSandboxResources"
        answers = []
        with koordrp.channel() as through:
            for channel in (through, containerd.channel()):
                try:
                    channel.unary_unary(path, request_serializer=None, response_deserializer=None)(resize, timeout=TIMEOUT)
                    answers.append("OK")
                except grpc.RpcError as error:
                    answers.append(error.code().name)
        assert answers == ["UNIMPLEMENTED", "UNIMPLEMENTED"]  # containerd 1.6 and 1.7 do not know it
        container = container_config("resized", image=BUSYBOX_REF, command=["sleep", "3600"])
        start_container(runtime, sandbox_id, pod, container)
        [started] = server.calls("PreStartContainerHook")
        assert started.pod_resources.cpu_quota == 100000
    finally:
        remove_pod(runtime, sandbox_id)
