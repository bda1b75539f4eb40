"""The demo: a private containerd, ``twistd -n koordrp`` in front of it, a hook server, a pod.

    scripts/demo [--hook-server path/to/server.py] [--pod-label K=V] [--pod-annotation K=V]
                 [--qos besteffort|burstable|guaranteed] [--pod-cgroup-parent PATH] [--env K=V]
                 [--cpu-shares N] [--cpuset CPUS] [--memory-mib N] [--failure-policy Fail] [--repeat-stops]
                 [--mode proxy|nri]

The hook server is the example (koordrp/examples/cpuset_qos.py: it pins containers of pods
annotated ``demo.koordrp.io/cpuset`` to those CPUs and injects ``POD_QOS_CLASS`` from the pod's QoS
label), or a file of your own defining a ``koordrp.sdk.HookServer``, served as
``python -m koordrp.sdk`` serves it. Every CRI call the demo makes goes through koordrp's socket and
is printed with its answer; then what containerd received (the pod's labels, annotations and cgroup
parent; the container's environment, resources and annotations), what the container itself sees,
koordrp's log lines and metrics, and the hook server's own output. The pod's cgroup parent is the one
kubelet gives a pod of its QoS class (``/kubepods/burstable/pod<uid>`` unless ``--qos`` says
otherwise). With ``--repeat-stops`` the container is stopped twice, and a second one is left running
for the pod's stop: each shows PostStopContainer firing once. A hook server that fails to start ends
the demo at once, its error first; what the SDK warned of comes first in the summary. Nothing is left
behind: containerd, koordrp, the hook server, the pod, its cgroups and the temporary directory all go.

With ``--mode nri`` the containerd is Debian 13's 1.7 (``.deps/trixie``, from scripts/bootstrap)
with NRI enabled, koordrp runs as its NRI plugin, and the demo's CRI calls go to containerd itself,
as kubelet's do on such a node; koordrp's lines say what NRI could not apply.
"""

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from cri_api.v1 import api_pb2, api_pb2_grpc
from google.protobuf.json_format import MessageToDict

from tests.support.cri_objects import container_config, linux_resources, pod_sandbox_config
from tests.support.daemons import cgroup_dirs, remove_cgroup
from tests.support.images import BUSYBOX_REF
from tests.support.koordrp_process import KoordrpProcess
from tests.support.stack import containerd_and_koordrp

Answer = TypeVar("Answer")

EXAMPLE = Path(__file__).resolve().parents[1] / "koordrp" / "examples" / "cpuset_qos.py"


# Where kubelet (cgroupfs driver) puts a pod of each QoS class.
QOS_PARENTS = {"guaranteed": "/kubepods/pod{uid}", "burstable": "/kubepods/burstable/pod{uid}", "besteffort": "/kubepods/besteffort/pod{uid}"}


@dataclass
class Pod:
    """The pod the demo makes, as the command line says."""

    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    cpu_shares: int = 0
    cpuset: str = ""
    memory_mib: int = 0
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))
    cgroup_parent: str = ""


# What the example hook server acts on, when the demo runs it and the command line says nothing else.
EXAMPLE_POD = Pod(
    labels={"koordinator.sh/qosClass": "LS"}, annotations={"demo.koordrp.io/cpuset": "0"}, env={"GREETING": "hello"}
)


def pairs(values: list[str] | None, what: str) -> dict[str, str] | None:
    if values is None:
        return None
    found = dict(value.split("=", 1) for value in values if "=" in value)
    if len(found) != len(values):
        raise SystemExit(f"demo: {what} takes K=V")
    return found


def options(argv: list[str] | None = None) -> tuple[argparse.Namespace, Pod]:
    parser = argparse.ArgumentParser(prog="scripts/demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hook-server", type=Path, default=EXAMPLE, help="a file defining a HookServer [the example]")
    parser.add_argument("--pod-label", action="append", metavar="K=V")
    parser.add_argument("--pod-annotation", action="append", metavar="K=V")
    parser.add_argument(
        "--qos", choices=tuple(QOS_PARENTS), default="burstable", help="the pod's QoS class: where kubelet puts its cgroup"
    )
    parser.add_argument("--pod-cgroup-parent", metavar="PATH", help="the pod's cgroup parent [the --qos class's]")
    parser.add_argument("--env", action="append", metavar="K=V", help="the container's environment")
    parser.add_argument("--cpu-shares", type=int, default=0)
    parser.add_argument("--cpuset", default="", help="the container's cpuset as kubelet would ask, e.g. 0")
    parser.add_argument("--memory-mib", type=int, default=0, help="the container's memory limit")
    parser.add_argument("--failure-policy", choices=("Ignore", "Fail"), default="Ignore")
    parser.add_argument(
        "--mode",
        choices=("proxy", "nri"),
        default="proxy",
        help="koordrp in front of containerd 1.6 (proxy), or as containerd 1.7's NRI plugin (nri)",
    )
    parser.add_argument(
        "--repeat-stops",
        action="store_true",
        help="stop the container twice, and stop the pod with a second container running: PostStopContainer fires once each",
    )
    parsed = parser.parse_args(argv)
    pod = Pod(cpu_shares=parsed.cpu_shares, cpuset=parsed.cpuset, memory_mib=parsed.memory_mib)
    pod.cgroup_parent = parsed.pod_cgroup_parent or QOS_PARENTS[parsed.qos].format(uid=pod.uid)
    for name, values in (("labels", parsed.pod_label), ("annotations", parsed.pod_annotation), ("env", parsed.env)):
        given = pairs(values, name)
        if given is not None:
            setattr(pod, name, given)
        elif parsed.hook_server == EXAMPLE:
            setattr(pod, name, getattr(EXAMPLE_POD, name))
    return parsed, pod


def step(method: str, call: Callable[[], Answer], show: Callable[[Answer], Any] = lambda answer: "ok") -> Answer:
    started = time.perf_counter()
    answer = call()
    print(f"  {method:<18} {(time.perf_counter() - started) * 1000:7.1f} ms  {show(answer)}")
    return answer


def main(argv: list[str] | None = None) -> None:
    parsed, pod = options(argv)
    # kubepods and its QoS levels exist on a node; here they are made for the demo, and go with it.
    created_cgroups = [parent for parent in _ancestors(pod.cgroup_parent) if not cgroup_dirs(parent)]
    try:
        with tempfile.TemporaryDirectory(prefix="krp-demo-", dir="/tmp") as scratch:
            run(parsed, pod, Path(scratch))
    finally:
        for parent in created_cgroups:
            remove_cgroup(parent)
    print("\ncleaned up: hook server, koordrp and containerd stopped, their state and the pod's cgroups removed")


def run(parsed: argparse.Namespace, pod: Pod, base: Path) -> None:
    port = free_port()
    metrics = f"http://127.0.0.1:{port}"
    print(f"building the pause and busybox images from /bin/busybox, in {base}")
    nri = parsed.mode == "nri"
    with containerd_and_koordrp(base, [f"--metrics-endpoint=tcp:{port}:interface=127.0.0.1"], nri) as (containerd, proxy):
        print(f"private containerd {containerd.release} on {containerd.endpoint}")
        if nri:
            print(f"koordrp (twistd -n koordrp {' '.join(proxy.mode_args())}) is its NRI plugin, metrics on {metrics}")
            print("the CRI calls below go to containerd, as kubelet's do on an NRI node; containerd calls koordrp")
        else:
            print(f"koordrp (twistd -n koordrp) on {proxy.endpoint}, metrics on {metrics}")
        hook_server = start_hook_server(parsed.hook_server, base, parsed.failure_policy)
        log = base / "hook-server.log"
        try:
            failure = wait_for_registration(proxy, hook_server, log)
            if failure is not None:
                print(f"\nsummary: the hook server {parsed.hook_server} did not start: {failure}")
                show_server_output(log)
                raise SystemExit(1)
            registration = next((base / "hookserver.d").glob("*.json"))
            print(f"hook server {parsed.hook_server} (served by python -m koordrp.sdk), registered by {registration}:")
            print("  " + " ".join(registration.read_text().split()))
            if nri:
                walk_a_pod(containerd.runtime(), base, pod, parsed.repeat_stops)
            else:
                with proxy.channel() as channel:
                    walk_a_pod(api_pb2_grpc.RuntimeServiceStub(channel), base, pod, parsed.repeat_stops)
            proxy.log_lines("[koordrp.calls#info] RemovePodSandbox")  # the last call's line, just after its answer
            summary = warnings(log)
            if summary:
                print("\nsummary: the hook server warned (koordrp.sdk):")
                for line in summary:
                    print("  " + line)
            print("\nkoordrp's log, one line per lifecycle call:")
            for line in proxy.log_lines("[koordrp.calls#info]"):
                print("  " + line.split("] ", 1)[1])
            show_metrics(metrics)
        finally:
            hook_server.terminate()
            hook_server.wait(10)
        show_server_output(log)


def _ancestors(path: str) -> list[str]:
    """``/a/b/c`` as ``/a/b/c``, ``/a/b``, ``/a``: deepest first, the order they can be removed in."""
    parts = [part for part in path.split("/") if part]
    return ["/" + "/".join(parts[:depth]) for depth in range(len(parts), 0, -1)]


def wait_for_registration(proxy: KoordrpProcess, server: "subprocess.Popen[bytes]", log: Path, timeout: float = 30.0) -> str | None:
    """None once koordrp has the hook server registered; else why it never will (it exited, or it says so)."""
    deadline = time.monotonic() + timeout
    while proxy.registered_servers() != 1:
        code = server.poll()
        if code is not None:
            lines = log.read_text(errors="replace").strip().splitlines()
            return f"it exited with status {code}: {lines[-1] if lines else 'no output'}"
        if time.monotonic() > deadline:
            return f"koordrp did not see its registration within {timeout:g}s"
        time.sleep(0.05)
    return None


def warnings(log: Path) -> list[str]:
    """What the hook server's SDK warned of (handlers it will never call, answers that clear fields)."""
    return [line for line in log.read_text(errors="replace").splitlines() if " koordrp.sdk WARNING " in line]


def show_server_output(log: Path) -> None:
    print("\nthe hook server's own output:")
    for line in log.read_text(errors="replace").splitlines():
        print("  " + line)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_hook_server(file: Path, base: Path, policy: str) -> subprocess.Popen[bytes]:
    """The hook server in ``file``, served on a socket named after it and registered in koordrp's directory."""
    output = open(base / "hook-server.log", "wb")
    socket_path = base / f"{file.stem.replace('_', '-')}.sock"
    command = [sys.executable, "-m", "koordrp.sdk", str(file), "--socket", str(socket_path)]
    command += ["--register-in", str(base / "hookserver.d"), "--failure-policy", policy]
    with output:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=output)


def show_metrics(base_url: str) -> None:
    with urllib.request.urlopen(f"{base_url}/healthz", timeout=10) as health:
        print(f"\n{base_url}/healthz: {health.status} {health.read().decode().strip()}")
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    print(f"{base_url}/metrics (hook calls, lifecycle calls, registrations, store):")
    line_filter = ("Container", "PodSandbox")
    for line in lines:
        hooks_and_store = line.startswith(
            ("koordrp_hook_calls_total", "koordrp_hook_servers ", "koordrp_store_", "koordrp_state_files")
        )
        lifecycle_call = line.startswith("koordrp_cri_calls_total") and any(word in line for word in line_filter)
        if hooks_and_store or lifecycle_call:
            print("  " + line)


def walk_a_pod(runtime: api_pb2_grpc.RuntimeServiceStub, base: Path, wanted: Pod, repeat_stops: bool) -> None:
    print("\nCRI calls made through koordrp:")
    step("Version", lambda: runtime.Version(api_pb2.VersionRequest()), lambda v: f"{v.runtime_name} {v.runtime_version}")
    pod = pod_sandbox_config(
        "demo",
        namespace="default",
        uid=wanted.uid,
        labels=wanted.labels,
        annotations=wanted.annotations,
        log_directory=base / "pod-logs",
        cgroup_parent=wanted.cgroup_parent,
    )
    sandbox = step(
        "RunPodSandbox",
        lambda: runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=60),
        lambda answer: f"sandbox {answer.pod_sandbox_id[:13]}",
    )
    resources = linux_resources(
        cpu_shares=wanted.cpu_shares, cpuset_cpus=wanted.cpuset, memory_limit_in_bytes=wanted.memory_mib << 20
    )
    config = container_config(
        "app", image=BUSYBOX_REF, command=["sleep", "3600"], env=wanted.env, log_path="app.log", resources=resources
    )
    created = step(
        "CreateContainer",
        lambda: runtime.CreateContainer(
            api_pb2.CreateContainerRequest(pod_sandbox_id=sandbox.pod_sandbox_id, config=config, sandbox_config=pod),
            timeout=60,
        ),
        lambda answer: f"container {answer.container_id[:13]}",
    )
    cid, sid = created.container_id, sandbox.pod_sandbox_id
    step("StartContainer", lambda: runtime.StartContainer(api_pb2.StartContainerRequest(container_id=cid)))
    # kubelet sends the container's resources again on a resize or a CPU manager update: a server that
    # changes them at create should answer PreUpdateContainerResources too, or the update undoes it.
    update = api_pb2.UpdateContainerResourcesRequest(container_id=cid, linux=resources)
    step("UpdateResources", lambda: runtime.UpdateContainerResources(update, timeout=60))
    show_received(runtime, sid, cid)
    print("\nwhat the container sees:")
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
    print()
    stop = api_pb2.StopContainerRequest(container_id=cid, timeout=0)
    step("StopContainer", lambda: runtime.StopContainer(stop))
    if repeat_stops:
        # kubelet stops again what is stopped already: the repeat owes no PostStopContainer.
        step("StopContainer", lambda: runtime.StopContainer(stop), lambda answer: "ok (again: no post hook)")
        second = container_config("sidecar", image=BUSYBOX_REF, command=["sleep", "3600"], log_path="sidecar.log")
        created = step(
            "CreateContainer",
            lambda: runtime.CreateContainer(
                api_pb2.CreateContainerRequest(pod_sandbox_id=sid, config=second, sandbox_config=pod), timeout=60
            ),
            lambda answer: f"container {answer.container_id[:13]} (sidecar, left running)",
        )
        step("StartContainer", lambda: runtime.StartContainer(api_pb2.StartContainerRequest(container_id=created.container_id)))
    step("RemoveContainer", lambda: runtime.RemoveContainer(api_pb2.RemoveContainerRequest(container_id=cid)))
    step(
        "StopPodSandbox",
        lambda: runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=sid)),
        lambda answer: "ok (its running sidecar stops with it)" if repeat_stops else "ok",
    )
    step("RemovePodSandbox", lambda: runtime.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sid)))


def show_received(runtime: api_pb2_grpc.RuntimeServiceStub, sandbox_id: str, container_id: str) -> None:
    """What containerd was given, from its verbose statuses: the requests koordrp sent it."""
    pod_info = json.loads(
        runtime.PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True)).info["info"]
    )
    status = runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=container_id, verbose=True))
    info = json.loads(status.info["info"])
    config, spec = info["config"], info["runtimeSpec"]
    print("\nwhat containerd received:")
    print(f"  pod labels          {json.dumps(pod_info['config'].get('labels', {}), sort_keys=True)}")
    print(f"  pod annotations     {json.dumps(pod_info['config'].get('annotations', {}), sort_keys=True)}")
    print(f"  pod cgroup parent   {pod_info['config'].get('linux', {}).get('cgroup_parent', '') or '(none)'}")
    print(f"  container env       {' '.join(env['key'] + '=' + env.get('value', '') for env in config.get('envs', []))}")
    print(f"  container annotations {json.dumps(config.get('annotations', {}), sort_keys=True)}")
    print(f"  container resources {json.dumps(config.get('linux', {}).get('resources', {}), sort_keys=True)}")
    print(f"  now, after updates  {json.dumps(MessageToDict(status.status.resources.linux), sort_keys=True)}")
    print(f"  runtime spec cpu    {json.dumps(spec['linux']['resources'].get('cpu', {}), sort_keys=True)}")
    print(f"  cgroups path        {spec['linux'].get('cgroupsPath', '')}")


if __name__ == "__main__":
    main()
