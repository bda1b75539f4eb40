"""Files an adversarial pass put in koordrp's way, against a real containerd: a hook socket in a directory anyone
may write (an unprivileged user binds its name first, and would be told every pod's environment) is not called,
while a proper one beside it is; a FIFO where a state file should be holds nothing up (proxy and NRI mode).

Nothing here sleeps a fixed time or measures one: each test waits for an event (a generous bound only fails a
koordrp that never gets there).
"""

import os
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from cri_api.v1 import api_pb2

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from tests.e2e.conftest import Runtimes, hook_server, wait_registered
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import NRI_RELEASES, Containerd
from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import TIMEOUT, remove_pod, running_container, start_container
from tests.support.scrape import free_port, get
from tests.support.waiting import eventually

CREATE = "PreCreateContainerHook"
RUN = "PreRunPodSandboxHook"
NOBODY = 65534
SECRET = ("PASSWORD", "hunter2")


def squatted(workdir: Path, servers: dict[str, FakeHookServer]) -> FakeHookServer:
    """A hook server on a socket in a 1777 directory, bound by nobody (as the squatter it stands for)."""
    sticky = workdir / "tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    server = FakeHookServer(str(sticky / "hook.sock")).start()
    servers["squatter"] = server
    os.chown(server.path, NOBODY, -1)
    return server


def not_trusted_warnings(koordrp: KoordrpProcess, name: str) -> list[str]:
    return [line for line in koordrp.warnings() if f"hook server registration {koordrp.base / 'hookserver.d' / name}" in line]


def test_a_socket_in_a_directory_anyone_may_write_is_not_called_and_a_proper_one_beside_it_is(
    koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    squatter = squatted(workdir, servers)
    register(hooks_dir, "squatted", squatter.path, ["PreRunPodSandbox", "PreCreateContainer"])
    proper = hook_server(servers, workdir, "proper")
    proper.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_envs={"PROPER": "1"})
    register(hooks_dir, "proper", proper.path, ["PreRunPodSandbox", "PreCreateContainer"])
    wait_registered(koordrp, 2)
    key, value = SECRET
    with running_container(runtime, "secrets", workdir, container_options={"env": {key: value}}) as pod:
        request = api_pb2.ExecSyncRequest(container_id=pod.container_id, cmd=["env"], timeout=10)
        env = runtime.ExecSync(request, timeout=TIMEOUT).stdout.decode().split()
        assert {"PROPER=1", f"{key}={value}"} <= set(env), env
    assert squatter.rpcs() == []
    assert proper.rpcs() == [RUN, CREATE]
    assert proper.calls(CREATE)[0].container_envs[key] == value
    sticky = workdir / "tmp"
    [warning] = not_trusted_warnings(koordrp, "squatted.json")
    assert (
        f"is not called: socket {squatter.path} is not trusted: directory {sticky} is group- or world-writable "
        "(mode 1777): anyone could bind its name there before the hook server does" in warning
    ), warning
    assert not_trusted_warnings(koordrp, "proper.json") == []
    [create] = koordrp.log_lines("[koordrp.calls#info] CreateContainer pod default/secrets")
    assert "PreCreateContainer@squatted.json: error" in create and "is not trusted" in create, create
    assert "PreCreateContainer@proper.json: ok" in create, create


def test_a_fail_policy_server_whose_socket_is_not_trusted_fails_the_call_it_is_not_sent(
    koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    squatter = squatted(workdir, servers)
    register(hooks_dir, "squatted", squatter.path, ["PreRunPodSandbox"], policy="Fail")
    wait_registered(koordrp, 1)
    with pytest.raises(grpc.RpcError) as refused:
        with running_container(runtime, "refused", workdir):
            pass
    assert refused.value.code() is grpc.StatusCode.UNKNOWN
    assert f"hook server squatted.json ({squatter.path}) failed PreRunPodSandbox: socket {squatter.path} is not trusted" in (
        refused.value.details() or ""
    )
    assert squatter.rpcs() == []
    assert len(not_trusted_warnings(koordrp, "squatted.json")) == 1


# ---------------------------------------------------------------------------------------------
# A FIFO where a state file should be


class Observed:
    """koordrp as a real process with its /livez, proxy or NRI mode."""

    def __init__(self, workdir: Path, containerd: Containerd, nri: bool) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.process = KoordrpProcess(
            workdir,
            containerd.endpoint,
            [f"--metrics-endpoint=tcp:{port}:interface=127.0.0.1"],
            nri_socket=containerd.paths.nri_socket if nri else None,
        )
        self.rebuilt = "store rebuilt from containerd's NRI" if nri else "store rebuilt from the runtime"

    def start(self) -> None:
        """Start it, until its store has read what the state directory keeps (the line that says it is rebuilt)."""
        earlier = self.process.log().count(self.rebuilt)
        self.process.start()
        eventually(lambda: self.process.log().count(self.rebuilt) > earlier, f"{self.rebuilt!r}", 120.0)


@pytest.fixture(params=["containerd-1.6", *(f"nri-{release}" for release in NRI_RELEASES)])
def observed(request: pytest.FixtureRequest, runtimes: Runtimes, workdir: Path) -> Iterator[tuple[Observed, Containerd]]:
    nri = request.param.startswith("nri-")
    containerd = runtimes.get(request.param.split("-", 1)[1])
    started = Observed(workdir, containerd, nri)
    started.start()
    yield started, containerd
    started.process.stop()


def test_a_fifo_kept_as_a_state_file_is_one_warning_and_holds_up_neither_livez_nor_calls(
    observed: tuple[Observed, Containerd], workdir: Path
) -> None:
    koordrp, containerd = observed
    try:
        calls_go_on_past_a_fifo(koordrp, containerd, workdir)
    finally:
        remove_leftovers(containerd)


def calls_go_on_past_a_fifo(koordrp: Observed, containerd: Containerd, workdir: Path) -> None:
    nri = koordrp.process.nri_socket is not None

    def kubelets() -> Any:
        """Where kubelet's calls go: koordrp's socket (a channel of its own), or in NRI mode containerd's."""
        if nri:
            return containerd.runtime()
        channel = koordrp.process.channel()
        channels.append(channel)
        return koordrp.process.runtime(channel)

    channels: list[grpc.Channel] = []
    try:
        runtime = kubelets()
        pod = pod_sandbox_config("fifo", log_directory=workdir / "fifo")
        sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
        start_container(runtime, sandbox_id, pod, container_config("app", image=BUSYBOX_REF, command=["sleep", "3600"]))
        kept = workdir / "state" / "pods" / sandbox_id
        eventually(kept.exists, f"{kept} written")
        assert koordrp.process.terminate() == 0
        kept.unlink()
        os.mkfifo(kept)  # nobody ever writes it: opening it to read would wait for ever
        koordrp.start()
        assert get(f"{koordrp.base}/livez")[0] == 200
        [warning] = koordrp.process.log_lines("cannot read what kubelet asked")
        assert f"for pod {sandbox_id}, kept in {kept}: is a FIFO, not a regular file" in warning, warning
        # Lifecycle calls about that very pod go on: a container created, started, stopped and removed in it, then
        # the pod's stop and removal, and a new pod after it.
        runtime = kubelets()
        more = start_container(runtime, sandbox_id, pod, container_config("more", image=BUSYBOX_REF, command=["sleep", "3600"]))
        runtime.StopContainer(api_pb2.StopContainerRequest(container_id=more, timeout=0), timeout=TIMEOUT)
        runtime.RemoveContainer(api_pb2.RemoveContainerRequest(container_id=more), timeout=TIMEOUT)
        remove_pod(runtime, sandbox_id)
        with running_container(runtime, "after-fifo", workdir):
            pass
        assert get(f"{koordrp.base}/livez")[0] == 200
        assert len(koordrp.process.log_lines("cannot read what kubelet asked")) == 1
    finally:
        for channel in channels:
            channel.close()


def remove_leftovers(containerd: Containerd) -> None:
    direct = containerd.runtime()
    for pod in direct.ListPodSandbox(api_pb2.ListPodSandboxRequest()).items:
        if pod.metadata.name in ("fifo", "after-fifo"):
            remove_pod(direct, pod.id)
