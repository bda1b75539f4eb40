"""A node laid out under a temporary directory, for ``koordrp check``: kubelet's process as systemd runs it.

kubelet's command line is built from its unit and drop-ins as systemd builds it (systemd.exec(5)):
``Environment=`` assignments in order, ``EnvironmentFile=`` values over ``Environment=`` ones
whatever their order, the last ``ExecStart=`` after a reset, ``$VAR`` split into words. Paths the
files name (``/var/lib/kubelet``, ``/etc/default/kubelet``, ...) are moved under the node's root.
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

from koordrp.defaults import DEFAULT_PROXY_ENDPOINT

ROOT = Path(__file__).resolve().parents[2]
KUBEADM = ROOT / "tests" / "fixtures" / "kubeadm"
DROP_IN = ROOT / "tap" / "kubeadm" / "20-koordrp.conf"
CONTAINERD_SOCKET = "unix:///run/containerd/containerd.sock"

_NODE_PATHS = ("/var/lib/kubelet", "/etc/default/kubelet", "/etc/sysconfig/kubelet", "/etc/kubernetes")


def _assignments(text: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in shlex.split(text) if "=" in word)


def exec_start(unit_files: Sequence[str], read: Mapping[str, str]) -> list[str]:
    """The argv systemd starts a unit's ExecStart= with; ``read`` holds the environment files by path."""
    environment: dict[str, str] = {}
    from_files: dict[str, str] = {}
    command = ""
    for text in unit_files:
        for line in text.splitlines():
            key, _, value = line.partition("=")
            if key == "Environment":
                environment.update(_assignments(value))
            elif key == "EnvironmentFile":
                optional = value.startswith("-")
                path = value.removeprefix("-")
                if path in read:
                    from_files.update(_assignments(read[path]))
                elif not optional:
                    raise FileNotFoundError(path)
            elif key == "ExecStart":
                command = value
    variables = {**environment, **from_files}
    argv: list[str] = []
    for word in shlex.split(command):
        if word.startswith("${") and word.endswith("}"):
            argv.append(variables.get(word[2:-1], ""))
        elif word.startswith("$"):
            argv += variables.get(word[1:], "").split()
        else:
            argv.append(word)
    return argv


class FakeNode:
    def __init__(self, root: Path, koordrp_socket: str) -> None:
        self.root = root
        self.proc = root / "proc"
        self.koordrp_socket = koordrp_socket
        self.proc.mkdir(parents=True, exist_ok=True)
        self._next_pid = 4242

    def rooted(self, text: str) -> str:
        """``text`` with the node's paths moved under the root and koordrp's socket made the test's."""
        for path in _NODE_PATHS:
            text = text.replace(path, f"{self.root}{path}")
        return text.replace(DEFAULT_PROXY_ENDPOINT, self.koordrp_socket)

    def write(self, path: str, text: str) -> str:
        """Write the node's file at ``path``; returns where it is under the root."""
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.rooted(text))
        return str(target)

    def argv(self, pid: int) -> list[str]:
        return [part.decode() for part in (self.proc / str(pid) / "cmdline").read_bytes().split(b"\0") if part]

    def run_kubelet(self, argv: Sequence[str]) -> int:
        pid = self._next_pid
        self._next_pid += 1
        process = self.proc / str(pid)
        process.mkdir()
        (process / "cmdline").write_bytes(b"".join(argument.encode() + b"\0" for argument in argv))
        os.symlink(self.root, process / "cwd")
        return pid

    def shows(self, pid: int) -> None:
        """The node's /proc shows the machine's process ``pid`` (gone when it ends)."""
        os.symlink(f"/proc/{pid}", self.proc / str(pid))

    def run_kubeadm_kubelet(self, drop_ins: Sequence[str], files: Mapping[str, str], package: str = "deb") -> int:
        """kubelet as kubeadm's deb or rpm package runs it: its unit, 10-kubeadm.conf, then ``drop_ins``;
        ``files`` are the node's files by path (kubeadm-flags.env, /etc/default/kubelet, config.yaml, ...)."""
        written = {self.rooted(path): self.write(path, text) for path, text in files.items()}
        kubeadm = (KUBEADM / "10-kubeadm.conf").read_text()
        if package == "rpm":  # the rpm package's drop-in reads its extra arguments from here
            kubeadm = kubeadm.replace("/etc/default/kubelet", "/etc/sysconfig/kubelet")
        units = [(KUBEADM / "kubelet.service").read_text(), kubeadm, *drop_ins]
        read = {path: Path(target).read_text() for path, target in written.items()}
        return self.run_kubelet(exec_start([self.rooted(text) for text in units], read))


def run_check(node: FakeNode, *extra: str) -> tuple[int, str]:
    """``koordrp check`` (the installed command) on ``node``; its exit status and output."""
    command = Path(sys.executable).with_name("koordrp")
    argv = [
        str(command), "check", f"--proc={node.proc}", f"--socket={node.koordrp_socket}",
        f"--hook-config-dir={node.root}/etc/runtime/hookserver.d", f"--containerd-config={node.root}/etc/containerd/config.toml",
        *extra,
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    print(result.stdout)
    return result.returncode, result.stdout
