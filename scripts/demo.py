"""The demo: a private containerd, ``twistd -n koordrp`` in front of it, a hook server, and a pod.

A small hook server registers itself in koordrp's hookserver.d for PreRunPodSandbox and
PreCreateContainer: it pins the container to CPU 0 and injects an environment variable naming the
pod's QoS class. Every CRI call the demo makes goes through koordrp's socket and is printed with its
answer; then the container itself shows what the hook changed (its env, its cgroup's cpuset). Nothing
is left behind: containerd, koordrp, the hook server, the pod and the temporary directory all go.
"""

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from cri_api.v1 import api_pb2, api_pb2_grpc

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from tests.fake.hook_server import FakeHookServer
from tests.support.hook_registration import register

from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.images import BUSYBOX_REF
from tests.support.stack import containerd_and_koordrp

Answer = TypeVar("Answer")


def step(method: str, call: Callable[[], Answer], show: Callable[[Answer], Any] = lambda answer: "ok") -> Answer:
    started = time.perf_counter()
    answer = call()
    print(f"  {method:<18} {(time.perf_counter() - started) * 1000:7.1f} ms  {show(answer)}")
    return answer


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="krp-demo-", dir="/tmp") as scratch:
        base = Path(scratch)
        print(f"building the pause and busybox images from /bin/busybox, in {base}")
        tuner = start_hook_server(base)
        try:
            with containerd_and_koordrp(base) as (containerd, proxy):
                print(f"private containerd on {containerd.endpoint}")
                print(f"koordrp (twistd -n koordrp) on {proxy.endpoint}")
                registration = register(
                    base / "hookserver.d", "demo-tuner", tuner.path, ["PreRunPodSandbox", "PreCreateContainer"]
                )
                print(f"hook server on unix://{tuner.path}, registered by {registration}:")
                print(f"  {registration.read_text()}")
                proxy.wait_for_servers(1)
                with proxy.channel() as channel:
                    walk_a_pod(api_pb2_grpc.RuntimeServiceStub(channel), base)
                print("\nwhat the hook server was asked:")
                for rpc, request in zip(tuner.rpcs(), tuner.calls()):
                    print(f"  {rpc}: pod {request.pod_meta.namespace}/{request.pod_meta.name}")
                print("\nkoordrp's log:")
                print("\n".join("  " + line for line in proxy.log().splitlines()))
        finally:
            tuner.stop()
    print("\ncleaned up: koordrp stopped, containerd stopped, its state removed")


def start_hook_server(base: Path) -> FakeHookServer:
    """A hook server with the demo's policy: pin to CPU 0, and say the pod's QoS class in the env."""
    tuner = FakeHookServer(str(base / "demo-tuner.sock")).start()
    tuner.behaviours["PreRunPodSandboxHook"] = lambda request: hook.PodSandboxHookResponse(
        annotations={"demo.koordrp/tuned": "true"}
    )
    tuner.behaviours["PreCreateContainerHook"] = lambda request: hook.ContainerResourceHookResponse(
        container_envs={"POD_QOS_CLASS": request.pod_labels.get("koordinator.sh/qosClass", "none")},
        container_resources=hook.LinuxContainerResources(cpuset_cpus="0"),
    )
    return tuner


def walk_a_pod(runtime: api_pb2_grpc.RuntimeServiceStub, base: Path) -> None:
    print("\nCRI calls made through koordrp:")
    step("Version", lambda: runtime.Version(api_pb2.VersionRequest()), lambda v: f"{v.runtime_name} {v.runtime_version}")
    pod = pod_sandbox_config(
        "demo", namespace="default", labels={"koordinator.sh/qosClass": "LS"}, log_directory=base / "pod-logs"
    )
    sandbox = step(
        "RunPodSandbox",
        lambda: runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=60),
        lambda answer: f"sandbox {answer.pod_sandbox_id[:13]}",
    )
    config = container_config(
        "app", image=BUSYBOX_REF, command=["sleep", "3600"], env={"GREETING": "hello"}, log_path="app.log"
    )
    created = step(
        "CreateContainer",
        lambda: runtime.CreateContainer(
            api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox.pod_sandbox_id, config=config, sandbox_config=pod),
            timeout=60,
        ),
        lambda answer: f"container {answer.container_id[:13]}",
    )
    cid = created.container_id
    step("StartContainer", lambda: runtime.StartContainer(api_pb2.StartContainerRequest(container_id=cid)))
    step(
        "ExecSync env",
        lambda: runtime.ExecSync(api_pb2.ExecSyncRequest(container_id=cid, cmd=["env"], timeout=10)),
        lambda answer: " ".join(sorted(answer.stdout.decode().split())),
    )
    step(
        "ExecSync cpuset",
        lambda: runtime.ExecSync(
            api_pb2.ExecSyncRequest(container_id=cid, cmd=["cat", "/sys/fs/cgroup/cpuset/cpuset.cpus"], timeout=10)
        ),
        lambda answer: f"cpuset.cpus = {answer.stdout.decode().strip() or answer.stderr.decode().strip()}",
    )
    step(
        "ContainerStatus",
        lambda: runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=cid, verbose=True)),
        lambda answer: f"{api_pb2.ContainerState.Name(answer.status.state)}, runtime spec cpus = "
        + json.loads(answer.info["info"])["runtimeSpec"]["linux"]["resources"]["cpu"].get("cpus", "?"),
    )
    step(
        "ListPodSandbox",
        lambda: runtime.ListPodSandbox(api_pb2.ListPodSandboxRequest()),
        lambda answer: f"{len(answer.items)} pod(s)",
    )
    step("StopContainer", lambda: runtime.StopContainer(api_pb2.StopContainerRequest(container_id=cid, timeout=0)))
    step("RemoveContainer", lambda: runtime.RemoveContainer(api_pb2.RemoveContainerRequest(container_id=cid)))
    sid = sandbox.pod_sandbox_id
    step("StopPodSandbox", lambda: runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=sid)))
    step("RemovePodSandbox", lambda: runtime.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sid)))


if __name__ == "__main__":
    main()
