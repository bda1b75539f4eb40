"""``koordrp check``: is this node set up so that kubelet's calls go through koordrp, and to what effect?

It reads the node as it is and prints one line per finding, ✓ or ✗ with what to do, and exits 1 when
anything is ✗:

- the running kubelet's runtime and image endpoints, as kubelet itself decides them: from its
  command line (``/proc/<pid>/cmdline``: the last of a flag given twice wins) over the config file
  it names (``containerRuntimeEndpoint``, ``imageServiceEndpoint``) over kubelet's default;
- whether koordrp answers on its socket, and its runtime behind it;
- each hookserver.d file, read by koordrp's own parser and rules, and whether its socket accepts a
  connection;
- containerd's NRI while hook servers are registered: koordlet's hooks would run twice.

With ``--backend-runtime-mode=NRI`` it checks an NRI node instead: kubelet calling containerd, not
koordrp's socket; containerd's NRI socket accepting plugins; koordrp registered there (what it
says in ``<state-dir>/nri-plugin.json``, from a live process); anything that koordrp is given beyond
what NRI mode needs (an option it does not use; in a container, a mount beyond its NRI socket's
directory, hookserver.d, its state directory and the hook servers' socket directories, or a
capability: run it there, ``kubectl exec``); each hook server whose timeout is longer than what its
pre hooks get of containerd's ``plugin_request_timeout``. In either mode, a koordrp of the other
mode on the same node is a ✗: every hook would run twice.

Every path it reads is an option. ``python -m koordrp.check`` runs it too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tomllib
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import grpc
from twisted.python import usage

from koordrp import koordrp_version, trust
from koordrp.api.cri.v1 import api_pb2 as cri
from koordrp.defaults import (
    DEFAULT_HOOK_CONFIG_DIR,
    DEFAULT_HOOK_TIMEOUT,
    DEFAULT_NRI_SOCKET,
    DEFAULT_PROXY_ENDPOINT,
    DEFAULT_STATE_DIR,
    RUNTIME_MODES,
    Options,
)
from koordrp.hooks.limit import ANSWER_MARGIN, SHORTEN, pre_hook_limit
from koordrp.hooks.registry import Rejection, describe, list_registrations, read_registration, understand
from koordrp.hooks.types import HookServerConfig, HookServers
from koordrp.nri import registration
from koordrp.unix import EndpointError, connect_error, grpc_target, parse_unix_endpoint, socket_problem

RUNTIME_FLAG = "--container-runtime-endpoint"
IMAGE_FLAG = "--image-service-endpoint"
RUNTIME_KEY = "containerRuntimeEndpoint"
IMAGE_KEY = "imageServiceEndpoint"
# kubelet's own default since 1.27, when neither flag nor config file says.
KUBELET_DEFAULT_RUNTIME = "unix:///run/containerd/containerd.sock"
NRI_PLUGIN = "io.containerd.nri.v1.nri"

OK_MARK = "✓"
NOT_OK_MARK = "✗"


@dataclass(frozen=True)
class Finding:
    ok: bool
    text: str
    fix: str = ""

    def line(self) -> str:
        mark = OK_MARK if self.ok else NOT_OK_MARK
        return f"{mark} {self.text}" + (f"\n    → {self.fix}" if self.fix else "")


# ---------------------------------------------------------------------------------------------
# kubelet


@dataclass(frozen=True)
class Endpoint:
    value: str
    source: str
    """Where kubelet took it from, in words an operator can look up."""


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The value kubelet takes for ``flag``: the last one given (``--flag=value`` or ``--flag value``)."""
    found = None
    for index, argument in enumerate(argv):
        if argument.startswith(flag + "="):
            found = argument[len(flag) + 1 :]
        elif argument == flag and index + 1 < len(argv):
            found = argv[index + 1]
    return found


def config_values(text: str) -> dict[str, str]:
    """The top-level scalar settings of a kubelet config file (YAML or JSON) that are plain strings.

    Only ``key: value`` lines at the top level are read: the two endpoints are top-level strings,
    and no YAML library is needed for them.
    """
    if text.lstrip().startswith("{"):
        document = json.loads(text)
        return {key: value for key, value in document.items() if isinstance(value, str)}
    values: dict[str, str] = {}
    for line in text.splitlines():
        if not line or line[0] in " \t#-" or ":" not in line:
            continue
        key, _, value = line.partition(":")
        value = value.split(" #", 1)[0].strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if value:
            values[key.strip()] = value
    return values


def kubelet_endpoints(argv: Sequence[str], read: Callable[[str], str]) -> tuple[Endpoint, Endpoint]:
    """The runtime and image endpoints kubelet uses with this command line (``read`` reads its config file)."""
    config: dict[str, str] = {}
    config_path = flag_value(argv, "--config")
    if config_path:
        config = config_values(read(config_path))

    def decide(flag: str, key: str, default: Endpoint | None) -> Endpoint | None:
        value = flag_value(argv, flag)
        if value:
            return Endpoint(value, f"its flag {flag}")
        if config.get(key):
            return Endpoint(config[key], f"its config file {config_path}, {key}")
        return default

    runtime = decide(RUNTIME_FLAG, RUNTIME_KEY, Endpoint(KUBELET_DEFAULT_RUNTIME, "kubelet's default"))
    assert runtime is not None
    image = decide(IMAGE_FLAG, IMAGE_KEY, None) or Endpoint(runtime.value, f"as the runtime endpoint: {runtime.source}")
    return runtime, image


def same_socket(endpoint: str, socket_path: str) -> bool:
    try:
        path = parse_unix_endpoint(endpoint)
    except EndpointError:
        return False
    # /var/run is /run on every systemd distribution.
    return _canonical(path) == _canonical(socket_path)


def _canonical(path: str) -> str:
    return "/run/" + path[len("/var/run/") :] if path.startswith("/var/run/") else path


def kubelet_processes(proc: str) -> Iterator[tuple[int, list[str]]]:
    for name in sorted(os.listdir(proc)):
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "cmdline"), "rb") as stream:
                raw = stream.read()
        except OSError:
            continue
        argv = [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]
        if argv and os.path.basename(argv[0]) == "kubelet":
            yield int(name), argv


def _kubelet_endpoint_findings(proc: str, judged: Callable[[int, str, Endpoint], Finding]) -> list[Finding]:
    """A finding per kubelet process and endpoint (runtime, image), as ``judged(pid, what, endpoint)`` says."""
    found = list(kubelet_processes(proc))
    if not found:
        return [Finding(False, f"no kubelet process found in {proc}", "start kubelet, then check again")]
    findings = []
    for pid, argv in found:
        try:
            runtime, image = kubelet_endpoints(argv, _reader(proc, pid))
        except (OSError, ValueError) as error:
            findings.append(Finding(False, f"kubelet (pid {pid}): cannot read its config file: {error}"))
            continue
        findings += [judged(pid, what, endpoint) for what, endpoint in (("runtime", runtime), ("image", image))]
    return findings


def kubelet_findings(proc: str, socket_path: str) -> list[Finding]:
    wanted = "unix://" + socket_path

    def judged(pid: int, what: str, endpoint: Endpoint) -> Finding:
        kubelet = f"kubelet (pid {pid}) sends {what} calls to"
        if same_socket(endpoint.value, socket_path):
            return Finding(True, f"{kubelet} koordrp, {wanted} ({endpoint.source})")
        return Finding(False, f"{kubelet} {endpoint.value} ({endpoint.source}), not to koordrp at {wanted}", _endpoint_fix(endpoint))

    return _kubelet_endpoint_findings(proc, judged)


def kubelet_nri_findings(proc: str, socket_path: str, beside_koordrp: bool = False) -> list[Finding]:
    """In NRI mode kubelet calls containerd itself: koordrp's proxy socket is no place for its calls.
    ``beside_koordrp``: the check runs in koordrp's container, where the node's processes are not seen."""
    if beside_koordrp and not any(kubelet_processes(proc)):
        return [Finding(True, "kubelet is not seen from koordrp's container; in NRI mode it calls containerd itself")]

    def judged(pid: int, what: str, endpoint: Endpoint) -> Finding:
        kubelet = f"kubelet (pid {pid}) sends {what} calls to {endpoint.value} ({endpoint.source})"
        if same_socket(endpoint.value, socket_path):
            return Finding(
                False,
                f"{kubelet}: koordrp's proxy socket, but koordrp runs as containerd's NRI plugin",
                "point kubelet at containerd again (remove koordrp's kubelet drop-in, "
                "tap/kubeadm/20-koordrp.conf), then restart kubelet",
            )
        return Finding(True, f"{kubelet}, which calls koordrp through NRI")

    return _kubelet_endpoint_findings(proc, judged)


def _reader(proc: str, pid: int) -> Callable[[str], str]:
    def read(path: str) -> str:
        cwd = os.path.join(proc, str(pid), "cwd")
        where = path if os.path.isabs(path) else os.path.join(os.readlink(cwd), path)
        with open(where, encoding="utf-8") as stream:
            return stream.read()

    return read


def _endpoint_fix(endpoint: Endpoint) -> str:
    if "its flag" in endpoint.source:
        return (
            "a flag on kubelet's command line decides: on kubeadm nodes install tap/kubeadm/20-koordrp.conf "
            "(its flags come last and win), elsewhere change the flag in kubelet's unit; then restart kubelet"
        )
    if "its config file" in endpoint.source:
        return "set containerRuntimeEndpoint and imageServiceEndpoint to koordrp's socket there, then restart kubelet"
    return "set kubelet's endpoints to koordrp's socket (see docs/operating/kubelet.md, \"Point kubelet at koordrp\"), then restart kubelet"


# ---------------------------------------------------------------------------------------------
# koordrp and its runtime


def koordrp_findings(socket_path: str, timeout: float) -> list[Finding]:
    target = "unix://" + socket_path
    if not os.path.exists(socket_path):
        return [Finding(False, f"nothing listens at {target}: no socket there", "systemctl status koordrp")]
    with grpc.insecure_channel(grpc_target(socket_path)) as channel:
        version = channel.unary_unary(
            "/runtime.v1.RuntimeService/Version",
            request_serializer=cri.VersionRequest.SerializeToString,
            response_deserializer=cri.VersionResponse.FromString,
        )
        try:
            answer = version(cri.VersionRequest(), timeout=timeout)
        except grpc.RpcError as error:
            call: grpc.Call = error  # type: ignore[assignment]
            details = call.details() or ""
            if details.startswith("koordrp: backend"):
                return [
                    Finding(True, f"koordrp answers at {target}"),
                    Finding(False, details.removeprefix("koordrp: "), "systemctl status containerd"),
                ]
            answer_problem = f"{target} does not answer: {call.code().name}: {details}"
            return [Finding(False, answer_problem, "systemctl status koordrp")]
    runtime = f"{answer.runtime_name} {answer.runtime_version}".strip()
    return [Finding(True, f"koordrp answers at {target}, and its runtime behind it ({runtime})")]


# ---------------------------------------------------------------------------------------------
# Hook servers


def hook_findings(directory: str, default_timeout: float, timeout: float) -> tuple[list[Finding], list[HookServerConfig]]:
    """A finding per registration, as koordrp reads it; and the servers koordrp would register."""
    refused = trust.directory_problem(os.path.abspath(directory))
    if refused is not None:
        return [Finding(False, f"{directory} is not trusted: {refused}; koordrp reads none of its registrations", _FIX_DIRECTORY)], []
    listing = list_registrations(directory)
    if listing is None:
        return [Finding(True, f"no hook server is registered ({directory} does not exist)")], []
    findings: list[Finding] = []
    registered: list[HookServerConfig] = []
    for name in sorted(listing):
        path = os.path.join(directory, name)
        found = listing[name]
        understood = understand(name, found if isinstance(found, Rejection) else read_registration(path), default_timeout)
        if understood is None:
            continue
        if isinstance(understood, Rejection):
            findings.append(Finding(False, f"{path} is rejected: {understood.reason}", _FIX_FILE))
            continue
        registered.append(understood.config)
        summary = describe(HookServers((understood.config,)))
        distrust = trust.socket_trust(understood.config.endpoint).problem
        if distrust is not None:  # not connected to: whoever serves it is not known
            findings.append(Finding(False, f"{path} registers {summary}; koordrp does not call it: {distrust}", _FIX_SOCKET))
            continue
        problem = _unreachable(understood.config.endpoint, timeout)
        if problem is None:
            findings.append(Finding(True, f"{path} registers {summary}; its socket accepts connections"))
        else:
            findings.append(Finding(False, f"{path} registers {summary}; {problem}", _FIX_SERVER))
    if not findings:
        findings.append(Finding(True, f"no hook server is registered in {directory}"))
    return findings, registered


_FIX_FILE = "fix the file: koordrp keeps its last good version, or none"
_FIX_SERVER = "start the hook server, or remove its file"
_FIX_SOCKET = (
    "serve the socket as root from a directory only root may write (as /var/run/koordlet/, 0755), "
    "or register the path of such a socket"
)
_FIX_DIRECTORY = "make it and each directory above it root's and not writable by group or others (chown root, chmod go-w)"


def _unreachable(path: str, timeout: float) -> str | None:
    error = connect_error(path, timeout)
    return None if error is None else f"its socket does not accept connections: {error.strerror or error}"


# ---------------------------------------------------------------------------------------------
# containerd's NRI


def nri_enabled(config_text: str) -> bool:
    """Whether containerd's NRI plugin runs with this config: on by default from config version 3 (containerd 2)."""
    document = tomllib.loads(config_text)
    plugins = document.get("plugins", {})
    nri = plugins.get(NRI_PLUGIN, {}) if isinstance(plugins, dict) else {}
    disable = nri.get("disable") if isinstance(nri, dict) else None
    if isinstance(disable, bool):
        return not disable
    version = document.get("version", 1)
    return isinstance(version, int) and version >= 3


def go_duration(text: str) -> float:
    """The seconds a Go duration says ("2s", "1m30s", "500ms"), as containerd's config writes them."""
    parts = re.findall(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)", text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise ValueError(f"{text!r} is not a duration")
    return sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)


_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
DEFAULT_PLUGIN_REQUEST_TIMEOUT = 2.0
"""NRI's own default for plugin_request_timeout."""


def nri_deadline_findings(config_path: str, servers: Sequence[HookServerConfig]) -> list[Finding]:
    """In NRI mode: whether each server's timeout fits in what containerd gives a plugin's call, less koordrp's margin."""
    try:
        with open(config_path, encoding="utf-8") as stream:
            document = tomllib.loads(stream.read())
        plugins = document.get("plugins", {})
        nri = plugins.get(NRI_PLUGIN, {}) if isinstance(plugins, dict) else {}
        said = nri.get("plugin_request_timeout") if isinstance(nri, dict) else None
        where = f"plugin_request_timeout in {config_path}"
        if said is None:
            seconds, where = DEFAULT_PLUGIN_REQUEST_TIMEOUT, f"NRI's default: {config_path} sets no plugin_request_timeout"
        else:
            seconds = go_duration(str(said))
    except FileNotFoundError:
        seconds, where = DEFAULT_PLUGIN_REQUEST_TIMEOUT, f"NRI's default: there is no {config_path}"
    except (OSError, tomllib.TOMLDecodeError, ValueError) as error:
        return [Finding(False, f"cannot read plugin_request_timeout in containerd's config {config_path}: {error}")]
    limit = pre_hook_limit(seconds)
    slow = [server for server in servers if limit.exceeded_by(server)]
    if not slow:
        return [
            Finding(
                True,
                f"containerd's NRI gives each call {seconds:g}s ({where}): every hook server's pre hooks fit in the "
                f"{limit.seconds:g}s koordrp gives them",
            )
        ]
    return [
        Finding(
            False,
            f"hook server {server.name} may take {server.timeout:g}s to answer, but its pre hooks get {limit.seconds:g}s: "
            f"containerd's NRI gives each call {seconds:g}s ({where}) and koordrp keeps {ANSWER_MARGIN:g}s of it to answer",
            f"set {SHORTEN} to {limit.seconds:g} or less, or {limit.remedy}",
        )
        for server in slow
    ]


def nri_findings(config_path: str, hook_servers: int) -> list[Finding]:
    try:
        with open(config_path, encoding="utf-8") as stream:
            enabled = nri_enabled(stream.read())
    except FileNotFoundError:
        return [Finding(True, f"no containerd config at {config_path}: NRI is as containerd's defaults leave it")]
    except (OSError, tomllib.TOMLDecodeError) as error:
        return [Finding(False, f"cannot read containerd's config {config_path}: {error}")]
    if not enabled:
        return [Finding(True, f"containerd's NRI is disabled ({config_path})")]
    if not hook_servers:
        return [Finding(True, f"containerd's NRI is enabled ({config_path}); no hook server is registered with koordrp")]
    return [
        Finding(
            False,
            f"containerd's NRI is enabled ({config_path}) while {hook_servers} hook server(s) are registered with "
            "koordrp: a plugin such as koordlet would run the same hooks twice, in NRI and through koordrp",
            'run one or the other: disable NRI ([plugins."io.containerd.nri.v1.nri"] disable = true) or koordlet\'s '
            "(-enable-nri-runtime-hook=false), or do not use koordrp",
        )
    ]


# ---------------------------------------------------------------------------------------------
# koordrp as containerd's NRI plugin


def live_registration(proc: str, state_dir: str) -> registration.Registration | None:
    """What an NRI-mode koordrp says of its registration, if its process still lives (and is a koordrp)."""
    said = registration.read(state_dir)
    if said is None:
        return None
    try:
        with open(os.path.join(proc, str(said.pid), "cmdline"), "rb") as cmdline:
            command = cmdline.read()
    except OSError:
        return None
    return said if b"koordrp" in command else None


# What a container runtime mounts into every container, which gives nothing of the node's.
_CONTAINER_OWN = frozenset(("/", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/dev/termination-log"))
_CONTAINER_OWN_TREES = ("/proc", "/sys", "/dev")


def koordrp_arguments(cmdline: bytes) -> list[str]:
    """koordrp's own options on a command line (``twistd [twistd's options] koordrp [koordrp's options]``)."""
    words = [word.decode("utf-8", "surrogateescape") for word in cmdline.split(b"\0") if word]
    return words[words.index("koordrp") + 1 :] if "koordrp" in words else []


def mount_points(mountinfo: str) -> list[str]:
    """Where each mount of a /proc/<pid>/mountinfo is (the kernel writes a space, tab, newline or backslash in octal)."""
    points = []
    for line in mountinfo.splitlines():
        fields = line.split(" ")
        if len(fields) > 4:
            points.append(re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), fields[4]))
    return points


def in_container(proc: str, pid: int) -> bool:
    """Whether process ``pid`` runs in a container: the first of its own process namespace, or in a mount
    namespace that is not the first process's."""
    if pid == 1:
        return True
    try:
        return os.readlink(os.path.join(proc, str(pid), "ns", "mnt")) != os.readlink(os.path.join(proc, "1", "ns", "mnt"))
    except OSError:
        return False


def reach_findings(proc: str, said: registration.Registration, servers: Sequence[HookServerConfig]) -> list[Finding]:
    """In NRI mode: whether the live koordrp is given more of the node than NRI mode needs (its NRI socket's
    directory, hookserver.d, its state directory and the hook servers' socket directories): an option it
    does not use, a mount of its container beyond those, a capability."""
    base = os.path.join(proc, str(said.pid))
    options = Options()  # type: ignore[no-untyped-call]
    try:
        with open(os.path.join(base, "cmdline"), "rb") as cmdline:
            options.parseOptions(koordrp_arguments(cmdline.read()))  # type: ignore[no-untyped-call]
    except (OSError, usage.UsageError, SystemExit) as error:
        return [Finding(False, f"cannot read koordrp's options (pid {said.pid}): {error}")]
    findings = [
        Finding(False, f"koordrp (pid {said.pid}) is given {flag}, which NRI mode does not use", f"drop {flag} from its arguments")
        for flag in options.unused()
    ]
    if not in_container(proc, said.pid):
        return findings
    # As the kernel names mount points: with links resolved (/var/run is /run). Run beside koordrp, check
    # resolves them in koordrp's own root.
    needed = {
        os.path.realpath(path)
        for path in (
            os.path.dirname(options["nri-socket"]),
            options["hook-config-dir"],
            options["state-dir"],
            *(os.path.dirname(server.endpoint) for server in servers),
        )
    }
    try:
        with open(os.path.join(base, "mountinfo"), encoding="utf-8", errors="surrogateescape") as mountinfo:
            points = {os.path.realpath(point) for point in mount_points(mountinfo.read())}
        with open(os.path.join(base, "status"), encoding="utf-8") as status:
            capabilities = next((int(line.split()[1], 16) for line in status if line.startswith("CapEff:")), 0)
    except OSError as error:
        return [*findings, Finding(False, f"cannot read koordrp's mounts and capabilities (pid {said.pid}): {error.strerror}")]
    # What is mounted inside a directory koordrp needs (the runtime's mounts it propagates) gives no more of the node.
    within = (*_CONTAINER_OWN_TREES, *needed)
    extra = sorted(
        point
        for point in points - _CONTAINER_OWN
        if not any(point == tree or point.startswith(tree + "/") for tree in within)
    )
    if extra:
        findings.append(
            Finding(
                False,
                f"koordrp's container mounts {', '.join(extra)}: more than NRI mode needs ({', '.join(sorted(needed))})",
                "drop those volumes and volumeMounts from its pod (deploy/daemonset.yaml mounts only what it needs)",
            )
        )
    else:
        findings.append(Finding(True, f"koordrp's container mounts only what NRI mode needs: {', '.join(sorted(needed & points))}"))
    if capabilities:
        findings.append(
            Finding(
                False,
                f"koordrp runs with capabilities (CapEff {capabilities:#x}) that NRI mode does not use",
                "drop: [ALL] in its container's securityContext",
            )
        )
    return findings


def nri_plugin_findings(said: registration.Registration | None, nri_socket: str, state_dir: str) -> list[Finding]:
    """``said``: what the live koordrp says of its registration."""
    findings = []
    # Not connected to: containerd logs an error for every connection that does not register.
    problem = socket_problem(nri_socket)
    if problem is None:
        findings.append(Finding(True, f"containerd's NRI socket is at {nri_socket}"))
    else:
        findings.append(
            Finding(
                False,
                f"containerd's NRI: {problem}",
                'NRI needs containerd 1.7 or later with [plugins."io.containerd.nri.v1.nri"] disable = false in its '
                "config (docs/operating/nri-mode.md, \"Install\"); restart containerd",
            )
        )
    if said is None:
        findings.append(
            Finding(
                False,
                f"koordrp is not registered with containerd's NRI (nothing live in {state_dir}/{registration.FILE_NAME})",
                "systemctl status koordrp: it must run with --backend-runtime-mode=NRI and this --state-dir",
            )
        )
    else:
        findings.append(
            Finding(True, f"koordrp (pid {said.pid}) is plugin {said.plugin} of {said.runtime} at {said.socket} since {said.since}")
        )
    return findings


_ONE_MODE = "run one koordrp per node, in one mode: stop the other"


def proxy_too_findings(socket_path: str, timeout: float) -> list[Finding]:
    """In NRI mode: a koordrp proxy on the node as well would run every hook a second time."""
    if connect_error(socket_path, timeout) is not None:
        return []
    return [Finding(False, f"a koordrp proxy listens at unix://{socket_path} too: with both modes every hook runs twice", _ONE_MODE)]


def nri_too_findings(proc: str, state_dir: str) -> list[Finding]:
    """In proxy mode: a koordrp registered with containerd's NRI as well would run every hook a second time."""
    said = live_registration(proc, state_dir)
    if said is None:
        return []
    return [
        Finding(
            False,
            f"koordrp (pid {said.pid}) is also plugin {said.plugin} of containerd's NRI: with both modes every hook runs twice",
            _ONE_MODE,
        )
    ]


# ---------------------------------------------------------------------------------------------
# The command


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="koordrp check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"koordrp {koordrp_version()}")
    parser.add_argument("--proc", default="/proc", help="where to look for kubelet's process [%(default)s]")
    parser.add_argument(
        "--backend-runtime-mode", choices=RUNTIME_MODES, default="Containerd", help="koordrp's mode [%(default)s]"
    )
    parser.add_argument("--socket", default=DEFAULT_PROXY_ENDPOINT, help="koordrp's socket [%(default)s]")
    parser.add_argument("--nri-socket", default=DEFAULT_NRI_SOCKET, help="NRI mode: containerd's NRI socket [%(default)s]")
    parser.add_argument("--state-dir", default=DEFAULT_STATE_DIR, help="koordrp's --state-dir [%(default)s]")
    parser.add_argument("--hook-config-dir", default=DEFAULT_HOOK_CONFIG_DIR, help="[%(default)s]")
    parser.add_argument("--containerd-config", default="/etc/containerd/config.toml", help="[%(default)s]")
    parser.add_argument(
        "--hook-timeout", type=float, default=DEFAULT_HOOK_TIMEOUT, help="koordrp's --hook-timeout [%(default)s]"
    )
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for each answer [%(default)s]")
    return parser


def check(options: argparse.Namespace) -> list[Finding]:
    try:
        socket_path = parse_unix_endpoint(options.socket)
    except EndpointError as error:
        raise SystemExit(f"koordrp check: --socket: {error}") from None
    hooks, registered = hook_findings(options.hook_config_dir, options.hook_timeout, options.timeout)
    if options.backend_runtime_mode == "NRI":
        said = live_registration(options.proc, options.state_dir)
        return [
            # koordrp the first process of check's process namespace: check runs in its container (kubectl exec).
            *kubelet_nri_findings(options.proc, socket_path, beside_koordrp=said is not None and said.pid == 1),
            *nri_plugin_findings(said, options.nri_socket, options.state_dir),
            *([] if said is None else reach_findings(options.proc, said, registered)),
            *proxy_too_findings(socket_path, options.timeout),
            *hooks,
            *nri_deadline_findings(options.containerd_config, registered),
        ]
    return [
        *kubelet_findings(options.proc, socket_path),
        *koordrp_findings(socket_path, options.timeout),
        *nri_too_findings(options.proc, options.state_dir),
        *hooks,
        *nri_findings(options.containerd_config, len(registered)),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    findings = check(parser().parse_args(argv))
    for finding in findings:
        print(finding.line())
    return 0 if all(finding.ok for finding in findings) else 1


def command(argv: Sequence[str] | None = None) -> int:
    """The ``koordrp`` console script: ``koordrp check [options]``, ``koordrp --version``."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["--version"]:
        print(f"koordrp {koordrp_version()}")
        return 0
    if arguments[:1] != ["check"]:
        print("usage: koordrp check [options]  (koordrp itself runs as: twistd -n koordrp)", file=sys.stderr)
        return 2
    return main(arguments[1:])


if __name__ == "__main__":
    sys.exit(main())
