"""The demo: a private containerd, ``twistd -n koordrp`` in front of it, the example hook server, a pod.

The example hook server (koordrp.examples.cpuset_qos, built on koordrp.sdk) registers itself in
koordrp's hookserver.d: it pins containers of pods annotated ``demo.koordrp.io/cpuset`` to those CPUs
and injects ``POD_QOS_CLASS`` from the pod's QoS label. Every CRI call the demo makes goes through
koordrp's socket and is printed with its answer; the container itself then shows what the hook
changed (its env, its cgroup's cpuset), followed by koordrp's log and metrics. Nothing is left
behind: containerd, koordrp, the hook server, the pod and the temporary directory all go.
"""

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, TypeVar

from cri_api.v1 import api_pb2, api_pb2_grpc

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
        port = free_port()
        metrics = f"http://127.0.0.1:{port}"
        print(f"building the pause and busybox images from /bin/busybox, in {base}")
        with containerd_and_koordrp(base, [f"--metrics-endpoint=tcp:{port}:interface=127.0.0.1"]) as (containerd, proxy):
            print(f"private containerd on {containerd.endpoint}")
            print(f"koordrp (twistd -n koordrp) on {proxy.endpoint}, metrics on {metrics}")
            hook_server = start_example_hook_server(base)
            try:
                proxy.wait_for_servers(1)
                registration = next((base / "hookserver.d").glob("*.json"))
                print(f"example hook server (python -m koordrp.examples.cpuset_qos) registered by {registration}:")
                print(f"  {registration.read_text().strip()}")
                with proxy.channel() as channel:
                    walk_a_pod(api_pb2_grpc.RuntimeServiceStub(channel), base)
                print("\nkoordrp's log, one line per lifecycle call:")
                for line in proxy.log().splitlines():
                    if "[koordrp.calls#info]" in line:
                        print("  " + line.split("] ", 1)[1])
                show_metrics(metrics)
            finally:
                hook_server.terminate()
                hook_server.wait(10)
    print("\ncleaned up: hook server, koordrp and containerd stopped, their state removed")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_example_hook_server(base: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable, "-m", "koordrp.examples.cpuset_qos",
            "--socket", str(base / "cpuset-qos.sock"), "--register-in", str(base / "hookserver.d"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def show_metrics(base_url: str) -> None:
    with urllib.request.urlopen(f"{base_url}/healthz", timeout=10) as health:
        print(f"\n{base_url}/healthz: {health.status} {health.read().decode().strip()}")
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    print(f"{base_url}/metrics (hook calls, lifecycle calls, registrations, store):")
    line_filter = ("Container", "PodSandbox")
    for line in lines:
        hooks_and_store = line.startswith(("koordrp_hook_calls_total", "koordrp_hook_servers ", "koordrp_store_entries"))
        lifecycle_call = line.startswith("koordrp_cri_calls_total") and any(word in line for word in line_filter)
        if hooks_and_store or lifecycle_call:
            print("  " + line)


def walk_a_pod(runtime: api_pb2_grpc.RuntimeServiceStub, base: Path) -> None:
    print("\nCRI calls made through koordrp:")
    step("Version", lambda: runtime.Version(api_pb2.VersionRequest()), lambda v: f"{v.runtime_name} {v.runtime_version}")
    pod = pod_sandbox_config(
        "demo",
        namespace="default",
        labels={"koordinator.sh/qosClass": "LS"},
        annotations={"demo.koordrp.io/cpuset": "0"},
        log_directory=base / "pod-logs",
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
