"""koordrp's Debian package: the repository's files for it laid out beside the virtualenv that
scripts/package built in the suite's own root, its control file, and dpkg-deb."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAP = ROOT / "tap"
DEB = ROOT / "packaging" / "deb"

VENV = "opt/koordrp/venv"
CONFFILE = "etc/default/koordrp"
UNIT = "usr/lib/systemd/system/koordrp.service"
HOOK_CONFIG_DIR = "etc/runtime/hookserver.d"
MAINTAINER = "koordrp maintainers <koordrp@localhost>"

# The repository's files in the package: the unit where systemd finds it (neither enabled nor started),
# tap/'s drop-ins and example registrations where an operator copies them from, the conffile.
FILES: tuple[tuple[Path, str], ...] = (
    (TAP / "koordrp.service", UNIT),
    (TAP / "nri" / "10-nri-mode.conf", "usr/share/koordrp/nri/10-nri-mode.conf"),
    (TAP / "kubeadm" / "20-koordrp.conf", "usr/share/koordrp/kubeadm/20-koordrp.conf"),
    (TAP / "hookserver.d" / "koordlet.json", "usr/share/koordrp/hookserver.d/koordlet.json"),
    (TAP / "hookserver.d" / "cpuset-qos-example.json", "usr/share/koordrp/hookserver.d/cpuset-qos-example.json"),
    (DEB / "default", CONFFILE),
)
LINKS = {"usr/bin/koordrp": f"/{VENV}/bin/koordrp"}
MAINTAINER_SCRIPTS = ("postinst", "prerm", "postrm")

DESCRIPTION = """\
Koordinator's runtime proxy (CRI proxy, NRI plugin), in Python
 koordrp sits on a node between kubelet and containerd: it serves the
 Kubernetes CRI, forwards every call, and around the pod and container
 lifecycle calls the runtime hook servers registered in
 /etc/runtime/hookserver.d (koordlet and others). It also runs as a plugin
 of containerd's NRI, or in front of dockerd for cri-dockerd.
 .
 koordrp runs in a virtualenv of its own, /opt/koordrp/venv: no system
 Python package is touched. The package installs koordrp.service but
 enables and starts nothing; /usr/share/koordrp has the NRI and kubelet
 drop-ins an operator may install."""


def debian_version(version: str, debian: str) -> str:
    """The package's version for Debian ``debian`` (12, 13): one build of each, upgradable in that order."""
    return f"{version}-1+deb{debian}"


@dataclass(frozen=True)
class Control:
    version: str  # debian_version()
    architecture: str
    depends: Sequence[str]
    installed_size: int  # KiB

    def text(self) -> str:
        return (
            "Package: koordrp\n"
            f"Version: {self.version}\n"
            f"Architecture: {self.architecture}\n"
            f"Maintainer: {MAINTAINER}\n"
            f"Installed-Size: {self.installed_size}\n"
            f"Depends: {', '.join(sorted(set(self.depends)))}\n"
            "Section: admin\n"
            "Priority: optional\n"
            f"Description: {DESCRIPTION}\n"
        )


def installed_size(root: Path) -> int:
    """What the package takes on disk, in KiB, as dpkg-gencontrol reckons it: each file's size rounded up to
    a KiB, one for anything else; the control files do not count."""
    total = 0
    for path in root.rglob("*"):
        if path.relative_to(root).parts[0] == "DEBIAN":
            continue
        if path.is_file() and not path.is_symlink():
            total += -(-path.stat().st_size // 1024)
        else:
            total += 1
    return total


def bundled(site_packages: Path) -> list[str]:
    """One line per distribution in the virtualenv: its name, version and license, as its metadata says."""
    lines = []
    for distribution in importlib.metadata.distributions(path=[str(site_packages)]):
        metadata = distribution.metadata

        def field(name: str) -> list[str]:
            return metadata.get_all(name) or []

        classifiers = [c.rsplit(" :: ", 1)[1] for c in field("Classifier") if c.startswith("License ::")]
        stated = [text.split("\n", 1)[0][:60] for text in field("License")]
        # A License field may hold a copyright line or the whole text: the classifiers say it better.
        license = ", ".join(field("License-Expression") or classifiers or stated) or "see its metadata"
        lines.append(f"{metadata['Name']} {distribution.version}: {license}")
    return sorted(lines, key=str.lower)


def copyright_text(bundled_lines: Iterable[str]) -> str:
    listed = "".join(f"   {line}\n" for line in bundled_lines)
    return (
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n"
        "Upstream-Name: koordrp\n"
        "\n"
        "Files: *\n"
        "Copyright: the koordrp authors\n"
        "License: Apache-2.0\n"
        "\n"
        f"Files: {VENV}/*\n"
        "Copyright: the authors of each distribution\n"
        "Comment: the distributions in the virtualenv, each under its own license:\n"
        f"{listed}"
        "\n"
        "License: Apache-2.0\n"
        " On Debian systems, the full text of the Apache License, Version 2.0 is in\n"
        " /usr/share/common-licenses/Apache-2.0.\n"
    )


def lay_out(staging: Path) -> None:
    """Add the repository's files, the hook servers' directory, the link on PATH and the package's own
    files (copyright, maintainer scripts) to ``staging``, which holds the virtualenv."""
    for source, target in FILES:
        path = staging / target
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, path)
        path.chmod(0o644)
    (staging / HOOK_CONFIG_DIR).mkdir(parents=True, exist_ok=True)
    for link, target in LINKS.items():
        (staging / link).parent.mkdir(parents=True, exist_ok=True)
        (staging / link).symlink_to(target)
    site_packages = next((staging / VENV / "lib").glob("python3*/site-packages"))
    doc = staging / "usr/share/doc/koordrp"
    doc.mkdir(parents=True, exist_ok=True)
    (doc / "copyright").write_text(copyright_text(bundled(site_packages)))
    (doc / "copyright").chmod(0o644)
    control = staging / "DEBIAN"
    control.mkdir()
    for script in MAINTAINER_SCRIPTS:
        shutil.copyfile(DEB / script, control / script)
        (control / script).chmod(0o755)
    (control / "conffiles").write_text(f"/{CONFFILE}\n")
    for directory in [staging, *(path for path in staging.rglob("*") if path.is_dir() and not path.is_symlink())]:
        directory.chmod(0o755)


def clamp_mtimes(root: Path, epoch: int) -> None:
    """No file of ``root`` newer than ``epoch`` (SOURCE_DATE_EPOCH): the package's bytes depend on its commit."""
    for path in [root, *root.rglob("*")]:
        if path.lstat().st_mtime > epoch:
            os.utime(path, (epoch, epoch), follow_symlinks=False)


def md5sums(staging: Path) -> str:
    """DEBIAN/md5sums: what `dpkg --verify` checks the installed files against (the conffile has its own)."""
    lines = []
    for path in sorted(staging.rglob("*")):
        name = str(path.relative_to(staging))
        if path.is_file() and not path.is_symlink() and name.split("/")[0] != "DEBIAN" and name != CONFFILE:
            lines.append(f"{hashlib.md5(path.read_bytes()).hexdigest()}  {name}\n")
    return "".join(lines)


def build(staging: Path, control: Control, out_dir: Path, epoch: int) -> Path:
    """Write the control files into the laid-out ``staging`` and make the .deb in ``out_dir``."""
    (staging / "DEBIAN" / "control").write_text(control.text())
    (staging / "DEBIAN" / "md5sums").write_text(md5sums(staging))
    clamp_mtimes(staging, epoch)
    deb = out_dir / f"koordrp_{control.version}_{control.architecture}.deb"
    subprocess.run(
        # zstd: xz would take a minute of the build; Debian 12's dpkg and later read it.
        ["dpkg-deb", "--root-owner-group", "-Zzstd", "-z10", "--build", str(staging), str(deb)],
        check=True, stdout=subprocess.DEVNULL, env={**os.environ, "SOURCE_DATE_EPOCH": str(epoch)},
    )
    return deb
