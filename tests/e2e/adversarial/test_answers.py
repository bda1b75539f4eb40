"""Hook answers koordrp refuses, end to end on a real containerd: an answer's field that breaks a rule of
koordrp.hooks.validation never reaches the runtime. With the Fail policy the call fails naming the server and
the field; with Ignore that field is left out and the rest of the answer applies.

- proxy mode (containerd 2.1): a PreRunPodSandbox cgroup parent that climbs out of the pod's cgroup root;
- NRI mode (containerd 1.7 and 2.1): a PreCreateContainer annotation just under ttrpc's 4 MiB, which containerd
  would take and then could neither start the container nor call koordrp about it.
"""

import json
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
from cri_api.v1 import api_pb2

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from tests.e2e.conftest import Runtimes, hook_server, wait_registered
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import Containerd
from tests.support.daemons import cgroup_dirs, remove_cgroup
from tests.support.hook_registration import register
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import TIMEOUT, running_container, runtime_spec

PROXY_RELEASES = ["2.1"]
"""The containerd the adversarial pass ran against; the rules are koordrp's, the same before every runtime."""
ROOT = "/koordrp-adversarial"
KUBELETS_PARENT = ROOT + "/pod-answers"
ESCAPED = "/koordrp-escaped"
# A cgroup parent that leaves the pods' root: through "..", and as a relative path.
ESCAPING = {
    "dotdot": (ROOT + "/../../koordrp-escaped", "has a .. part"),
    "relative": ("../../koordrp-escaped", "neither an absolute path nor a systemd slice name"),
}
BIG_ANNOTATION = 4_192_000
"""Bytes of the annotation that made containerd 2.1 take an adjustment, then fail the container's start
(``ResourceExhausted … message length 4195702``)."""


@pytest.fixture(params=PROXY_RELEASES)
def containerd(request: pytest.FixtureRequest, runtimes: Runtimes) -> Containerd:
    """The containerd koordrp (tests/e2e/conftest.py's ``koordrp``, ``runtime``) is the proxy of."""
    return runtimes.get(request.param)


@pytest.fixture
def escaper(servers: dict[str, FakeHookServer], workdir: Path) -> Iterator[FakeHookServer]:
    """A server whose PreRunPodSandbox answer moves the pod with the cgroup parent the test sets, and labels it."""
    server = hook_server(servers, workdir, "escaper")
    yield server
    for parent in (ROOT, ESCAPED):
        remove_cgroup(parent)


def escaping(server: FakeHookServer, parent: str) -> None:
    server.behaviours["PreRunPodSandboxHook"] = lambda request: hook.PodSandboxHookResponse(
        cgroup_parent=parent, labels={"koordrp.test/seen": "1"}
    )


def pods_named(containerd: Containerd, name: str) -> list[Any]:
    pods = containerd.runtime().ListPodSandbox(api_pb2.ListPodSandboxRequest(), timeout=TIMEOUT).items
    return [pod for pod in pods if pod.metadata.name == name]


@pytest.mark.parametrize("how", list(ESCAPING))
def test_a_fail_policy_servers_cgroup_parent_out_of_the_pods_root_fails_the_run_naming_the_field(
    how: str, containerd: Containerd, koordrp: KoordrpProcess, runtime: Any, escaper: FakeHookServer, workdir: Path, hooks_dir: Path
) -> None:
    parent, why = ESCAPING[how]
    escaping(escaper, parent)
    register(hooks_dir, "escaper", escaper.path, ["PreRunPodSandbox"], policy="Fail")
    wait_registered(koordrp, 1)
    name = f"escape-{how}-fail"
    with pytest.raises(grpc.RpcError) as error:
        with running_container(runtime, name, workdir, cgroup_parent=KUBELETS_PARENT):
            pass
    refused = f'refused cgroup_parent "{parent}": {why}'
    assert error.value.code() == grpc.StatusCode.UNKNOWN
    assert error.value.details() == f"koordrp: hook server escaper.json ({escaper.path}) failed PreRunPodSandbox: {refused}"
    [line] = koordrp.log_lines(f"] RunPodSandbox pod default/{name}")
    assert ": UNKNOWN in " in line and f"({refused}; Fail policy: the call failed)" in line, line
    [warning] = koordrp.log_lines(f"hook PreRunPodSandbox on escaper.json for pod default/{name}: ")
    assert warning.endswith(f"{refused}; policy Fail, the CRI call fails"), warning
    # containerd never heard of the pod.
    assert pods_named(containerd, name) == []
    assert cgroup_dirs(ESCAPED) == []


@pytest.mark.parametrize("how", list(ESCAPING))
def test_an_ignore_policy_servers_cgroup_parent_out_of_the_pods_root_leaves_the_pod_where_kubelet_put_it(
    how: str, koordrp: KoordrpProcess, runtime: Any, escaper: FakeHookServer, workdir: Path, hooks_dir: Path
) -> None:
    parent, why = ESCAPING[how]
    escaping(escaper, parent)
    register(hooks_dir, "escaper", escaper.path, ["PreRunPodSandbox"], policy="Ignore")
    wait_registered(koordrp, 1)
    name = f"escape-{how}-ignore"
    with running_container(runtime, name, workdir, cgroup_parent=KUBELETS_PARENT) as pod:
        status = runtime.PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=pod.sandbox_id, verbose=True), timeout=TIMEOUT)
        sandbox_spec = json.loads(status.info["info"])["runtimeSpec"]
        assert sandbox_spec["linux"]["cgroupsPath"].startswith(KUBELETS_PARENT + "/"), sandbox_spec["linux"]["cgroupsPath"]
        assert runtime_spec(runtime, pod.container_id)["linux"]["cgroupsPath"].startswith(KUBELETS_PARENT + "/")
        assert status.status.labels["koordrp.test/seen"] == "1"  # the rest of the answer applies
        assert cgroup_dirs(ESCAPED) == []
    refused = f'refused cgroup_parent "{parent}": {why}'
    [line] = koordrp.log_lines(f"] RunPodSandbox pod default/{name}")
    assert ": OK in " in line and "PreRunPodSandbox@escaper.json: ok " in line, line
    assert line.endswith(f", changed labels +koordrp.test/seen, {refused}"), line
    [warning] = koordrp.log_lines(f"hook PreRunPodSandbox on escaper.json for pod default/{name}: ")
    assert warning.endswith(f"{refused}; policy Ignore, the rest of its answer applies"), warning


def test_in_nri_mode_an_annotation_just_under_ttrpcs_limit_is_refused_and_the_container_starts(
    plugin: KoordrpProcess, nri_containerd: Containerd, servers: dict[str, FakeHookServer], workdir: Path, hooks_dir: Path
) -> None:
    server = hook_server(servers, workdir, "bloater")
    server.behaviours["PreCreateContainerHook"] = lambda request: hook.ContainerResourceHookResponse(
        container_annotations={"koordrp.test/big": "x" * BIG_ANNOTATION}, container_envs={"KOORDRP_SEEN": "1"}
    )
    register(hooks_dir, "bloater", server.path, ["PreCreateContainer"], policy="Ignore")
    wait_registered(plugin, 1)
    runtime = nri_containerd.runtime()  # in NRI mode kubelet calls containerd
    with running_container(runtime, "bloated", workdir) as pod:
        spec = runtime_spec(runtime, pod.container_id)
        assert "KOORDRP_SEEN=1" in spec["process"]["env"]  # the rest of the answer applies
        assert "koordrp.test/big" not in spec["annotations"]
        status = runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=pod.container_id), timeout=TIMEOUT).status
        assert status.state == api_pb2.CONTAINER_RUNNING
    [line] = plugin.log_lines("[koordrp.calls#info] CreateContainer pod default/bloated")
    assert ": OK in " in line and "changed envs +KOORDRP_SEEN" in line, line
    assert f"refused annotations[koordrp.test/big]: {BIG_ANNOTATION + 16} bytes, beyond the 262144 one answer may change in a map" in line
    assert len(line) < 2000
    # containerd still calls koordrp: the next pod's create reaches the server.
    with running_container(runtime, "after", workdir):
        pass
    assert len(server.calls("PreCreateContainerHook")) == 2
