"""A full or read-only --state-dir costs warnings, never a call, and never leaves a state file cut short.

koordrp runs in proxy mode in front of the session's containerd 1.6, its --state-dir a small tmpfs
mounted for the test (root is needed, as for containerd; CI runs as root).
"""

import os
import re
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
from cri_api.v1 import api_pb2

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from tests.e2e.conftest import hook_server, require, wait_registered
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import Containerd
from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.daemons import DaemonError
from tests.support.hook_registration import register
from tests.support.images import BUSYBOX_REF
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import TIMEOUT, remove_pod, running_container, start_container
from tests.support.scrape import free_port, get, sample

CREATE = "PreCreateContainerHook"
# ~21 KiB of environment: its state file cannot fit in the two pages left free below.
MANY_ENVS = {f"VAR_{index:03d}": "v" * 100 for index in range(200)}
PAGE = 4096


class CannotMount(DaemonError):
    pass


def mount(point: Path, *options: str) -> None:
    """A tmpfs at ``point`` (0700, root's: koordrp refuses a directory others may write)."""
    point.mkdir(exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join(["size=256k", "mode=0700", *options]), "tmpfs", str(point)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise CannotMount(f"cannot mount a tmpfs on {point}: {done.stderr.strip()}")


def unmount(point: Path) -> None:
    if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(point)], check=True)


@pytest.fixture
def state(workdir: Path, containerd: Containerd) -> Iterator[Path]:
    """Where koordrp keeps its state (KoordrpProcess's ``base/state``); a tmpfs is mounted there by the test."""
    point = workdir / "state"
    yield point
    if os.path.ismount(point):
        unmount(point)


def mounted(point: Path, *options: str) -> None:
    def check() -> None:
        mount(point, *options)

    require(check, "state directory")  # in CI a tmpfs that cannot be mounted is a failure, not a skip


@pytest.fixture
def tuner(servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path) -> FakeHookServer:
    """A hook server whose PreCreateContainer answer changes the container's environment: a state file is kept."""
    server = hook_server(servers, workdir, "tuner")
    server.behaviours[CREATE] = lambda request: hook.ContainerResourceHookResponse(container_envs={"KOORDRP_TEST": "1"})
    register(hooks_dir, "tuner", server.path, ["PreCreateContainer"])
    return server


@pytest.fixture
def metrics_port() -> int:
    return free_port()


@pytest.fixture
def koordrp(workdir: Path, containerd: Containerd, state: Path, metrics_port: int) -> Iterator[KoordrpProcess]:
    """Not started: the test mounts its state directory first."""
    process = KoordrpProcess(workdir, containerd.endpoint, [f"--metrics-endpoint=tcp:{metrics_port}:interface=127.0.0.1"])
    yield process
    process.stop()


def started(koordrp: KoordrpProcess) -> Any:
    koordrp.start()
    wait_registered(koordrp, 1)
    return koordrp.runtime(koordrp.channel())


def container_env(runtime: Any, container_id: str) -> list[str]:
    result = runtime.ExecSync(api_pb2.ExecSyncRequest(container_id=container_id, cmd=["env"], timeout=10), timeout=TIMEOUT)
    env: list[str] = result.stdout.decode().split()
    return env


def write_failures(metrics_port: int) -> float:
    status, text = get(f"http://127.0.0.1:{metrics_port}/metrics")
    assert status == 200, text
    return sample(text, "koordrp_state_file_write_failures_total")


def fill(directory: Path, leave: int) -> None:
    """Fill the filesystem of ``directory`` with files of a page each, then free ``leave`` of them."""
    directory.mkdir()
    index = 0
    while True:
        path = directory / str(index)
        try:
            with open(path, "wb", buffering=0) as filler:
                filler.write(b"f" * PAGE)
        except OSError:  # ENOSPC: the page did not fit
            path.unlink()
            break
        index += 1
    assert index > leave
    for freed in range(leave):
        (directory / str(freed)).unlink()


def temporaries(state: Path) -> list[str]:
    return [name for _, _, names in os.walk(state) for name in names if name.endswith(".new")]


def cannot_write(koordrp: KoordrpProcess, state: Path) -> list[str]:
    """The warnings naming a state file that could not be written."""
    return [line for line in koordrp.warnings() if f"] cannot write {state}/" in line]


def test_a_full_state_directory_costs_one_warning_naming_the_file_and_never_a_file_cut_short(
    koordrp: KoordrpProcess, state: Path, tuner: FakeHookServer, workdir: Path, metrics_port: int
) -> None:
    mounted(state)
    runtime = started(koordrp)
    with running_container(runtime, "kept", workdir) as small:
        kept = state / "containers" / small.container_id
        before = kept.read_bytes()  # written whole while there was room
        fill(state / "filler", leave=2)
        pod = pod_sandbox_config("full", log_directory=workdir / "full")
        sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
        try:
            made = []
            for name in ("big", "bigger"):
                config = container_config(name, image=BUSYBOX_REF, command=["sleep", "3600"], log_path=f"{name}.log", env=MANY_ENVS)
                made.append(start_container(runtime, sandbox_id, pod, config))
                # The call went on, hook applied, though what kubelet asked could not be kept.
                assert "KOORDRP_TEST=1" in container_env(runtime, made[-1])
            assert len(koordrp.log_lines("CreateContainer pod default/full ", count=2)) == 2  # both calls over
            [warning] = cannot_write(koordrp, state)  # one for both: a full disk does not warn at every call
            named = re.search(r"\] cannot write (\S+): No space left on device; ", warning)
            assert named is not None, warning
            assert named.group(1).startswith(f"{state}/") and not Path(named.group(1)).exists(), warning
            for container_id in made:
                assert not (state / "containers" / container_id).exists()
            assert temporaries(state) == []
            assert kept.read_bytes() == before
            assert write_failures(metrics_port) >= 2

            # Room again: the next state file is written, whole.
            for name in os.listdir(state / "filler"):
                (state / "filler" / name).unlink()
            config = container_config("roomy", image=BUSYBOX_REF, command=["sleep", "3600"], log_path="roomy.log", env=MANY_ENVS)
            roomy = start_container(runtime, sandbox_id, pod, config)
            assert (state / "containers" / roomy).stat().st_size > sum(len(key) + len(value) for key, value in MANY_ENVS.items())
            assert temporaries(state) == []
            assert len(cannot_write(koordrp, state)) == 1
        finally:
            remove_pod(runtime, sandbox_id)


@pytest.mark.parametrize("kept", [False, True], ids=["empty", "with-state-files"])
def test_a_read_only_state_directory_is_one_warning_at_start_and_calls_go_on(
    koordrp: KoordrpProcess, state: Path, tuner: FakeHookServer, workdir: Path, metrics_port: int, kept: bool
) -> None:
    leftover = state / "containers" / ("0" * 64)
    if kept:
        # As koordrp left it, then remounted read-only: a file for a container containerd no longer has.
        mounted(state)
        for kind in ("pods", "containers"):
            (state / kind).mkdir(mode=0o700)
        leftover.write_bytes(b"what kubelet asked")
        subprocess.run(["mount", "-o", "remount,ro", str(state)], check=True)
    else:
        mounted(state, "ro")
    runtime = started(koordrp)
    [warning] = [line for line in koordrp.warnings() if "state directory" in line]
    assert f"] cannot write in the state directory {state}: Read-only file system; " in warning, warning
    with running_container(runtime, "readonly", workdir) as pod:
        assert "KOORDRP_TEST=1" in container_env(runtime, pod.container_id)
        assert not (state / "containers" / pod.container_id).exists()
    # One warning for the state files that could not be written, naming the first (the pod's or the container's).
    [warning] = cannot_write(koordrp, state)
    assert re.search(rf"\] cannot write {re.escape(str(state))}/\w+/\S+: Read-only file system; ", warning), warning
    if kept:
        # What was kept there was learnt: the start-up reading tried to forget the gone container's file.
        assert koordrp.log_lines(f"{leftover}: Read-only file system")
        assert leftover.read_bytes() == b"what kubelet asked"
    assert write_failures(metrics_port) >= 1
    assert temporaries(state) == []
