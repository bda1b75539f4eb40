"""koordrp comes and goes on a fleet (node boots, rollouts, crashes): in NRI mode, on containerd 1.7 and 2.1,
what containerd made while it was away gets the pre hooks it missed once it is back, what went meanwhile
gets its post stops once, what it saw made is not caught up again, and what kubelet asked survives a kill -9.
"""

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from cri_api.v1 import api_pb2

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.hooks.messages import CATCH_UP_ANNOTATION
from tests.e2e.conftest import hook_server, wait_registered
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import Containerd
from tests.support.daemons import cgroup_dirs, cgroup_mounts
from tests.support.cri_objects import container_config, linux_resources, pod_sandbox_config
from tests.support.hook_registration import register
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import TIMEOUT, remove_pod, runtime_spec, start_container
from tests.support.waiting import eventually

CREATE = "PreCreateContainerHook"
HOOKS = [
    "PreRunPodSandbox",
    "PreCreateContainer",
    "PreStartContainer",
    "PreUpdateContainerResources",
    "PostStopContainer",
    "PostStopPodSandbox",
]


@pytest.fixture
def tuner(servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path) -> FakeHookServer:
    """A hook server that adds an environment variable and gives cpu shares 512 at PreCreateContainer."""
    server = hook_server(servers, workdir, "tuner")
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(
        container_envs={"TUNED": "1"}, container_resources=hook.LinuxContainerResources(cpu_shares=512)
    )
    register(hooks_dir, "tuner", server.path, HOOKS)
    return server


@contextlib.contextmanager
def koordrp_in(containerd: Containerd, workdir: Path) -> Iterator[KoordrpProcess]:
    """koordrp as containerd's NRI plugin (its state directory the workdir's, kept across restarts), with the
    tuner registered."""
    koordrp = KoordrpProcess(workdir, containerd.endpoint, nri_socket=containerd.paths.nri_socket)
    koordrp.start()
    try:
        wait_registered(koordrp, 1)
        yield koordrp
    finally:
        koordrp.stop()


@contextlib.contextmanager
def pods(runtime: Any, workdir: Path, prefix: str, count: int) -> Iterator[list[tuple[str, str]]]:
    """``count`` pods of one running busybox container each, made on containerd itself (as kubelet does in NRI
    mode), removed on exit: (sandbox id, container id) each."""
    made: list[tuple[str, str]] = []
    try:
        for index in range(count):
            config = pod_sandbox_config(f"{prefix}-{index}", log_directory=workdir / f"{prefix}-{index}")
            sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=TIMEOUT).pod_sandbox_id
            made.append((sandbox_id, ""))
            container = container_config("app", command=["sleep", "3600"], resources=linux_resources(cpu_shares=102))
            made[-1] = (sandbox_id, start_container(runtime, sandbox_id, config, container))
        yield made
    finally:
        for sandbox_id, _ in made:
            with contextlib.suppress(Exception):
                remove_pod(runtime, sandbox_id)


def cpu_shares(runtime: Any, container_id: str) -> int:
    shares: int = runtime_spec(runtime, container_id)["linux"]["resources"]["cpu"]["shares"]
    return shares


def spin_until(condition: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    """``eventually`` without its pause between looks: for a moment that lasts milliseconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached in time: {what}")


def cgroup_value(shares: int) -> tuple[str, int]:
    """What the kernel shows for ``shares``: cgroup v1's cpu.shares, or v2's cpu.weight as runc converts it."""
    if any((mount / "cpu.shares").exists() or (mount / "cpu" / "cpu.shares").exists() for mount in cgroup_mounts()):
        return ("cpu.shares", shares)
    return ("cpu.weight", 1 + ((shares - 2) * 9999) // 262142)


def cgroup_cpu(runtime: Any, container_id: str) -> tuple[str, int]:
    """The container's own cgroup's cpu.shares (v1) or cpu.weight (v2)."""
    path = runtime_spec(runtime, container_id)["linux"]["cgroupsPath"]
    for directory in cgroup_dirs(path):
        for name in ("cpu.shares", "cpu.weight"):
            if (directory / name).exists():
                return (name, int((directory / name).read_text()))
    raise AssertionError(f"no cpu cgroup at {path}")


def creates_of(server: FakeHookServer, names: set[str]) -> list[Any]:
    return [call for call in server.calls(CREATE) if call.pod_meta.name in names]


def test_pods_made_while_koordrp_was_away_get_their_hooks_once_it_is_back(
    nri_containerd: Containerd, tuner: FakeHookServer, workdir: Path
) -> None:
    runtime = nri_containerd.runtime()
    first = KoordrpProcess(workdir, nri_containerd.endpoint, nri_socket=nri_containerd.paths.nri_socket)
    first.start()
    wait_registered(first, 1)
    first.kill()  # SIGKILL
    with pods(runtime, workdir, "away", 3) as made:
        assert [cpu_shares(runtime, container_id) for _, container_id in made] == [102] * 3  # no koordrp: kubelet's
        with koordrp_in(nri_containerd, workdir) as koordrp:
            names = {f"away-{index}" for index in range(3)}
            eventually(lambda: len(creates_of(tuner, names)) == 3, "a catch-up PreCreateContainer for each container")
            eventually(
                lambda: all(cpu_shares(runtime, container_id) == 512 for _, container_id in made),
                "every container at the hook's cpu shares",
            )
            calls = creates_of(tuner, names)
            assert sorted(call.pod_meta.name for call in calls) == sorted(names)
            assert all(call.container_annotations[CATCH_UP_ANNOTATION] == "true" for call in calls)
            assert all(call.container_resources.cpu_shares == 102 for call in calls)  # what kubelet had containerd make
            line = koordrp.log_lines("CreateContainer (catch-up) pod default/away-0", timeout=30)[0]
            assert "left alone (late) envs +TUNED" in line, line
            # The cgroups themselves, not only containerd's record of them.
            assert [cgroup_cpu(runtime, container_id) for _, container_id in made] == [cgroup_value(512)] * 3


def test_a_node_that_boots_with_pods_before_koordrp_gets_their_hooks(
    nri_containerd: Containerd, tuner: FakeHookServer, workdir: Path
) -> None:
    runtime = nri_containerd.runtime()
    with pods(runtime, workdir, "boot", 10) as made:
        with koordrp_in(nri_containerd, workdir) as koordrp:  # an empty state directory: it never saw them
            names = {f"boot-{index}" for index in range(10)}
            eventually(lambda: len(creates_of(tuner, names)) == 10, "a catch-up PreCreateContainer for each container")
            eventually(
                lambda: all(cpu_shares(runtime, container_id) == 512 for _, container_id in made),
                "every container at the hook's cpu shares",
            )
            assert koordrp.log_lines("catching up on what containerd made while koordrp was away: 10 pods, 10 containers")
            assert sorted(call.pod_meta.name for call in creates_of(tuner, names)) == sorted(names)


def test_a_container_koordrp_saw_made_is_not_caught_up_after_a_restart(
    nri_containerd: Containerd, tuner: FakeHookServer, workdir: Path
) -> None:
    runtime = nri_containerd.runtime()
    with koordrp_in(nri_containerd, workdir) as koordrp:
        with pods(runtime, workdir, "seen", 1) as made:
            assert cpu_shares(runtime, made[0][1]) == 512
            koordrp.kill()
            with koordrp_in(nri_containerd, workdir) as again:
                assert again.log_lines("store rebuilt from containerd's NRI")
                # A container made now is hooked: the plugin is past its synchronization and any catch-up.
                with pods(runtime, workdir, "after", 1):
                    pass
                assert [call.pod_meta.name for call in tuner.calls(CREATE)] == ["seen-0", "after-0"]


def test_pods_removed_while_koordrp_was_away_get_their_post_stops_once(
    nri_containerd: Containerd, tuner: FakeHookServer, workdir: Path
) -> None:
    runtime = nri_containerd.runtime()
    with koordrp_in(nri_containerd, workdir) as koordrp:
        with pods(runtime, workdir, "gone", 3) as made:
            koordrp.kill()
            for sandbox_id, _ in made:
                remove_pod(runtime, sandbox_id)
    names = {f"gone-{index}" for index in range(3)}

    def told(rpc: str) -> list[Any]:
        return [call for call in tuner.calls(rpc) if call.pod_meta.name in names]

    with koordrp_in(nri_containerd, workdir) as again:
        eventually(
            lambda: len(told("PostStopPodSandboxHook")) == 3 and len(told("PostStopContainerHook")) == 3,
            "a PostStopContainer and a PostStopPodSandbox for each pod removed while koordrp was away",
        )
        assert all(call.annotations[CATCH_UP_ANNOTATION] == "true" for call in told("PostStopPodSandboxHook"))
        assert all(call.container_annotations[CATCH_UP_ANNOTATION] == "true" for call in told("PostStopContainerHook"))
        assert again.terminate() == 0  # after its stop drained every post stop it owed
    with koordrp_in(nri_containerd, workdir) as third:  # and once only, across a further restart
        assert third.terminate() == 0
    assert (len(told("PostStopPodSandboxHook")), len(told("PostStopContainerHook"))) == (3, 3)


def test_kubelets_values_survive_a_kill_right_after_the_pre_create_answer(
    nri_containerd: Containerd, tuner: FakeHookServer, workdir: Path
) -> None:
    runtime = nri_containerd.runtime()
    with koordrp_in(nri_containerd, workdir) as koordrp:
        containers = workdir / "state" / "containers"
        killer: list[threading.Thread] = []

        def kill_once_kept() -> None:
            # What kubelet asked is kept, under the id containerd gave and marked expected, just before containerd is
            # answered; containerd confirms the create a few milliseconds later: koordrp dies in between. (No sleep:
            # the window is short.)
            spin_until(lambda: any(os.scandir(containers)), "what kubelet asked kept before the answer")
            koordrp.kill()

        tuned = tuner.behaviours[CREATE]

        def killed_at_the_answer(request: Any) -> Any:
            tuner.behaviours[CREATE] = tuned  # once
            killer.append(threading.Thread(target=kill_once_kept))
            killer[0].start()
            return tuned(request)

        tuner.behaviours[CREATE] = killed_at_the_answer
        with pods(runtime, workdir, "killed", 1) as made:
            killer[0].join(timeout=120)
            assert koordrp.process is not None and koordrp.process.poll() is not None  # killed where it was meant to be
            container_id = made[0][1]
            # Killed as it answered: containerd made the container with the answer, or, if it had not got it yet,
            # without it, as when koordrp is away (then it is caught up).
            answered = cpu_shares(runtime, container_id) == 512
            with koordrp_in(nri_containerd, workdir):
                eventually(lambda: cpu_shares(runtime, container_id) == 512, "the container at the hook's cpu shares")
                creates = creates_of(tuner, {"killed-0"})
                caught_up = [call for call in creates if CATCH_UP_ANNOTATION in call.container_annotations]
                assert (len(creates), len(caught_up)) == ((1, 0) if answered else (2, 1))
                update = api_pb2.UpdateContainerResourcesRequest(
                    container_id=container_id, linux=api_pb2.LinuxContainerResources(cpu_shares=256)
                )
                runtime.UpdateContainerResources(update, timeout=TIMEOUT)
                eventually(lambda: tuner.calls("PreUpdateContainerResourcesHook"), "the update's hook")
                seen = tuner.calls("PreUpdateContainerResourcesHook")[0]
                # kubelet's own environment, not the hook's output shown back to it as kubelet's
                assert "TUNED" not in seen.container_envs


def test_the_proxy_tells_the_post_stops_of_pods_removed_while_it_was_away_once(
    containerd: Containerd, tuner: FakeHookServer, workdir: Path
) -> None:
    direct = containerd.runtime()
    first = KoordrpProcess(workdir, containerd.endpoint)
    first.start()
    wait_registered(first, 1)
    with first.channel() as channel, pods(first.runtime(channel), workdir, "proxied", 2) as made:
        first.kill()  # SIGKILL
        for sandbox_id, _ in made:  # an operator's crictl rmp on containerd's own socket, or kubelet's GC meanwhile
            remove_pod(direct, sandbox_id)
    names = {"proxied-0", "proxied-1"}

    def told(rpc: str) -> list[Any]:
        return [call for call in tuner.calls(rpc) if call.pod_meta.name in names]

    second = KoordrpProcess(workdir, containerd.endpoint)
    second.start()
    try:
        eventually(
            lambda: len(told("PostStopPodSandboxHook")) == 2 and len(told("PostStopContainerHook")) == 2,
            "a PostStopContainer and a PostStopPodSandbox for each pod removed while koordrp was away",
        )
        assert all(call.annotations[CATCH_UP_ANNOTATION] == "true" for call in told("PostStopPodSandboxHook"))
        assert all(call.container_annotations[CATCH_UP_ANNOTATION] == "true" for call in told("PostStopContainerHook"))
        # What kubelet asked, from the state directory: not the hooks' changes the runtime had.
        assert all("TUNED" not in call.container_envs for call in told("PostStopContainerHook"))
        assert second.terminate() == 0
    finally:
        second.stop()
    assert (len(told("PostStopPodSandboxHook")), len(told("PostStopContainerHook"))) == (2, 2)


def test_the_proxy_killed_as_containerd_makes_a_container_keeps_kubelets_values(
    containerd: Containerd, tuner: FakeHookServer, workdir: Path
) -> None:
    direct = containerd.runtime()
    first = KoordrpProcess(workdir, containerd.endpoint)
    first.start()
    wait_registered(first, 1)
    config = pod_sandbox_config("proxy-killed", log_directory=workdir / "proxy-killed")
    with first.channel() as channel:
        sandbox_id = first.runtime(channel).RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=TIMEOUT).pod_sandbox_id
    try:
        listed = api_pb2.ListContainersRequest(filter=api_pb2.ContainerFilter(pod_sandbox_id=sandbox_id))

        def kill_once_made() -> None:
            # Killed once containerd has the container: before or after koordrp heard so and kept it under its id.
            spin_until(lambda: direct.ListContainers(listed, timeout=TIMEOUT).containers, "the container made")
            first.kill()

        killer = threading.Thread(target=kill_once_made)
        killer.start()
        with first.channel() as channel, contextlib.suppress(Exception):  # kubelet may or may not get its answer
            container = container_config("app", command=["sleep", "3600"], env={"FROM_KUBELET": "1"})
            create = api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=container, sandbox_config=config)
            first.runtime(channel).CreateContainer(create, timeout=TIMEOUT)
        killer.join(timeout=120)
        assert first.process is not None and first.process.poll() is not None  # killed where it was meant to be
        [made] = direct.ListContainers(listed, timeout=TIMEOUT).containers
        assert "TUNED=1" in runtime_spec(direct, made.id)["process"]["env"]  # as the hook answered
        second = KoordrpProcess(workdir, containerd.endpoint)
        second.start()
        try:
            wait_registered(second, 1)
            with second.channel() as channel:
                update = api_pb2.UpdateContainerResourcesRequest(
                    container_id=made.id, linux=api_pb2.LinuxContainerResources(cpu_shares=256)
                )
                second.runtime(channel).UpdateContainerResources(update, timeout=TIMEOUT)
            [seen] = tuner.calls("PreUpdateContainerResourcesHook")
            assert seen.container_envs["FROM_KUBELET"] == "1" and "TUNED" not in seen.container_envs
        finally:
            second.stop()
    finally:
        remove_pod(direct, sandbox_id)
