"""The demo: a private containerd, ``twistd -n koordrp`` in front of it, a hook server, a pod.

    scripts/demo [--hook-server path/to/server.py] [--pod-label K=V] [--pod-annotation K=V]
                 [--qos besteffort|burstable|guaranteed] [--pod-cgroup-parent PATH] [--env K=V]
                 [--image NAME] [--cpu-shares N] [--cpuset CPUS] [--memory-mib N]
                 [--failure-policy Ignore|Fail] [--repeat-stops] [--mode proxy|nri]

The hook server is the example (koordrp/examples/cpuset_qos.py: it pins containers of pods
annotated ``demo.koordrp.io/cpuset`` to those CPUs and injects ``POD_QOS_CLASS`` from the pod's QoS
label), or a file of your own defining a ``koordrp.sdk.HookServer``, served as
``python -m koordrp.sdk`` serves it, with its own failure policy unless ``--failure-policy`` says
otherwise. The example's pod carries what the example acts on (a QoS label, a cpuset annotation, an
environment variable); a pod for your own server carries only what the flags give it, and the demo
says which at the start. Every CRI call the demo makes goes through koordrp's socket and is printed
with its answer, a refused or failed one as ``FAILED`` with its status and message, after which the
demo goes on with what can still be done; then what containerd received (the pod's labels,
annotations and cgroup parent; the container's environment, resources and annotations), what the
container itself sees, a summary, koordrp's log lines and metrics, and the hook server's own output.
The summary names, besides the calls that failed and what the SDK warned of, each of the container's
resources the hooks changed at CreateContainer that the runtime no longer has once kubelet's update
went through (the update sends kubelet's values again), and every warn and error line of koordrp's log
(a hook that failed under Ignore, a server whose timeout is longer than NRI gives it).
The pod's cgroup parent is the one kubelet gives a pod of its QoS class
(``/kubepods/burstable/pod<uid>`` unless ``--qos`` says otherwise). The container's image is
busybox, named as ``--image`` says (built here under that name): the demo names it as kubelet
does, by the image's id and as the pod spec writes it. With ``--repeat-stops`` the container is
stopped twice, and a second one is left running for the pod's stop: each shows PostStopContainer
firing once. A hook server that fails to start ends the demo at once, its error first; what the SDK
warned of is in the summary. Nothing is left behind: containerd, koordrp, the hook server, the pod,
its cgroups and the temporary directory all go. The demo exits 0 once it has shown all this, the
CRI calls' failures included: they are what it shows.

With ``--mode nri`` the containerd is Debian 13's 1.7 (``.deps/trixie``, from scripts/bootstrap)
with NRI enabled, koordrp runs as its NRI plugin, and the demo's CRI calls go to containerd itself,
as kubelet's do on such a node; koordrp's lines say what NRI could not apply.
"""

import argparse
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar, cast

import grpc
from cri_api.v1 import api_pb2, api_pb2_grpc
from google.protobuf.json_format import MessageToDict

from tests.support.containerd import Containerd, ContainerdError
from tests.support.cri_objects import container_config, linux_resources, pod_sandbox_config
from tests.support.daemons import cgroup_dirs, remove_cgroup
from tests.support.images import BUSYBOX_REF, SLEEP_FOREVER_CMD, BuiltImage, build_image_archive
from tests.support.koordrp_process import KoordrpProcess, log_files
from tests.support.scrape import get
from tests.support.stack import containerd_and_koordrp

Answer = TypeVar("Answer")

EXAMPLE = Path(__file__).resolve().parents[1] / "koordrp" / "examples" / "cpuset_qos.py"


# Where kubelet (cgroupfs driver) puts a pod of each QoS class.
QOS_PARENTS = {"guaranteed": "/kubepods/pod{uid}", "burstable": "/kubepods/burstable/pod{uid}", "besteffort": "/kubepods/besteffort/pod{uid}"}

# The container's resources as kubelet and hooks name them, and where the runtime's OCI spec keeps each: what
# the runtime holds is what the container gets, in either mode (NRI's changes are only there).
SPEC_FIELDS = {
    "cpuset_cpus": ("cpu", "cpus"),
    "cpuset_mems": ("cpu", "mems"),
    "cpu_shares": ("cpu", "shares"),
    "cpu_quota": ("cpu", "quota"),
    "cpu_period": ("cpu", "period"),
    "memory_limit_in_bytes": ("memory", "limit"),
}

Resources = dict[str, str | int | None]
"""A container's resources by SPEC_FIELDS' names; None: not set."""

# An image reference as a pod spec writes it: [registry[:port]/]path[:tag], in lower case (no digest: the
# demo builds the image, so it has no digest to name).
_REFERENCE = re.compile(
    r"(?:[a-z0-9][a-z0-9.-]*(?::[0-9]+)?/)?[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
)


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
    image: str = BUSYBOX_REF
    """The container's image as the pod spec writes it."""


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


def full_reference(name: str) -> str:
    """``name`` as containerd names the image (docker's rule): ``busybox`` is ``docker.io/library/busybox:latest``."""
    first, slash, _ = name.partition("/")
    if not slash or not ("." in first or ":" in first or first == "localhost"):
        name = f"docker.io/{name}" if slash else f"docker.io/library/{name}"
    return name if ":" in name.rsplit("/", 1)[1] else f"{name}:latest"


def options(argv: list[str] | None = None) -> tuple[argparse.Namespace, Pod]:
    parser = argparse.ArgumentParser(prog="scripts/demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hook-server", type=Path, default=EXAMPLE, help="a file defining a HookServer [the example]")
    parser.add_argument(
        "--pod-label", action="append", metavar="K=V", help="[the example's pod: koordinator.sh/qosClass=LS; yours: none]"
    )
    parser.add_argument(
        "--pod-annotation", action="append", metavar="K=V", help="[the example's pod: demo.koordrp.io/cpuset=0; yours: none]"
    )
    parser.add_argument(
        "--qos", choices=tuple(QOS_PARENTS), default="burstable", help="the pod's QoS class: where kubelet puts its cgroup"
    )
    parser.add_argument("--pod-cgroup-parent", metavar="PATH", help="the pod's cgroup parent [the --qos class's]")
    parser.add_argument(
        "--env", action="append", metavar="K=V", help="the container's environment [the example's: GREETING=hello; yours: none]"
    )
    parser.add_argument(
        "--image",
        default=BUSYBOX_REF,
        metavar="NAME",
        help=f"the container's image as the pod spec names it, e.g. registry.example/team/app:1 (busybox, built "
        f"under that name) [{BUSYBOX_REF}]",
    )
    parser.add_argument("--cpu-shares", type=int, default=0)
    parser.add_argument("--cpuset", default="", help="the container's cpuset as kubelet would ask, e.g. 0")
    parser.add_argument("--memory-mib", type=int, default=0, help="the container's memory limit")
    parser.add_argument(
        "--failure-policy", choices=("Ignore", "Fail"), help="[the hook server's own: its failure_policy, else Ignore]"
    )
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
    if not _REFERENCE.fullmatch(parsed.image):
        parser.error(f"--image {parsed.image!r} is not an image name such as registry.example/team/app:1")
    pod = Pod(cpu_shares=parsed.cpu_shares, cpuset=parsed.cpuset, memory_mib=parsed.memory_mib, image=parsed.image)
    pod.cgroup_parent = parsed.pod_cgroup_parent or QOS_PARENTS[parsed.qos].format(uid=pod.uid)
    for name, values in (("labels", parsed.pod_label), ("annotations", parsed.pod_annotation), ("env", parsed.env)):
        given = pairs(values, name)
        if given is not None:
            setattr(pod, name, given)
        elif parsed.hook_server == EXAMPLE:
            setattr(pod, name, getattr(EXAMPLE_POD, name))
    return parsed, pod


def describe(parsed: argparse.Namespace, pod: Pod) -> None:
    """What the pod carries, and whence: an author's server must not wonder where the example's label went."""
    print(f"the pod: labels {json.dumps(pod.labels, sort_keys=True)}, annotations {json.dumps(pod.annotations, sort_keys=True)}")
    print(f"  its container: image {pod.image}, env {json.dumps(pod.env, sort_keys=True)}")
    if parsed.hook_server == EXAMPLE:
        print("  (what the example acts on, unless --pod-label, --pod-annotation or --env say otherwise)")
    else:
        print("  (for your server, only what --pod-label, --pod-annotation and --env give: the example's are its own)")


class Calls:
    """The CRI calls the demo makes, each printed with its answer; a refused or failed one is printed, kept for
    the summary, and the demo goes on."""

    def __init__(self) -> None:
        self.made = 0
        self.failed: list[str] = []
        self.undone: list[str] = []
        """Each of the hooks' changes to the container's resources that the runtime no longer has at the end."""
        self.kept: list[str] = []
        """Each of the hooks' changes to the container's resources that the runtime still has at the end."""

    def step(
        self, method: str, call: Callable[[], Answer], show: Callable[[Answer], Any] = lambda answer: "ok"
    ) -> Answer | None:
        """``call``'s answer (None: it failed, and says so)."""
        self.made += 1
        started = time.perf_counter()
        try:
            answer = call()
        except grpc.RpcError as error:
            failed = cast(grpc.Call, error)
            text = f"FAILED: {failed.code().name}: {failed.details()}"
            print(f"  {method:<18} {(time.perf_counter() - started) * 1000:7.1f} ms  {text}")
            self.failed.append(f"{method} {text}")
            return None
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
        else:
            print(f"koordrp (twistd -n koordrp) on {proxy.endpoint}, metrics on {metrics}")
        if pod.image != BUSYBOX_REF:
            import_as(containerd, base, pod.image)
        describe(parsed, pod)
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
            calls = Calls()
            if nri:
                print("\nCRI calls made to containerd, as kubelet's on an NRI node (containerd calls koordrp, its NRI plugin):")
                last = walk_a_pod(containerd.runtime(), containerd.images(), base, pod, parsed.repeat_stops, calls, nri)
            else:
                print("\nCRI calls made through koordrp, as kubelet would make them:")
                with proxy.channel() as channel:
                    runtime, images = api_pb2_grpc.RuntimeServiceStub(channel), api_pb2_grpc.ImageServiceStub(channel)
                    last = walk_a_pod(runtime, images, base, pod, parsed.repeat_stops, calls, nri)
            counted(metrics, last)  # its line, if it has one, is written just before
            show_summary(calls, log, koordrp_warnings(proxy))
            show_calls(proxy, nri)
            show_metrics(metrics)
        finally:
            hook_server.terminate()
            hook_server.wait(10)
        show_server_output(log)


def import_as(containerd: Containerd, base: Path, name: str) -> None:
    """busybox under ``name``, imported as containerd names it: a pod spec may name it so."""
    built: BuiltImage = build_image_archive(base / "images" / "named.tar", full_reference(name), SLEEP_FOREVER_CMD)
    try:
        containerd.import_images([built])
    except ContainerdError as error:
        raise SystemExit(f"demo: --image {name}: containerd did not take the image: {error}") from None
    print(f"image {name} (busybox) imported as {built.ref}")


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


def koordrp_warnings(proxy: KoordrpProcess) -> list[str]:
    """Every warn, error and critical line of koordrp's log, without its time, each with the lines it goes on on
    (a traceback's)."""
    found: list[str] = []
    within = False
    for line in "".join(path.read_text(errors="replace") for path in log_files(proxy.logfile)).splitlines():
        if line.startswith("\t"):
            if within:
                found.append("  " + line.strip())
            continue
        within = re.search(r" \[[^\]]*#(warn|error|critical)\] ", line) is not None
        if within:
            found.append(line.split(" ", 1)[1])
    return found


def show_summary(calls: Calls, log: Path, koordrp_warned: list[str]) -> None:
    print("\nsummary:")
    if calls.failed:
        print(f"  {len(calls.failed)} of the {calls.made} CRI calls failed:")
        for line in calls.failed:
            print("    " + line)
    else:
        print(f"  all {calls.made} CRI calls answered")
    warned = warnings(log)
    if warned:
        print("  the hook server warned (koordrp.sdk):")
        for line in warned:
            print("    " + line)
    if calls.undone:
        # An author whose hook did its work at create must not read "all answered" as "all applied".
        print("  UpdateContainerResources undid what the hooks changed at CreateContainer (kubelet sends its values again):")
        for line in calls.undone:
            print("    " + line)
        print("    (answer PreUpdateContainerResources too, with the same change: docs/hook-server/messages.md)")
    if calls.kept:
        print("  what the hooks changed at CreateContainer, the runtime still has at the end: " + ", ".join(calls.kept))
    if koordrp_warned:
        print("  koordrp warned (the warn and error lines of its log):")
        for line in koordrp_warned:
            print("    " + line)


def counted(base_url: str, method: str, timeout: float = 30.0) -> None:
    """Once koordrp has counted a ``method`` call (it has done with it, just after the call answered), or after
    ``timeout``: a call the runtime failed before it reached koordrp (NRI mode) is never counted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if f'method="{method}"' in get(f"{base_url}/metrics")[1]:
            return
        time.sleep(0.05)


def show_calls(proxy: KoordrpProcess, nri: bool) -> None:
    if nri:
        print("\nkoordrp's log, one line per lifecycle call a hook server was called for or spared, or that went wrong (containerd logs the rest):")
        # containerd tells its plugin of a call as NRI events: the line times them, not kubelet's call.
        print("  (NRI mode: a line's time runs from containerd's NRI event to its word that it did the call,")
        print("  not the CRI call's above: a stop or removal is told once done, so its time is koordrp's alone)")
    else:
        print("\nkoordrp's log, one line per lifecycle call:")
    lines = [line.split("] ", 1)[1] for line in proxy.log_lines("[koordrp.calls#info]", timeout=0)]  # all written: counted
    for line in lines:
        print("  " + line)
    if any(": sent" in line for line in lines):
        print("  (sent: a post hook, made once the call has answered and not waited for; koordrp_hook_calls_total says how it went)")


def show_server_output(log: Path) -> None:
    print("\nthe hook server's own output:")
    for line in log.read_text(errors="replace").splitlines():
        print("  " + line)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_hook_server(file: Path, base: Path, policy: str | None) -> subprocess.Popen[bytes]:
    """The hook server in ``file``, served on a socket named after it and registered in koordrp's directory,
    with its own failure policy unless ``policy`` names one."""
    output = open(base / "hook-server.log", "wb")
    socket_path = base / f"{file.stem.replace('_', '-')}.sock"
    command = [sys.executable, "-m", "koordrp.sdk", str(file), "--socket", str(socket_path)]
    command += ["--register-in", str(base / "hookserver.d")]
    if policy is not None:
        command += ["--failure-policy", policy]
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


def walk_a_pod(
    runtime: api_pb2_grpc.RuntimeServiceStub,
    images: api_pb2_grpc.ImageServiceStub,
    base: Path,
    wanted: Pod,
    repeat_stops: bool,
    calls: Calls,
    nri: bool,
) -> str:
    """The pod's life, as far as its calls let it go; the last lifecycle call made (the last koordrp ends)."""
    calls.step("Version", lambda: runtime.Version(api_pb2.VersionRequest()), lambda v: f"{v.runtime_name} {v.runtime_version}")
    # kubelet names the image by the id ImageStatus gives, and as the pod spec writes it.
    status = calls.step(
        "ImageStatus",
        lambda: images.ImageStatus(api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=wanted.image)), timeout=60),
        lambda answer: f"{wanted.image} is {answer.image.id[:19]}…",
    )
    pod = pod_sandbox_config(
        "demo",
        namespace="default",
        uid=wanted.uid,
        labels=wanted.labels,
        annotations=wanted.annotations,
        log_directory=base / "pod-logs",
        cgroup_parent=wanted.cgroup_parent,
    )
    sandbox = calls.step(
        "RunPodSandbox",
        lambda: runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=60),
        lambda answer: f"sandbox {answer.pod_sandbox_id[:13]}",
    )
    if sandbox is None:
        return "RunPodSandbox"
    sid = sandbox.pod_sandbox_id
    resources = linux_resources(
        cpu_shares=wanted.cpu_shares, cpuset_cpus=wanted.cpuset, memory_limit_in_bytes=wanted.memory_mib << 20
    )
    image_id = status.image.id if status is not None and status.image.id else wanted.image
    config = container_config(
        "app",
        image=image_id,
        user_specified_image=wanted.image,
        command=["sleep", "3600"],
        env=wanted.env,
        log_path="app.log",
        resources=resources,
    )
    created = calls.step(
        "CreateContainer",
        lambda: runtime.CreateContainer(
            api_pb2.CreateContainerRequest(pod_sandbox_id=sid, config=config, sandbox_config=pod), timeout=60
        ),
        lambda answer: f"container {answer.container_id[:13]}",
    )
    if created is None:
        show_received(runtime, sid, None, nri)
        print()
    else:
        # Before any later call can change them: what the hooks made of kubelet's resources.
        as_created = spec_resources(runtime, created.container_id)
        at_end = use_the_container(runtime, calls, pod, sid, created.container_id, resources, image_id, repeat_stops, nri)
        calls.undone, calls.kept = hooks_changes(asked_resources(resources), as_created, at_end)
    calls.step(
        "StopPodSandbox",
        lambda: runtime.StopPodSandbox(api_pb2.StopPodSandboxRequest(pod_sandbox_id=sid)),
        lambda answer: "ok (its running sidecar stops with it)" if repeat_stops and created is not None else "ok",
    )
    calls.step("RemovePodSandbox", lambda: runtime.RemovePodSandbox(api_pb2.RemovePodSandboxRequest(pod_sandbox_id=sid)))
    return "RemovePodSandbox"


def use_the_container(
    runtime: api_pb2_grpc.RuntimeServiceStub,
    calls: Calls,
    pod: Any,
    sid: str,
    cid: str,
    resources: Any,
    image_id: str,
    repeat_stops: bool,
    nri: bool,
) -> Resources | None:
    """The container's life from its start; its resources in the runtime once the update went through (None:
    containerd could not say)."""
    started = calls.step("StartContainer", lambda: runtime.StartContainer(api_pb2.StartContainerRequest(container_id=cid)))
    # kubelet sends the container's resources again on a resize or a CPU manager update: a server that
    # changes them at create should answer PreUpdateContainerResources too, or the update undoes it.
    update = api_pb2.UpdateContainerResourcesRequest(container_id=cid, linux=resources)
    calls.step("UpdateResources", lambda: runtime.UpdateContainerResources(update, timeout=60))
    at_end = show_received(runtime, sid, cid, nri)
    print("\nwhat the container sees:")
    if started is None:
        print("  nothing: it did not start")
    else:
        calls.step(
            "ExecSync env",
            lambda: runtime.ExecSync(api_pb2.ExecSyncRequest(container_id=cid, cmd=["env"], timeout=10)),
            lambda answer: " ".join(sorted(answer.stdout.decode().split())),
        )
        calls.step(
            "ExecSync cpuset",
            lambda: runtime.ExecSync(
                api_pb2.ExecSyncRequest(container_id=cid, cmd=["cat", "/sys/fs/cgroup/cpuset/cpuset.cpus"], timeout=10)
            ),
            lambda answer: f"cpuset.cpus = {answer.stdout.decode().strip() or answer.stderr.decode().strip()}",
        )
    print()
    stop = api_pb2.StopContainerRequest(container_id=cid, timeout=0)
    calls.step("StopContainer", lambda: runtime.StopContainer(stop))
    if repeat_stops:
        # kubelet stops again what is stopped already: the repeat owes no PostStopContainer.
        calls.step("StopContainer", lambda: runtime.StopContainer(stop), lambda answer: "ok (again: no post hook)")
        second = container_config("sidecar", image=image_id, command=["sleep", "3600"], log_path="sidecar.log")
        sidecar = calls.step(
            "CreateContainer",
            lambda: runtime.CreateContainer(
                api_pb2.CreateContainerRequest(pod_sandbox_id=sid, config=second, sandbox_config=pod), timeout=60
            ),
            lambda answer: f"container {answer.container_id[:13]} (sidecar, left running)",
        )
        if sidecar is not None:
            start = api_pb2.StartContainerRequest(container_id=sidecar.container_id)
            calls.step("StartContainer", lambda: runtime.StartContainer(start))
    calls.step("RemoveContainer", lambda: runtime.RemoveContainer(api_pb2.RemoveContainerRequest(container_id=cid)))
    return at_end


def asked_resources(resources: Any) -> Resources:
    """What kubelet asked, as ``spec_resources`` names it: its 0 and empty string are "not set"."""
    return {name: getattr(resources, name) or None for name in SPEC_FIELDS}


def resources_in(spec: dict[str, Any]) -> Resources:
    held = spec.get("linux", {}).get("resources", {})
    return {name: held.get(part, {}).get(key) for name, (part, key) in SPEC_FIELDS.items()}


def spec_resources(runtime: api_pb2_grpc.RuntimeServiceStub, container_id: str) -> Resources | None:
    """The container's resources as the runtime holds them now (None: containerd could not say)."""
    try:
        status = runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=container_id, verbose=True))
    except grpc.RpcError:
        return None
    return resources_in(json.loads(status.info["info"])["runtimeSpec"])


def hooks_changes(asked: Resources, as_created: Resources | None, at_end: Resources | None) -> tuple[list[str], list[str]]:
    """The resources the hooks set at create (the runtime had other than kubelet asked): those the runtime has
    no more at the end, kubelet's value having come back, and those it still has."""
    undone: list[str] = []
    kept: list[str] = []
    if as_created is None or at_end is None:
        return undone, kept
    for name in SPEC_FIELDS:
        hooks, now = as_created[name], at_end[name]
        if hooks == asked[name]:
            continue
        if now == hooks:
            kept.append(f"resources.{name} {shown(hooks)} ({kubelets(asked[name])})")
        # Another value than kubelet's is a later hook's answer, the server's own doing: no undoing.
        elif now == asked[name]:
            undone.append(
                f"resources.{name}: the hooks made it {shown(hooks)} ({kubelets(asked[name])}); "
                f"the runtime has {shown(now)} at the end"
            )
    return undone, kept


def shown(value: str | int | None) -> str:
    return "none" if value is None else json.dumps(value)


def kubelets(value: str | int | None) -> str:
    return "kubelet asked for none" if value is None else f"kubelet asked {json.dumps(value)}"


def show_received(
    runtime: api_pb2_grpc.RuntimeServiceStub, sandbox_id: str, container_id: str | None, nri: bool
) -> Resources | None:
    """What containerd was given, from its verbose statuses: the requests koordrp sent it (in NRI mode kubelet's:
    koordrp's changes reach the container through NRI, into its runtime spec); the container's resources as
    the runtime holds them (None: no container, or containerd could not say)."""
    print("\nwhat containerd received:" + (" (NRI mode: kubelet's requests; koordrp's changes are in the runtime spec)" if nri else ""))
    try:
        pod_info = json.loads(
            runtime.PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True)).info["info"]
        )
        print(f"  pod labels          {json.dumps(pod_info['config'].get('labels', {}), sort_keys=True)}")
        print(f"  pod annotations     {json.dumps(pod_info['config'].get('annotations', {}), sort_keys=True)}")
        print(f"  pod cgroup parent   {pod_info['config'].get('linux', {}).get('cgroup_parent', '') or '(none)'}")
        if container_id is None:
            print("  container           none: CreateContainer failed")
            return None
        status = runtime.ContainerStatus(api_pb2.ContainerStatusRequest(container_id=container_id, verbose=True))
    except grpc.RpcError as error:
        print(f"  containerd could not say: {cast(grpc.Call, error).code().name}: {cast(grpc.Call, error).details()}")
        return None
    info = json.loads(status.info["info"])
    config, spec = info["config"], info["runtimeSpec"]
    print(f"  container image     {json.dumps(config.get('image', {}), sort_keys=True)}")
    print(f"  container env       {' '.join(env['key'] + '=' + env.get('value', '') for env in config.get('envs', []))}")
    print(f"  container annotations {json.dumps(config.get('annotations', {}), sort_keys=True)}")
    print(f"  container resources {json.dumps(config.get('linux', {}).get('resources', {}), sort_keys=True)}")
    print(f"  now, after updates  {json.dumps(MessageToDict(status.status.resources.linux), sort_keys=True)}")
    print(f"  runtime spec cpu    {json.dumps(spec['linux']['resources'].get('cpu', {}), sort_keys=True)}")
    print(f"  cgroups path        {spec['linux'].get('cgroupsPath', '')}")
    return resources_in(spec)


if __name__ == "__main__":
    main()
