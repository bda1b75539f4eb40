"""Runtime hooks end to end: koordrp between a real containerd and real hook servers.

Every test here runs five ways (the `mode` fixture): koordrp in CRI mode in front of the machine's
containerd 1.6, of Debian 13's containerd 1.7 and of Debian sid's containerd 2.1, and koordrp as the NRI
plugin of containerd 1.7 and of 2.1, kubelet's calls going to containerd itself (`runtime` is then
containerd's own CRI). The hook servers are the same. A test of what only the proxy can do (change a
pod's sandbox) runs in the CRI ways; tests/e2e/test_nri.py has NRI mode's own.
"""

import json
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from cri_api.v1 import api_pb2

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.hooks.messages import IMAGE_NAME_ANNOTATION, RUNTIME_OWNS_IMAGE_NAME
from tests.e2e.conftest import Runtimes, hook_server, wait_registered
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import Containerd
from tests.support.cri_objects import container_config, linux_resources, pod_sandbox_config
from tests.support.hook_registration import register
from tests.support.dockerd import remove_cgroup
from tests.support.images import BUSYBOX_REF, ImageSet
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import TIMEOUT, remove_pod, running_container, runtime_spec, start_container

CGROUP_PARENT = "/koordrp-e2e"
CREATE = "PreCreateContainerHook"


# The ways koordrp runs here: the containerd release, and whether koordrp is its NRI plugin.
MODES = {
    "containerd-1.6": ("1.6", False),
    "containerd-1.7": ("1.7", False),
    "nri-1.7": ("1.7", True),
    "containerd-2.1": ("2.1", False),
    "nri-2.1": ("2.1", True),
}
PROXY_MODES = [mode for mode, (_, nri) in MODES.items() if not nri]


@pytest.fixture(params=list(MODES))
def mode(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


@pytest.fixture
def containerd(mode: str, runtimes: Runtimes) -> Containerd:
    """The session's containerd of the mode's release."""
    return runtimes.get(MODES[mode][0])


@pytest.fixture
def koordrp(mode: str, containerd: Containerd, workdir: Path) -> Iterator[KoordrpProcess]:
    nri_socket = containerd.paths.nri_socket if MODES[mode][1] else None
    process = KoordrpProcess(workdir, containerd.endpoint, nri_socket=nri_socket)
    process.start()
    yield process
    process.stop()


@pytest.fixture
def runtime(mode: str, koordrp: KoordrpProcess, containerd: Containerd) -> Iterator[Any]:
    """Where kubelet's calls go: koordrp's socket, or in NRI mode containerd's."""
    if MODES[mode][1]:
        yield containerd.runtime()
        return
    with koordrp.channel() as channel:
        yield koordrp.runtime(channel)


def container_env(runtime: Any, container_id: str) -> list[str]:
    request = api_pb2.ExecSyncRequest(container_id=container_id, cmd=["env"], timeout=10)
    result: api_pb2.ExecSyncResponse = runtime.ExecSync(request)
    return result.stdout.decode().split()


def remove_cgroup_parent() -> None:
    remove_cgroup(CGROUP_PARENT)


@pytest.mark.parametrize("mode", PROXY_MODES, indirect=True)
def test_pre_hooks_change_what_the_container_gets(
    koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "tuner")
    server.behaviours["PreRunPodSandboxHook"] = lambda request: hook.PodSandboxHookResponse(cgroup_parent=CGROUP_PARENT)
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(
        container_envs={"KOORDRP_TEST": "1"},
        container_resources=hook.LinuxContainerResources(cpu_shares=512, cpuset_cpus="0"),
        container_annotations={"koordrp.test/tuned": "yes"},
    )
    register(hooks_dir, "tuner", server.path, ["PreRunPodSandbox", "PreCreateContainer"])
    wait_registered(koordrp, 1)
    try:
        with running_container(runtime, "tuned", workdir, container_options={"env": {"FROM_KUBELET": "a=b"}}) as pod:
            assert "KOORDRP_TEST=1" in container_env(runtime, pod.container_id)
            assert "FROM_KUBELET=a=b" in container_env(runtime, pod.container_id)
            spec = runtime_spec(runtime, pod.container_id)
            assert spec["linux"]["resources"]["cpu"]["shares"] == 512
            assert spec["linux"]["resources"]["cpu"]["cpus"] == "0"
            status = runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=pod.container_id)).status
            assert status.annotations["koordrp.test/tuned"] == "yes"
            assert spec["linux"]["cgroupsPath"].startswith(CGROUP_PARENT + "/")
            sandbox = runtime.PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=pod.sandbox_id, verbose=True))
            sandbox_spec = json.loads(sandbox.info["info"])["runtimeSpec"]
            assert sandbox_spec["linux"]["cgroupsPath"].startswith(CGROUP_PARENT + "/")
            created = server.calls(CREATE)[0]
            assert created.pod_cgroup_parent == CGROUP_PARENT
            assert created.pod_meta.name == "tuned"
        [run] = koordrp.log_lines("[koordrp.calls#info] RunPodSandbox pod default/tuned")
        assert f'PreRunPodSandbox@tuner.json: ok' in run and f'changed cgroup_parent ""→"{CGROUP_PARENT}"' in run
        [create] = koordrp.log_lines("[koordrp.calls#info] CreateContainer pod default/tuned")
        for change in ('resources.cpu_shares 0→512', 'resources.cpuset_cpus ""→"0"', "envs +KOORDRP_TEST", "annotations +koordrp.test/tuned"):
            assert change in create, create
    finally:
        remove_cgroup_parent()


def test_hooks_see_the_image_kubelet_named_in_every_mode_and_cannot_change_it(
    koordrp: KoordrpProcess,
    runtime: Any,
    images: ImageSet,
    servers: dict[str, FakeHookServer],
    workdir: Path,
    hooks_dir: Path,
) -> None:
    server = hook_server(servers, workdir, "images")
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(
        container_envs={"IMAGE": request.container_annotations.get(IMAGE_NAME_ANNOTATION, "(none)")},
        container_annotations={IMAGE_NAME_ANNOTATION: "registry.example/other:1"},
    )
    register(hooks_dir, "images", server.path, ["PreCreateContainer", "PreStartContainer"])
    wait_registered(koordrp, 1)
    # As kubelet names it: by the image's id, and as the pod spec writes it.
    kubelets = {"image": images.busybox.image_id, "user_specified_image": BUSYBOX_REF}
    with running_container(runtime, "imaged", workdir, container_options=kubelets) as pod:
        assert f"IMAGE={BUSYBOX_REF}" in container_env(runtime, pod.container_id)
        # containerd's own annotation, whatever the hook answered (1.6 and 1.7 resolve the id to the image's
        # only name; 2.1 takes the pod spec's)...
        assert runtime_spec(runtime, pod.container_id)["annotations"][IMAGE_NAME_ANNOTATION] == BUSYBOX_REF
        # ... and nothing of it in the request the runtime was sent.
        status = runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=pod.container_id, verbose=True))
        assert IMAGE_NAME_ANNOTATION not in json.loads(status.info["info"])["config"].get("annotations", {})
        [started] = server.calls("PreStartContainerHook")
        assert started.container_annotations[IMAGE_NAME_ANNOTATION] == BUSYBOX_REF
    [create] = koordrp.log_lines("[koordrp.calls#info] CreateContainer pod default/imaged")
    assert f"left alone ({RUNTIME_OWNS_IMAGE_NAME}) annotations ~{IMAGE_NAME_ANNOTATION}" in create, create


def test_servers_chain_in_file_name_order(
    koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    first, second = hook_server(servers, workdir, "first"), hook_server(servers, workdir, "second")
    first.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_envs={"ORDER": "first"})
    second.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(
        container_envs={"ORDER": request.container_envs["ORDER"] + ",second", "SECOND": "1"}
    )
    register(hooks_dir, "20-second", second.path, ["PreCreateContainer"])
    register(hooks_dir, "10-first", first.path, ["PreCreateContainer"])
    wait_registered(koordrp, 2)
    with running_container(runtime, "chained", workdir) as pod:
        env = container_env(runtime, pod.container_id)
        assert "ORDER=first,second" in env
        assert "SECOND=1" in env


@pytest.mark.parametrize("policy", ["Fail", "Ignore"])
def test_failure_policies(
    policy: str, koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    broken = hook_server(servers, workdir, "broken")
    broken.failures[CREATE] = grpc.StatusCode.INTERNAL
    register(hooks_dir, "broken", broken.path, ["PreCreateContainer"], policy=policy)
    wait_registered(koordrp, 1)
    if policy == "Fail":
        with pytest.raises(grpc.RpcError) as error:
            with running_container(runtime, "refused", workdir):
                pass
        assert "broken.json" in (error.value.details() or "")
        assert "PreCreateContainer" in (error.value.details() or "")
    else:
        with running_container(runtime, "tolerated", workdir) as pod:
            assert not any(line.startswith("KOORDRP") for line in container_env(runtime, pod.container_id))
    assert len(broken.calls(CREATE)) == 1


@pytest.mark.parametrize("policy", ["Fail", "Ignore"])
def test_a_server_slower_than_its_timeout(
    policy: str, koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    slow = hook_server(servers, workdir, "slow")
    slow.delays[CREATE] = 5
    register(hooks_dir, "slow", slow.path, ["PreCreateContainer"], policy=policy, **{"timeout-seconds": 0.5})
    wait_registered(koordrp, 1)
    pod = pod_sandbox_config("slow", log_directory=workdir / "slow")
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
    try:
        container = container_config("slow", image=BUSYBOX_REF, command=["sleep", "3600"])
        if policy == "Fail":
            with pytest.raises(grpc.RpcError) as error:
                start_container(runtime, sandbox_id, pod, container)
            assert "no answer within 0.5s" in (error.value.details() or "")
            [line] = koordrp.log_lines("] CreateContainer pod default/slow")
            assert ": UNKNOWN in " in line and "hooks: PreCreateContainer@slow.json: timeout " in line
            assert line.endswith("ms (no answer within 0.5s; Fail policy: the call failed)"), line
        else:
            runtime.CreateContainer(
                api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=container, sandbox_config=pod),
                timeout=TIMEOUT,
            )
            [line] = koordrp.log_lines("] CreateContainer pod default/slow")
            assert line.endswith("ms (no answer within 0.5s; went on without it)"), line
    finally:
        remove_pod(runtime, sandbox_id)


def test_a_missing_socket_fails_at_once(
    koordrp: KoordrpProcess, runtime: Any, workdir: Path, hooks_dir: Path
) -> None:
    register(hooks_dir, "absent", str(workdir / "nobody.sock"), ["PreRunPodSandbox"], policy="Fail")
    wait_registered(koordrp, 1)
    with pytest.raises(grpc.RpcError) as error:
        runtime.RunPodSandbox(
            api_pb2.RunPodSandboxRequest(config=pod_sandbox_config("nobody", log_directory=workdir / "n")), timeout=TIMEOUT
        )
    # Said at once, not a timeout waited out.
    assert "does not exist" in (error.value.details() or "")
    assert "no answer within" not in (error.value.details() or "")


def test_hot_reload_gives_each_pod_the_config_in_force_when_it_arrived(
    koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "reload")
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_envs={"RELOADED": "1"})

    def env_of(name: str) -> list[str]:
        with running_container(runtime, name, workdir) as pod:
            return container_env(runtime, pod.container_id)

    assert "RELOADED=1" not in env_of("before")
    path = register(hooks_dir, "reload", server.path, ["PreStartContainer"])
    wait_registered(koordrp, 1)
    assert "RELOADED=1" not in env_of("start-only")
    register(hooks_dir, "reload", server.path, ["PreCreateContainer"])  # renamed over the old one
    koordrp.wait_for_registrations("reload.json (", "): PreCreateContainer")
    assert "RELOADED=1" in env_of("after-rename")
    path.write_text(json.dumps({"remote-endpoint": server.path, "runtime-hooks": ["PreStartContainer"]}))  # in place
    koordrp.wait_for_registrations("reload.json (", "): PreStartContainer")
    assert "RELOADED=1" not in env_of("after-edit")
    register(hooks_dir, "reload", server.path, ["PreCreateContainer"])
    koordrp.wait_for_registrations("reload.json (", "): PreCreateContainer")
    path.write_text("{ not json")  # a broken edit keeps the last good version
    assert koordrp.log_lines(f"hook server registration {path} rejected: ")
    assert "RELOADED=1" in env_of("after-broken-edit")
    assert "reload.json" in koordrp.log() and koordrp.process.poll() is None  # type: ignore[union-attr]
    path.unlink()
    wait_registered(koordrp, 0)
    assert "RELOADED=1" not in env_of("after-delete")


def test_skip_label_calls_no_hook(
    koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "watcher")
    register(hooks_dir, "watcher", server.path, [h.removesuffix("Hook") for h in (
        "PreRunPodSandboxHook", "PreCreateContainerHook", "PreStartContainerHook", "PostStartContainerHook",
        "PostStopContainerHook", "PostStopPodSandboxHook",
    )])
    wait_registered(koordrp, 1)
    skip = {"runtimeproxy.koordinator.sh/skip-hookserver": "true"}
    with running_container(runtime, "skipped", workdir, labels=skip) as pod:
        runtime.StopContainer(api_pb2.StopContainerRequest(container_id=pod.container_id, timeout=0))
    assert server.rpcs() == []
    with running_container(runtime, "hooked", workdir) as pod:
        runtime.StopContainer(api_pb2.StopContainerRequest(container_id=pod.container_id, timeout=0))
    assert server.rpcs_once(6) == [
        "PreRunPodSandboxHook", "PreCreateContainerHook", "PreStartContainerHook", "PostStartContainerHook",
        "PostStopContainerHook", "PostStopPodSandboxHook",
    ]


def test_post_hooks_see_what_kubelet_asked_and_their_failures_do_not_fail_the_call(
    koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    tuner, post = hook_server(servers, workdir, "tuner"), hook_server(servers, workdir, "post")
    tuner.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(
        container_envs={"TUNED": "1"}, container_resources=hook.LinuxContainerResources(cpu_shares=300)
    )
    post.failures["PostStartContainerHook"] = grpc.StatusCode.INTERNAL
    post.failures["PostStopContainerHook"] = grpc.StatusCode.INTERNAL
    register(hooks_dir, "10-tuner", tuner.path, ["PreCreateContainer"])
    register(hooks_dir, "20-post", post.path, ["PostStartContainer", "PostStopContainer"], policy="Fail")
    wait_registered(koordrp, 2)
    with running_container(runtime, "post", workdir) as pod:
        runtime.StopContainer(api_pb2.StopContainerRequest(container_id=pod.container_id, timeout=0))
    assert post.rpcs_once(2) == ["PostStartContainerHook", "PostStopContainerHook"]
    for request in post.calls():
        # kubelet's container, not what PreCreateContainer made of it (it got TUNED and 300 shares).
        assert "TUNED" not in request.container_envs
        assert request.container_resources.cpu_shares == 0
        assert request.container_meta.id == pod.container_id


@pytest.mark.parametrize("mode", PROXY_MODES, indirect=True)
def test_after_a_restart_hooks_get_the_same_information(
    containerd: Containerd, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "memory")
    server.behaviours["PreRunPodSandboxHook"] = lambda request: hook.PodSandboxHookResponse(
        cgroup_parent=CGROUP_PARENT, annotations={"koordrp.test/pod": "tuned"}
    )
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(
        container_envs={"KOORDRP_TEST": "1"},
        container_resources=hook.LinuxContainerResources(cpu_shares=700, cpuset_cpus="0"),
    )
    register(
        hooks_dir, "memory", server.path, ["PreRunPodSandbox", "PreCreateContainer", "PreStartContainer", "PostStopContainer"]
    )
    pod = pod_sandbox_config("restart", labels={"app": "r"}, annotations={"a": "1"}, log_directory=workdir / "r")
    container = container_config(
        "restart", command=["sleep", "3600"], env={"B": "2", "A": "1"}, resources=linux_resources(memory_limit_in_bytes=64 << 20)
    )
    first = KoordrpProcess(workdir, containerd.endpoint)
    first.start()
    sandbox_id = ""
    try:
        with first.channel() as channel:
            runtime = first.runtime(channel)
            sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
            container_id = start_container(runtime, sandbox_id, pod, container)
        before = server.calls("PreStartContainerHook")[-1]
        assert first.terminate() == 0
        second = KoordrpProcess(workdir, containerd.endpoint)
        second.start()
        try:
            with second.channel() as channel:
                second.runtime(channel).StopContainer(api_pb2.StopContainerRequest(container_id=container_id, timeout=0))
        finally:
            second.stop()
    finally:
        first.stop()
        if sandbox_id:
            remove_pod(containerd.runtime(), sandbox_id)
        remove_cgroup_parent()
    after = server.calls("PostStopContainerHook")[-1]
    assert after == before
    # The pod as it is (PreRunPodSandbox moved it), the container as kubelet asked: what kubelet asked
    # came back from the state directory, not from containerd, which has the hooks' changes.
    assert after.pod_cgroup_parent == CGROUP_PARENT
    assert after.pod_annotations["koordrp.test/pod"] == "tuned"
    assert dict(after.container_envs) == {"B": "2", "A": "1"}
    assert (after.container_resources.cpu_shares, after.container_resources.memory_limit_in_bytes) == (0, 64 << 20)


@pytest.mark.parametrize("mode", PROXY_MODES, indirect=True)
def test_after_a_restart_the_image_is_still_a_name(
    containerd: Containerd, images: ImageSet, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    # The container's state file goes between the two koordrps, so the second reads it back from containerd,
    # which (1.6, 1.7) kept only the image's id kubelet sent, not the pod spec's name.
    watcher = hook_server(servers, workdir, "watcher")
    register(hooks_dir, "watcher", watcher.path, ["PreStartContainer", "PreUpdateContainerResources"])
    pod = pod_sandbox_config("image-restart", log_directory=workdir / "ir")
    container = container_config(
        "app", image=images.busybox.image_id, user_specified_image=BUSYBOX_REF, command=["sleep", "3600"]
    )
    runtime = containerd.runtime()
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
    try:
        for step in ("start", "update"):  # each through a koordrp of its own
            koordrp = KoordrpProcess(workdir, containerd.endpoint)
            koordrp.start()
            try:
                with koordrp.channel() as channel:
                    through = koordrp.runtime(channel)
                    if step == "start":
                        container_id = start_container(through, sandbox_id, pod, container)
                    else:
                        update = api_pb2.LinuxContainerResources(cpu_shares=256)
                        request = api_pb2.UpdateContainerResourcesRequest(container_id=container_id, linux=update)
                        through.UpdateContainerResources(request, timeout=TIMEOUT)
            finally:
                koordrp.stop()
            if step == "start":
                (workdir / "state" / "containers" / container_id).unlink()
    finally:
        remove_pod(runtime, sandbox_id)
    started = watcher.calls("PreStartContainerHook")[-1]
    updated = watcher.calls("PreUpdateContainerResourcesHook")[-1]
    assert started.container_annotations[IMAGE_NAME_ANNOTATION] == BUSYBOX_REF
    assert updated.container_annotations[IMAGE_NAME_ANNOTATION] == BUSYBOX_REF


def test_environment_values_from_hooks_are_never_logged(
    koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    secret = "s3cr3t-value-that-must-not-leak"
    first, second = hook_server(servers, workdir, "first"), hook_server(servers, workdir, "second")
    first.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_envs={"TOKEN": "old-" + secret})
    second.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_envs={"TOKEN": secret})
    broken = hook_server(servers, workdir, "broken")
    broken.failures[CREATE] = grpc.StatusCode.INTERNAL
    register(hooks_dir, "10-first", first.path, ["PreCreateContainer"])
    register(hooks_dir, "20-second", second.path, ["PreCreateContainer"])
    register(hooks_dir, "30-broken", broken.path, ["PreCreateContainer"])
    wait_registered(koordrp, 3)
    with running_container(runtime, "secret", workdir) as pod:
        assert f"TOKEN={secret}" in container_env(runtime, pod.container_id)
    log = koordrp.log()
    assert "container_envs[TOKEN]" in log  # the conflict is logged, by key
    assert secret not in log
