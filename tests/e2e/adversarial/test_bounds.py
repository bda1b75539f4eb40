"""Bounds an adversarial pass probed, against a real containerd: registrations that come and go leave no
descriptors behind, a wedged post hook server holds up no other server's post hooks, and SIGTERM with a wedged
post hook server ends within ``--grace-period`` plus a second (proxy and NRI mode).

Nothing here sleeps a fixed time or measures one: each test waits for an event (a generous bound only fails
a koordrp that never gets there), and the stop's figures are koordrp's own log's
(``benchmarks/stop_bound.py`` times the stop from outside).
"""

import os
import re
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import grpc
import pytest
from cri_api.v1 import api_pb2

from tests.e2e.conftest import Runtimes, hook_server, wait_registered
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import NRI_RELEASES
from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF
from tests.support.koordrp_process import KoordrpProcess, rss_bytes
from tests.support.pods import TIMEOUT, remove_pod, running_container, start_container
from tests.support.waiting import eventually

POST_STOP = "PostStopContainerHook"
POST_STOP_POD = "PostStopPodSandboxHook"
PRE_RUN = "PreRunPodSandboxHook"
ROUNDS = 3
REGISTRATIONS = 200
SPARE_DESCRIPTORS = 5


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class ManySockets(FakeHookServer):
    """One hook server behind many sockets: ``path`` and ``more``."""

    more: tuple[str, ...] = ()

    def _serve(self, register: Callable[[grpc.Server], None], handlers: list[grpc.GenericRpcHandler] | None = None) -> None:  # type: ignore[type-arg]
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=handlers)
        register(server)
        for path in (self.path, *self.more):
            server.add_insecure_port(f"unix:{path}")
        server.start()
        self._server = server


def test_registrations_written_called_and_removed_leave_koordrps_descriptors_as_they_were(
    koordrp: KoordrpProcess, runtime: Any, workdir: Path, hooks_dir: Path
) -> None:
    """Each round: 200 registrations, each called (PreRunPodSandbox), then removed while the pod's stop is on its
    way to them: each server's PostStopContainer is held until koordrp has let the registrations go, so its
    PostStopPodSandbox, which the same call owes it next, is made after. That call's channel is closed once it
    ends: koordrp's descriptors come back to where they were before the first round, the servers still there."""
    start, start_rss = open_fds(koordrp.pid), rss_bytes(koordrp.pid)
    figures: list[str] = []
    for round_ in range(ROUNDS):
        sockets = workdir / f"round-{round_}"
        sockets.mkdir()
        paths = [str(sockets / f"{index}.sock") for index in range(REGISTRATIONS)]
        server = ManySockets(paths[0], more=tuple(paths[1:]))
        server.delays[POST_STOP] = 300
        server.start()
        try:
            names = [f"churn-{round_}-{index:03}" for index in range(REGISTRATIONS)]
            for name, path in zip(names, paths):
                register(hooks_dir, name, path, ["PreRunPodSandbox", "PostStopContainer", "PostStopPodSandbox"])
            wait_registered(koordrp, REGISTRATIONS)
            registered = open_fds(koordrp.pid)
            with running_container(runtime, f"churn-{round_}", workdir) as pod:
                assert len(server.calls(PRE_RUN)) == REGISTRATIONS  # each registration called
                runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox_id), timeout=TIMEOUT)
                # Every server's sequence has begun (koordrp starts them at once): its container's stop is held.
                eventually(lambda: server.calls(POST_STOP), "a PostStopContainer held by the servers")
                for name in names:
                    (hooks_dir / f"{name}.json").unlink()
                wait_registered(koordrp, 0)
                server.unwedge()
                eventually(lambda: len(server.calls(POST_STOP_POD)) == REGISTRATIONS, "every server told of the pod's stop")
            # Counted while the server still listens: a channel left open to a server that is gone holds no
            # descriptor, only its attempts to connect again.
            eventually(lambda: open_fds(koordrp.pid) <= start + SPARE_DESCRIPTORS, f"koordrp's descriptors back to {start}")
            figures.append(f"round {round_ + 1}: {registered} registered, {open_fds(koordrp.pid)} after")
        finally:
            server.stop()
    assert open_fds(koordrp.pid) <= start + SPARE_DESCRIPTORS, (start, figures)
    print(f"descriptors {start} at the start; {'; '.join(figures)}; RSS {start_rss >> 20} → {rss_bytes(koordrp.pid) >> 20} MiB")


def test_a_wedged_post_stop_container_server_holds_up_no_other_servers(
    koordrp: KoordrpProcess, runtime: Any, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    """The wedged server is first in the stage (registrations go by name) and never answers until the test lets it:
    the other server is told of the stop while the wedged one still holds its call."""
    wedged, other = hook_server(servers, workdir, "wedged"), hook_server(servers, workdir, "other")
    wedged.delays[POST_STOP] = 300
    hour: dict[str, Any] = {"timeout-seconds": 3600}
    register(hooks_dir, "a-wedged", wedged.path, ["PostStopContainer"], **hour)
    register(hooks_dir, "b-other", other.path, ["PostStopContainer"])
    wait_registered(koordrp, 2)
    with running_container(runtime, "held", workdir) as pod:
        runtime.StopContainer(api_pb2.StopContainerRequest(container_id=pod.container_id, timeout=0), timeout=TIMEOUT)
        eventually(lambda: wedged.rpcs() == [POST_STOP], "the wedged server holding the container's stop")
        eventually(lambda: other.rpcs() == [POST_STOP], "the other server told of the stop")
        # Told while the wedged server still held its call: it has not answered (the test has not let it), and
        # koordrp has not given up on it (an hour).
        assert wedged.delays == {POST_STOP: 300}
        assert not [line for line in koordrp.warnings() if "a-wedged.json" in line], koordrp.warnings()
        wedged.unwedge()
    [line] = koordrp.log_lines("StopContainer pod default/held")
    assert "PostStopContainer@a-wedged.json: sent" in line and "PostStopContainer@b-other.json: sent" in line, line


GRACE = 3.0


@pytest.mark.parametrize("mode", ["proxy", *(f"nri-{release}" for release in NRI_RELEASES)])
def test_sigterm_with_a_wedged_post_hook_server_cuts_it_at_the_grace_period_and_ends(
    mode: str, runtimes: Runtimes, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    """The wedged server holds the container's PostStopContainer; SIGTERM. koordrp's log says the drain's bound
    (within the grace period), the call it cut there, then that it stopped; and it exits 0."""
    nri = mode.startswith("nri-")
    containerd = runtimes.get(mode.removeprefix("nri-") if nri else "1.6")
    wedged = hook_server(servers, workdir, "wedged")
    wedged.delays[POST_STOP] = 300
    hour: dict[str, Any] = {"timeout-seconds": 3600}
    register(hooks_dir, "wedged", wedged.path, ["PostStopContainer"], **hour)
    koordrp = KoordrpProcess(
        workdir, containerd.endpoint, [f"--grace-period={GRACE:g}"], nri_socket=containerd.paths.nri_socket if nri else None
    )
    koordrp.start()
    try:
        wait_registered(koordrp, 1)
        with koordrp.channel() as channel:
            # Made and stopped through the front end (NRI mode: containerd, whose plugin koordrp is); removed on
            # containerd itself, once koordrp is gone.
            runtime = containerd.runtime() if nri else koordrp.runtime(channel)
            pod = pod_sandbox_config("bounded", log_directory=workdir / "bounded")
            sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
            try:
                config = container_config("bounded", command=["sleep", "3600"], log_path="bounded.log", image=BUSYBOX_REF)
                container_id = start_container(runtime, sandbox_id, pod, config)
                runtime.StopContainer(api_pb2.StopContainerRequest(container_id=container_id, timeout=0), timeout=TIMEOUT)
                eventually(lambda: wedged.rpcs() == [POST_STOP], "the wedged server holding the container's stop")
                assert koordrp.terminate(timeout=GRACE + 60) == 0  # a generous bound: the figure is koordrp's own
            finally:
                remove_pod(containerd.runtime(), sandbox_id)
    finally:
        koordrp.stop()
    [waits] = koordrp.log_lines("stopping: post hooks are still running for 1 call(s)")
    given = float(re.search(r"they get ([0-9.]+)s, then are cut", waits).group(1))  # type: ignore[union-attr]
    assert 0 < given <= GRACE, waits
    [cut] = koordrp.log_lines("cut at the stop's bound")
    assert "post hook PostStopContainer on wedged.json for pod default/bounded container bounded cut" in cut, cut
    # How long that took is benchmarks/stop_bound.py's to measure: here, that the stop ended once the cut was made.
    assert koordrp.log_lines("s after SIGTERM")
    assert koordrp.log().index("cut at the stop's bound") < koordrp.log().index("s after SIGTERM")
