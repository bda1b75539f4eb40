"""NRI mode end to end: koordrp as a plugin of a real containerd with NRI (1.7 and 2.1: every test runs on
both, the `nri_containerd` fixture), kubelet's calls going to
containerd itself, hook servers as in the proxy (tests/e2e/test_hooks.py runs the hook tests that
apply to both in both). Here: what NRI cannot do (a sandbox, a cleared cpuset) named; containerd's
deadline on each plugin call; post hooks once; containerd and koordrp restarting, and koordrp
starting first.
"""

import contextlib
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import grpc
import pytest
from cri_api.v1 import api_pb2

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from tests.e2e.conftest import hook_server, wait_registered
from tests.fake.hook_server import FakeHookServer, koordlet_cpuset_rule
from tests.support import koordlet
from tests.support.containerd import Containerd
from tests.support.cri_objects import container_config, linux_resources, pod_sandbox_config
from tests.support.dockerd import remove_cgroup
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF, ImageSet
from tests.support.koordrp_process import KoordrpProcess
from tests.support.node import FakeNode, run_check
from tests.support.pods import TIMEOUT, remove_pod, running_container, runtime_spec, start_container
from tests.support.scrape import free_port, get, sample
from tests.support.stack import start_containerd

CREATE = "PreCreateContainerHook"
CGROUP_PARENT = "/kubepods/koordrp-nri-e2e"  # a hook may move a pod within the pods' cgroup root, not out of it
BESTEFFORT = "/kubepods/besteffort/pod-nri-e2e"


@pytest.fixture
def runtime(nri_containerd: Containerd) -> Any:
    """containerd's own RuntimeService: in NRI mode kubelet calls containerd."""
    return nri_containerd.runtime()


def call_line(koordrp: KoordrpProcess, text: str) -> str:
    """The call's line: written once its hooks are done with it (a late answer applied)."""
    [line] = koordrp.log_lines(f"[koordrp.calls#info] {text}", timeout=15)
    return line


def test_hooks_change_the_container_and_what_nri_cannot_change_is_named(
    plugin: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "tuner")
    server.behaviours["PreRunPodSandboxHook"] = lambda request: hook.PodSandboxHookResponse(
        cgroup_parent=CGROUP_PARENT, annotations={"koordrp.test/pod": "1"}
    )
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(
        container_envs={"KOORDRP_TEST": "1"},
        container_resources=hook.LinuxContainerResources(cpu_shares=512, cpuset_cpus="0", memory_limit_in_bytes=64 << 20),
        container_annotations={"koordrp.test/tuned": "yes"},
    )
    register(hooks_dir, "tuner", server.path, ["PreRunPodSandbox", "PreCreateContainer"])
    wait_registered(plugin, 1)
    try:
        options = {"env": {"FROM_KUBELET": "a=b"}}
        with running_container(runtime, "tuned", workdir, container_options=options, cgroup_parent=BESTEFFORT) as pod:
            spec = runtime_spec(runtime, pod.container_id)
            assert "KOORDRP_TEST=1" in spec["process"]["env"] and "FROM_KUBELET=a=b" in spec["process"]["env"]
            resources = spec["linux"]["resources"]
            assert (resources["cpu"]["shares"], resources["cpu"]["cpus"], resources["memory"]["limit"]) == (512, "0", 64 << 20)
            assert spec["annotations"]["koordrp.test/tuned"] == "yes"
            # The sandbox stays where kubelet put it; its containers go where the pod's hooks said.
            assert spec["linux"]["cgroupsPath"].startswith(CGROUP_PARENT + "/")
            sandbox = runtime.PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=pod.sandbox_id, verbose=True))
            assert json.loads(sandbox.info["info"])["runtimeSpec"]["linux"]["cgroupsPath"].startswith(BESTEFFORT + "/")
            assert server.calls(CREATE)[0].pod_cgroup_parent == CGROUP_PARENT
    finally:
        remove_cgroup(CGROUP_PARENT)
        remove_cgroup(BESTEFFORT)
    run = call_line(plugin, "RunPodSandbox pod default/tuned")
    assert ": OK in " in run
    assert "left alone (NRI cannot change a pod's sandbox; later hooks see it as answered) annotations +koordrp.test/pod, " in run
    assert f'cgroup_parent "{BESTEFFORT}"→"{CGROUP_PARENT}"' in run
    create = call_line(plugin, "CreateContainer pod default/tuned")
    for change in ("resources.cpu_shares 0→512", 'resources.cpuset_cpus ""→"0"', "envs +KOORDRP_TEST"):
        assert change in create, create
    assert "left alone" not in create


def test_koordlets_cleared_cpuset_cannot_be_applied_and_is_named(
    plugin: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "koordlet")
    server.behaviours[CREATE] = koordlet_cpuset_rule
    koordlet.register(hooks_dir, koordlet.registration(server.path, koordlet.DEFAULT_STAGES))
    wait_registered(plugin, 1)
    try:
        options = {"resources": linux_resources(cpuset_cpus="0-1", cpu_shares=2)}
        with running_container(runtime, "besteffort", workdir, container_options=options, cgroup_parent=BESTEFFORT) as pod:
            assert runtime_spec(runtime, pod.container_id)["linux"]["resources"]["cpu"]["cpus"] == "0-1"
    finally:
        remove_cgroup(BESTEFFORT)
    create = call_line(plugin, "CreateContainer pod default/besteffort")
    assert 'PreCreateContainer@koordlet.json: ok' in create
    assert 'left alone (NRI can set a cpuset but not clear it) resources.cpuset_cpus "0-1"→""' in create


def test_a_server_slower_than_containerds_deadline_is_cut_short_then_tried_again_by_a_real_call(
    plugin: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    """containerd gives a plugin 2 s and drops one that answers later: the hooks get what is left of it. The
    server is skipped from then on; the first create after the pause is its trial, and it is back once it
    answers one in time. It sees each request once."""
    slow = hook_server(servers, workdir, "slow")
    slow.delays[CREATE] = 30
    slow.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_envs={"SLOW": "1"})
    register(hooks_dir, "slow", slow.path, ["PreCreateContainer"], policy="Ignore", **{"timeout-seconds": 20})
    wait_registered(plugin, 1)
    with running_container(runtime, "slow", workdir) as pod:
        assert "SLOW=1" not in runtime_spec(runtime, pod.container_id)["process"]["env"]
        slow.unwedge()  # it answers its backlog: too late for the container, whose environment is fixed
        create = call_line(plugin, "CreateContainer pod default/slow")
    assert "PreCreateContainer@slow.json: late " in create and "(no answer within 1.9s: went on without it" in create, create
    assert "left alone (late) envs +SLOW" in create, create
    for attempt in range(100):  # each create is skipped at once until the pause is over
        env = env_of_new_container(runtime, workdir, f"again-{attempt}")
        line = call_line(plugin, f"CreateContainer pod default/again-{attempt}")
        if "not-answering" not in line:
            break
    assert "PreCreateContainer@slow.json: ok" in line and "(trial: it answers in time again)" in line, line
    assert "SLOW=1" in env
    assert plugin.log_lines("calls reach it again")
    assert [request.pod_meta.name for request in slow.calls(CREATE)] == ["slow", f"again-{attempt}"]
    assert "the connection was lost" not in plugin.log()


def test_a_server_slower_than_containerds_deadline_is_warned_of_before_any_call(
    nri_containerd: Containerd, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    slow = hook_server(servers, workdir, "slow")
    register(hooks_dir, "slow", slow.path, ["PreCreateContainer"], "Ignore", **{"timeout-seconds": 10})
    koordrp = KoordrpProcess(workdir, nri_containerd.endpoint, nri_socket=nri_containerd.paths.nri_socket)
    koordrp.start()
    try:
        [warning] = koordrp.log_lines("hook server slow.json (")
        assert "may take 10s to answer (its timeout-seconds, or --hook-timeout), but its pre hooks get 1.9s" in warning
        assert "containerd's NRI gives each call 2s (plugin_request_timeout)" in warning
        assert f"slow.json ({slow.path}, Ignore, 10s; pre hooks 1.9s)" in koordrp.wait_for_registrations("pre hooks 1.9s")
        assert slow.calls() == [] and "koordrp.calls" not in koordrp.log()
        later = hook_server(servers, workdir, "later")
        register(hooks_dir, "later", later.path, ["PreRunPodSandbox"])  # --hook-timeout's 60s
        [warning] = koordrp.log_lines("hook server later.json (")
        assert "may take 60s to answer" in warning
    finally:
        koordrp.stop()


class AfterContainerdWentOn:
    """A PreCreateContainer behaviour that answers a create only once the test has seen containerd go on without
    it (its CreateContainer answered): every answer is late, however fast or slow the machine."""

    def __init__(self, answer: Callable[[Any], Any]) -> None:
        self._answer = answer
        self._went_on: set[str] = set()
        self._all = False
        self._changed = threading.Condition()

    def __call__(self, request: Any) -> Any:
        with self._changed:
            # Bounded only so that a test that failed before releasing it does not hold grpc's thread for good.
            self._changed.wait_for(lambda: self._all or request.container_meta.name in self._went_on, timeout=TIMEOUT)
        return self._answer(request)

    def went_on(self, container: str) -> None:
        with self._changed:
            self._went_on.add(container)
            self._changed.notify_all()

    def release_all(self) -> None:
        with self._changed:
            self._all = True
            self._changed.notify_all()


def test_creates_a_server_answers_only_after_containerds_deadline_wait_for_the_first_and_its_trial_and_skip_it_otherwise(
    plugin: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    """The issue's node: the first create waits for containerd's deadline and silences the server; the first
    create after the pause is its trial and waits too; every other create skips it at once. Each late answer's
    cpu shares reach its container; its environment cannot, and says so. Counted by koordrp's call lines.

    Creates follow one another as each answers, until the one after the pause (koordrp's 5 s) is the trial, then
    two more (the pause has doubled): how many came before the trial is the machine's pace, and not counted."""
    slow = hook_server(servers, workdir, "slow")
    late = AfterContainerdWentOn(
        lambda request: hook.ContainerResourceHookResponse(
            container_resources=hook.LinuxContainerResources(cpu_shares=512), container_envs={"SLOW": "1"}
        )
    )
    slow.behaviours[CREATE] = late
    # Subscribed to a post hook too, as koordlet is: its post hooks still reach it, and do not bring it back. Its
    # timeout is long enough that koordrp still waits for an answer the test releases, however slow the machine.
    register(hooks_dir, "slow", slow.path, ["PreCreateContainer", "PostStartContainer"], "Ignore", **{"timeout-seconds": 30})
    wait_registered(plugin, 1)
    pod = pod_sandbox_config("late", log_directory=workdir / "late")
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
    ids: list[str] = []
    lines: list[str] = []

    def create() -> str:
        """The next container's create line, written once its hooks are done with it; the container started."""
        name = f"c{len(ids)}"
        config = container_config(name, image=BUSYBOX_REF, command=["sleep", "3600"])
        request = api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox_id, config=config, sandbox_config=pod)
        ids.append(runtime.CreateContainer(request, timeout=TIMEOUT).container_id)
        late.went_on(name)
        lines.append(call_line(plugin, f"CreateContainer pod default/late ({pod.metadata.uid}) container {name}:"))
        runtime.StartContainer(api_pb2.StartContainerRequest(container_id=ids[-1]), timeout=TIMEOUT)
        return lines[-1]

    try:
        create()
        while "(trial; " not in create():
            assert len(ids) < 100, lines  # a bound on the loop: the pause is over long before
        trial = len(ids) - 1
        create()
        create()
        assert "PreCreateContainer@slow.json: late" in lines[0] and "trial" not in lines[0], lines[0]
        assert "PreCreateContainer@slow.json: late" in lines[trial], lines[trial]  # the trial waited too
        assert all("PreCreateContainer@slow.json: not-answering" in line for line in lines[1:trial]), lines
        # After the trial the pause doubled: another trial only once it is over (a machine stalled for 10 s), never
        # a call that waits as usual.
        for line in lines[trial + 1 :]:
            assert "PreCreateContainer@slow.json: not-answering" in line or (
                "PreCreateContainer@slow.json: late" in line and "(trial; " in line
            ), line
        waited = [index for index, line in enumerate(lines) if "PreCreateContainer@slow.json: late" in line]
        assert [request.container_meta.name for request in slow.calls(CREATE)] == [f"c{index}" for index in waited]
        starts = [call_line(plugin, f"StartContainer pod default/late ({pod.metadata.uid}) container c{index}:") for index in range(len(ids))]
        assert all("PostStartContainer@slow.json: sent" in line for line in starts), starts
        slow.rpcs_once(len(waited) + len(ids), timeout=30)  # post hooks arrive after containerd's answer
        assert sorted(request.container_meta.name for request in slow.calls("PostStartContainerHook")) == sorted(f"c{index}" for index in range(len(ids)))
        assert not plugin.log_lines("calls reach it again", timeout=0)
        for index in waited:
            assert "→512, left alone (late) envs +SLOW" in lines[index] and "changed resources.cpu_shares " in lines[index], lines[index]
            spec = runtime_spec(runtime, ids[index])
            assert spec["linux"]["resources"]["cpu"]["shares"] == 512 and "SLOW=1" not in spec["process"]["env"]
    finally:
        late.release_all()
        remove_pod(runtime, sandbox_id)


def env_of_new_container(runtime: Any, workdir: Path, name: str) -> list[str]:
    with running_container(runtime, name, workdir) as pod:
        env: list[str] = runtime_spec(runtime, pod.container_id)["process"]["env"]
        return env


def test_post_hooks_once_each_after_what_they_tell_of(
    plugin: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    watcher = hook_server(servers, workdir, "watcher")
    register(hooks_dir, "watcher", watcher.path, ["PostStartContainer", "PostStopContainer", "PostStopPodSandbox"])
    wait_registered(plugin, 1)
    pod = pod_sandbox_config("posts", log_directory=workdir / "posts")
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
    try:
        first = start_container(runtime, sandbox_id, pod, container_config("first", image=BUSYBOX_REF, command=["sleep", "3600"]))
        second = start_container(runtime, sandbox_id, pod, container_config("second", image=BUSYBOX_REF, command=["sleep", "3600"]))
        for _ in range(2):  # kubelet stops again what is stopped
            runtime.StopContainer(api_pb2.StopContainerRequest(container_id=first, timeout=0), timeout=TIMEOUT)
        runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=TIMEOUT)
        calls = watcher.rpcs_once(5, timeout=10)
        assert calls == ["PostStartContainerHook", "PostStartContainerHook", "PostStopContainerHook", "PostStopContainerHook", "PostStopPodSandboxHook"]
        stopped = [request.container_meta.id for request in watcher.calls("PostStopContainerHook")]
        assert stopped == [first, second]
    finally:
        remove_pod(runtime, sandbox_id)
    assert watcher.rpcs_once(6, timeout=0.5) == calls  # and nothing more


def test_after_containerd_restarts_koordrp_is_its_plugin_again_and_knows_its_pods(
    nri_containerd: Containerd, plugin: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "memory")
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_envs={"TUNED": "1"})
    register(hooks_dir, "memory", server.path, ["PreCreateContainer", "PostStopContainer"])
    wait_registered(plugin, 1)
    with running_container(runtime, "survivor", workdir, container_options={"env": {"A": "1"}}) as pod:
        nri_containerd.restart()
        plugin.log_lines("store rebuilt from containerd's NRI", count=2, timeout=20)
        assert "the connection was lost" in plugin.log()
        runtime = nri_containerd.runtime()
        runtime.StopContainer(api_pb2.StopContainerRequest(container_id=pod.container_id, timeout=0), timeout=TIMEOUT)
        [stopped] = server.rpcs_once(2, timeout=5)[1:]
        assert stopped == "PostStopContainerHook"
        # The container as containerd was to make it (NRI shows the image's environment too), not as the hooks did.
        seen = server.calls("PostStopContainerHook")[0].container_envs
        assert seen["A"] == "1" and "TUNED" not in seen
        assert "TUNED=1" in env_of_new_container(runtime, workdir, "newcomer")


def test_after_koordrp_restarts_hooks_get_the_same_information(
    nri_containerd: Containerd, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "memory")
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(
        container_envs={"KOORDRP_TEST": "1"}, container_resources=hook.LinuxContainerResources(cpu_shares=700)
    )
    register(hooks_dir, "memory", server.path, ["PreCreateContainer", "PreStartContainer", "PostStopContainer"])
    nri_socket = nri_containerd.paths.nri_socket
    first = KoordrpProcess(workdir, nri_containerd.endpoint, nri_socket=nri_socket)
    first.start()
    try:
        with running_container(runtime, "restart", workdir, container_options={"env": {"B": "2", "A": "1"}}) as pod:
            before = server.calls("PreStartContainerHook")[-1]
            assert first.terminate() == 0
            second = KoordrpProcess(workdir, nri_containerd.endpoint, nri_socket=nri_socket)
            second.start()
            try:
                runtime.StopContainer(api_pb2.StopContainerRequest(container_id=pod.container_id, timeout=0), timeout=TIMEOUT)
                server.rpcs_once(3, timeout=5)
            finally:
                second.stop()
    finally:
        first.stop()
    after = server.calls("PostStopContainerHook")[-1]
    assert after == before
    # What kubelet asked came back from the state directory: containerd has the hooks' changes.
    assert (after.container_envs["B"], after.container_envs["A"]) == ("2", "1") and "KOORDRP_TEST" not in after.container_envs
    assert after.container_resources.cpu_shares == 0  # not the hooks' 700


def test_koordrp_started_before_containerd_registers_once_it_is_up(
    nri_release: str, images: ImageSet, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    containerd = Containerd(workdir / "containerd", release=nri_release, nri=True)
    koordrp = KoordrpProcess(workdir, containerd.endpoint, nri_socket=containerd.paths.nri_socket)
    server = hook_server(servers, workdir, "early")
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_envs={"EARLY": "1"})
    register(hooks_dir, "early", server.path, ["PreCreateContainer"])
    try:
        koordrp.start(ready="pods run without koordrp's hooks until it is;")  # no containerd: it keeps trying
        [warning] = koordrp.log_lines("pods run without koordrp's hooks until it is;")
        assert "cannot connect" in warning
        started = start_containerd(images, containerd.paths.base, release=nri_release, nri=True)
        try:
            koordrp.log_lines("store rebuilt from containerd's NRI", timeout=10)
            assert "EARLY=1" in env_of_new_container(started.runtime(), workdir, "early")
            # One line for all the tries while containerd was not there, and one when they are over.
            assert len(koordrp.log_lines("pods run without koordrp's hooks until it is;")) == 1
            assert koordrp.log_lines("koordrp is a plugin of containerd's NRI again, after")
        finally:
            started.stop()
    finally:
        koordrp.stop()


def test_a_fail_policy_server_fails_the_call_kubelet_made_to_containerd(
    plugin: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    broken = hook_server(servers, workdir, "broken")
    broken.failures[CREATE] = grpc.StatusCode.INTERNAL
    register(hooks_dir, "broken", broken.path, ["PreCreateContainer"], policy="Fail")
    wait_registered(plugin, 1)
    with pytest.raises(grpc.RpcError) as error:
        with running_container(runtime, "refused", workdir):
            pass
    details = error.value.details() or ""
    assert "koordrp: hook server broken.json" in details and "PreCreateContainer" in details, details
    assert ": UNKNOWN in " in call_line(plugin, "CreateContainer pod default/refused")


def test_koordrp_check_knows_nri_mode_and_that_two_modes_are_one_too_many(
    nri_release: str, nri_containerd: Containerd, plugin: KoordrpProcess, workdir: Path
) -> None:
    node = FakeNode(workdir / "node", str(plugin.socket))
    node.run_kubelet(["kubelet", f"--container-runtime-endpoint=unix://{nri_containerd.paths.socket}"])
    node.shows(plugin.pid)
    nri = [f"--nri-socket={nri_containerd.paths.nri_socket}", f"--state-dir={workdir / 'state'}"]
    code, output = run_check(node, "--backend-runtime-mode=NRI", *nri)
    assert code == 0, output
    assert f"sends runtime calls to unix://{nri_containerd.paths.socket} (its flag --container-runtime-endpoint), which calls koordrp through NRI" in output
    assert f"✓ containerd's NRI socket is at {nri_containerd.paths.nri_socket}" in output
    assert f"✓ koordrp (pid {plugin.pid}) is plugin 10-koordrp of containerd {nri_release}." in output
    proxy = KoordrpProcess(workdir / "proxy", nri_containerd.endpoint)
    (workdir / "proxy").mkdir()
    proxy.start()
    try:
        code, output = run_check(node, "--backend-runtime-mode=NRI", f"--socket={proxy.socket}", *nri)
        assert code == 1 and f"✗ a koordrp proxy listens at unix://{proxy.socket} too: with both modes every hook runs twice" in output
        code, output = run_check(node, f"--socket={proxy.socket}", *nri)
        assert code == 1 and f"✗ koordrp (pid {plugin.pid}) is also plugin 10-koordrp of containerd's NRI" in output
    finally:
        proxy.stop()
    plugin.stop()
    code, output = run_check(node, "--backend-runtime-mode=NRI", *nri)
    assert code == 1 and "✗ koordrp is not registered with containerd's NRI" in output


@contextlib.contextmanager
def crowded(runtime: Any, workdir: Path) -> Iterator[None]:
    """A node whose pods do not fit one 4 MiB ttrpc message: 24 pods with a 200 KB annotation each (pods carry
    large annotations in real clusters), made before koordrp starts; removed on exit."""
    made: list[str] = []
    try:
        for index in range(24):
            name = f"crowd-{index}"
            config = pod_sandbox_config(name, annotations={"koordrp.test/large": "x" * 200_000}, log_directory=workdir / name)
            made.append(runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=config), timeout=TIMEOUT).pod_sandbox_id)
        yield
    finally:
        for sandbox_id in made:
            remove_pod(runtime, sandbox_id)


def observed_plugin(containerd: Containerd, workdir: Path, *extra: str) -> tuple[KoordrpProcess, str]:
    """koordrp in NRI mode with /metrics and /healthz (not started yet), and their base URL."""
    port = free_port()
    args = [f"--metrics-endpoint=tcp:{port}:interface=127.0.0.1", *extra]
    return KoordrpProcess(workdir, containerd.endpoint, args, nri_socket=containerd.paths.nri_socket), f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("nri_release", ["2.1"], indirect=True)
def test_a_node_beyond_one_message_is_synchronized_in_parts_and_gets_its_hooks(
    nri_containerd: Containerd, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "tuner")
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_envs={"CROWDED": "1"})
    # Within containerd's 2 s: nothing to warn of but what a node's size would bring.
    register(hooks_dir, "tuner", server.path, ["PreCreateContainer"], "Ignore", **{"timeout-seconds": 1})
    with crowded(runtime, workdir):
        koordrp, base = observed_plugin(nri_containerd, workdir)
        koordrp.start()  # registered: containerd synchronized it, in parts
        try:
            [rebuilt] = koordrp.log_lines("store rebuilt from containerd's NRI")
            assert int(rebuilt.split(": ", 1)[1].split(" pods")[0]) >= 24, rebuilt
            assert get(f"{base}/healthz")[0] == 200
            assert "CROWDED=1" in env_of_new_container(runtime, workdir, "newcomer")
            assert koordrp.warnings() == []
        finally:
            koordrp.stop()


@pytest.mark.parametrize("nri_release", ["1.7"], indirect=True)
def test_on_nri_0_6_a_node_beyond_one_message_is_one_error_line_and_tries_that_back_off(
    nri_containerd: Containerd, runtime: Any, workdir: Path
) -> None:
    """containerd 1.7.24 (NRI 0.6.1) sends its synchronization whole, ~4.8 MB here: nobody can register."""
    with crowded(runtime, workdir):
        koordrp, base = observed_plugin(nri_containerd, workdir)
        koordrp.start(ready="] koordrp is not a plugin of containerd's NRI")
        try:
            while sample(get(f"{base}/metrics")[1], "koordrp_failed_attempts_total", activity="nri-registration") < 4:
                assert koordrp.process is not None and koordrp.process.poll() is None, koordrp.log()
                time.sleep(0.2)  # its back-off: 1, 2, 4 s between the four attempts
            [error] = koordrp.warnings()
            for words in ("#error]", "4 MiB", "NRI 0.6 cannot split", "containerd 1.7.26 or later", "--backend-runtime-mode=Containerd"):
                assert words in error, error
            status, reason = get(f"{base}/healthz")
            assert status == 503 and "NRI 0.6 cannot split" in reason
        finally:
            koordrp.stop()
    # As a ttrpc server answers a message beyond its limit, so containerd's log says why too.
    assert "failed to synchronize plugin: rpc error: code = ResourceExhausted" in nri_containerd.log_tail(2000)


def test_two_nri_plugins_setting_one_field_fail_the_create_and_koordrp_says_what_it_can(
    nri_containerd: Containerd, plugin: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    """NRI gives each field of a container to the first plugin that sets it: a second one fails the create."""
    mine = hook_server(servers, workdir, "mine")
    mine.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_resources=hook.LinuxContainerResources(cpu_shares=300))
    register(hooks_dir, "mine", mine.path, ["PreCreateContainer"])
    (workdir / "other").mkdir()
    theirs = FakeHookServer(str(workdir / "other" / "theirs.sock")).start()
    servers["theirs"] = theirs
    theirs.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_resources=hook.LinuxContainerResources(cpu_shares=400))
    register(workdir / "other" / "hookserver.d", "theirs", theirs.path, ["PreCreateContainer"])
    other = KoordrpProcess(
        workdir / "other", nri_containerd.endpoint, ["--nri-plugin-index=20", "--nri-plugin-name=other"], nri_socket=nri_containerd.paths.nri_socket
    )
    other.start()
    try:
        wait_registered(plugin, 1)
        wait_registered(other, 1)
        with pytest.raises(grpc.RpcError) as error:
            with running_container(runtime, "conflicted", workdir):
                pass
        assert 'plugins "20-other" and "10-koordrp" both tried to set CPU shares' in (error.value.details() or "")
        # The later plugin is shown the earlier one's answer; neither answer is applied.
        assert [request.container_resources.cpu_shares for request in theirs.calls(CREATE)] == [300]
        create = call_line(plugin, "CreateContainer pod default/conflicted")
        assert "NOT-CONFIRMED (containerd undid the create after koordrp answered" in create, create
        assert "left alone (containerd did not do the call) resources.cpu_shares 0→300" in create, create
        [warning] = plugin.log_lines("containerd undid a create that koordrp's hooks changed")
        assert "pod default/conflicted container conflicted" in warning and "both tried to set" in warning
    finally:
        other.stop()


def test_sigterm_with_a_wedged_post_hook_server_ends_at_the_bound_and_hooks_run_until_then(
    plugin: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    wedged = hook_server(servers, workdir, "wedged")
    wedged.delays["PostStopContainerHook"] = 300
    wedged.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_envs={"STOPPING": "1"})
    register(hooks_dir, "wedged", wedged.path, ["PreCreateContainer", "PostStopContainer"])  # 60 s, --hook-timeout's
    wait_registered(plugin, 1)
    assert plugin.process is not None
    with running_container(runtime, "first", workdir) as pod:
        runtime.StopContainer(api_pb2.StopContainerRequest(container_id=pod.container_id, timeout=0), timeout=TIMEOUT)
        assert wedged.rpcs_once(2, timeout=10)[-1] == "PostStopContainerHook"
        plugin.process.send_signal(signal.SIGTERM)
        plugin.log_lines("stopping: post hooks are still running", timeout=10)
        # Until the drain ends koordrp stays containerd's plugin: a container made meanwhile gets its hooks.
        assert "STOPPING=1" in env_of_new_container(runtime, workdir, "meanwhile")
        assert plugin.process.wait(25) == 0
    cut = plugin.log_lines("cut at the stop's bound")
    assert any("post hook PostStopContainer on wedged.json for pod default/first container first cut" in line for line in cut), cut
