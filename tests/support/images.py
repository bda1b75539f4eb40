"""Build tiny busybox-based images as docker-archive tars, in pure Python.

The machine has no registry access, so the pause image and the test image are
assembled here from the host's static busybox. Every byte is deterministic
(fixed mtimes, owners, entry order and JSON layout), so the image ids stay the
same from run to run on a given host and tests may compare them.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
import tarfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAUSE_REF = "localhost/koordrp/pause:1"
BUSYBOX_REF = "localhost/koordrp/busybox:1"
BUSYBOX_PATH = Path("/bin/busybox")

# 2000-01-01T00:00:00Z: a fixed, non-zero time, since some tools treat 0 as unset.
FIXED_MTIME = 946684800
FIXED_CREATED = "2000-01-01T00:00:00Z"

IMAGE_LABEL = "io.koordrp.test.image"
DEFAULT_PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# The applets tests are expected to use; a fixed list (rather than
# `busybox --list`) keeps the layer independent of how busybox was configured.
APPLETS: tuple[str, ...] = (
    "[", "ash", "awk", "basename", "cat", "chmod", "cp", "cut", "date", "dd",
    "df", "dirname", "du", "echo", "env", "expr", "false", "find", "free",
    "grep", "head", "hostname", "id", "kill", "ln", "ls", "mkdir", "mkfifo",
    "mount", "mv", "nproc", "printf", "ps", "pwd", "readlink", "rm", "rmdir",
    "sed", "seq", "sh", "sleep", "sort", "stat", "tail", "tee", "test",
    "timeout", "top", "touch", "tr", "true", "uname", "uniq", "wc", "which",
    "whoami", "xargs", "yes",
)

# PID 1 ignores signals it has no handler for, so a bare `sleep` would never
# exit on SIGTERM. The shell traps TERM/INT and `wait` is interruptible by a
# trapped signal; the child sleep is killed explicitly so that nothing is
# orphaned when the pod shares the host PID namespace.
SLEEP_FOREVER_CMD: tuple[str, ...] = (
    "/bin/sh",
    "-c",
    'trap \'kill "$c" 2>/dev/null; exit 0\' TERM INT; sleep inf & c=$!; wait "$c"',
)

PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
)
GROUP = "root:x:0:\nnogroup:x:65534:\n"


@dataclass(frozen=True)
class BuiltImage:
    """One docker-archive tar on disk and the identities containerd will see."""

    ref: str
    archive: Path
    image_id: str  # "sha256:<hex>" of the config blob, as CRI reports it
    diff_id: str  # "sha256:<hex>" of the uncompressed layer


@dataclass(frozen=True)
class ImageSet:
    """The pause and test images; iterable, so it can go to import_images as is."""

    pause: BuiltImage
    busybox: BuiltImage

    def __iter__(self) -> Iterator[BuiltImage]:
        return iter((self.pause, self.busybox))

    @property
    def archives(self) -> tuple[Path, ...]:
        return (self.pause.archive, self.busybox.archive)

    @property
    def refs(self) -> tuple[str, ...]:
        return (self.pause.ref, self.busybox.ref)


def oci_architecture() -> str:
    """Map the host machine name to the OCI architecture containerd matches on."""
    machine = platform.machine()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(machine, machine)


def _fixed_info(name: str, kind: bytes, mode: int, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = size
    info.mtime = FIXED_MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _add_dir(tar: tarfile.TarFile, name: str, mode: int = 0o755) -> None:
    tar.addfile(_fixed_info(name, tarfile.DIRTYPE, mode))


def _add_file(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    tar.addfile(_fixed_info(name, tarfile.REGTYPE, mode, len(data)), io.BytesIO(data))


def _add_symlink(tar: tarfile.TarFile, name: str, target: str) -> None:
    info = _fixed_info(name, tarfile.SYMTYPE, 0o777)
    info.linkname = target
    tar.addfile(info)


def build_rootfs_layer(busybox: Path = BUSYBOX_PATH, applets: Iterable[str] = APPLETS) -> bytes:
    """Return an uncompressed layer tar: busybox, its applet links, minimal /etc."""
    buf = io.BytesIO()
    # USTAR keeps the output free of PAX headers (which would carry variable
    # data such as atime); every name here fits in its 100-byte limit.
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for directory in ("bin", "dev", "etc", "proc", "root", "sys", "usr", "usr/bin", "var"):
            _add_dir(tar, directory, 0o700 if directory == "root" else 0o755)
        _add_dir(tar, "tmp", 0o1777)
        _add_file(tar, "bin/busybox", busybox.read_bytes(), 0o755)
        for applet in sorted(set(applets)):
            # Relative targets keep the links valid wherever the rootfs is mounted.
            _add_symlink(tar, f"bin/{applet}", "busybox")
        _add_file(tar, "etc/passwd", PASSWD.encode())
        _add_file(tar, "etc/group", GROUP.encode())
    return buf.getvalue()


def _canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def image_config(
    diff_id: str,
    cmd: Sequence[str],
    labels: Mapping[str, str],
    env: Sequence[str] = (DEFAULT_PATH_ENV,),
) -> bytes:
    """Return the docker/OCI image config blob for a single-layer image."""
    config = {
        "architecture": oci_architecture(),
        "os": "linux",
        "created": FIXED_CREATED,
        "config": {
            "Cmd": list(cmd),
            "Env": list(env),
            "WorkingDir": "/",
            "Labels": dict(labels),
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": FIXED_CREATED, "created_by": "koordrp tests/support/images.py"}],
    }
    return _canonical_json(config)


def docker_archive(ref: str, layer: bytes, config: bytes) -> bytes:
    """Pack a layer and its config into the `docker save` layout `ctr import` reads."""
    layer_hex = _sha256(layer)
    config_name = f"{_sha256(config)}.json"
    layer_name = f"{layer_hex}/layer.tar"
    manifest = [{"Config": config_name, "RepoTags": [ref], "Layers": [layer_name]}]
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        _add_dir(tar, layer_hex)
        _add_file(tar, layer_name, layer)
        _add_file(tar, config_name, config)
        _add_file(tar, "manifest.json", _canonical_json(manifest))
    return buf.getvalue()


def build_image_archive(
    path: Path,
    ref: str,
    cmd: Sequence[str],
    *,
    layer: bytes | None = None,
    busybox: Path = BUSYBOX_PATH,
) -> BuiltImage:
    """Write a docker-archive tar for `ref` to `path`; return what it contains."""
    if layer is None:
        layer = build_rootfs_layer(busybox)
    diff_id = f"sha256:{_sha256(layer)}"
    # The ref is a label so that two images sharing a layer and command still
    # get distinct ids: CRI RemoveImage drops every tag of an id, so a shared id
    # would make removing the test image silently remove the pause image too.
    config = image_config(diff_id, cmd, {IMAGE_LABEL: ref})
    data = docker_archive(ref, layer, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename so a concurrent reader never imports a half-written tar.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return BuiltImage(ref=ref, archive=path, image_id=f"sha256:{_sha256(config)}", diff_id=diff_id)


def build_test_images(out_dir: Path, busybox: Path = BUSYBOX_PATH) -> ImageSet:
    """Build the pause image and the busybox test image into `out_dir`."""
    layer = build_rootfs_layer(busybox)
    pause = build_image_archive(out_dir / "pause.tar", PAUSE_REF, SLEEP_FOREVER_CMD, layer=layer)
    test = build_image_archive(out_dir / "busybox.tar", BUSYBOX_REF, SLEEP_FOREVER_CMD, layer=layer)
    return ImageSet(pause=pause, busybox=test)
