"""``scripts/package [OUTPUT_DIR]``: koordrp's packages, built from this checkout into dist/ (or OUTPUT_DIR).

- ``koordrp-VERSION-py3-none-any.whl`` and ``koordrp-VERSION.tar.gz`` (``python -m build``);
- ``koordrp_VERSION-1+deb12_ARCH.deb`` and ``koordrp_VERSION-1+deb13_ARCH.deb`` for amd64 and arm64:
  koordrp in a virtualenv of its own, /opt/koordrp/venv, made in a fresh root of that Debian suite and
  architecture (mmdebstrap) from the wheel and its dependencies' wheels for that machine at the versions
  packaging/constraints.txt pins (packaging/deb/build-venv); with the unit, tap/'s drop-ins,
  /etc/runtime/hookserver.d and a conffile (scripts/debian_package.py);
- ``koordrp_VERSION.oci.tar``: an OCI image for linux/amd64 and linux/arm64, each the root Debian 13's
  .deb of that architecture was built in: Debian's essential packages, Python and koordrp's virtualenv,
  slimmed (scripts/oci_archive.py); entrypoint ``twistd -n --pidfile= --logfile=- koordrp``, so that a
  container's arguments are koordrp's options;
- ``SHA256SUMS`` of them.

A root of an architecture other than the machine's is built under emulation, Debian's qemu-user-static
registered with binfmt_misc for the while (scripts/emulation.py).

The version is setup.cfg's, the only place that names it. Debian's packages come from the mirror the
machine's apt sources name (scripts/debian-mirror), Python's from the index pip is set up with here.
Every file is dated SOURCE_DATE_EPOCH at the latest (default: the commit's time): the same commit and
the same mirror give the same packages.
"""

from __future__ import annotations

import configparser
import gzip
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from koordrp.defaults import RUNTIME_MODES
from scripts import debian_package, emulation
from scripts.oci_archive import Image, write_oci_archive

ROOT = Path(__file__).resolve().parents[1]
PACKAGING = ROOT / "packaging"
PYTHON = Path(sys.executable)

IMAGE_NAME = "localhost/koordrp"
ENTRYPOINT = ("twistd", "-n", "--pidfile=", "--logfile=-", "koordrp")
IMAGE_PATH = f"PATH=/{debian_package.VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Documentation, manual pages and translations stay out of the image; copyright notices stay in.
SLIM = tuple(f"--dpkgopt=path-{rule}" for rule in (
    "exclude=/usr/share/doc/*",
    "include=/usr/share/doc/*/copyright",
    "exclude=/usr/share/man/*",
    "exclude=/usr/share/info/*",
    "exclude=/usr/share/locale/*",
))
# ctr runs what follows a container's id in place of the image's entrypoint, its first word as a command:
# koordrp's mode flags are commands on the image's PATH (packaging/image/koordrp-options), so that
# `ctr run IMAGE ID --backend-runtime-mode=NRI ...` is koordrp with those options, as elsewhere.
OPTIONS_COMMAND = "/usr/local/bin/koordrp-options"
MODE_FLAGS = tuple(f"--backend-runtime-mode={mode}" for mode in RUNTIME_MODES)

# And once the virtualenv is out for the .deb: Twisted's own tests (20 MB), and whatever is apt's or the
# build machine's (no apt runs in the image).
IMAGE_TIDY = " ".join((
    "rm -rf",
    f'"$1"/{debian_package.VENV}/lib/python3*/site-packages/twisted/test',
    f'"$1"/{debian_package.VENV}/lib/python3*/site-packages/twisted/*/test',
    '"$1"/etc/apt "$1"/var/lib/apt "$1"/var/cache/apt "$1"/etc/dpkg/dpkg.cfg.d/99mmdebstrap',
    '"$1"/etc/resolv.conf "$1"/etc/hostname',
))


@dataclass(frozen=True)
class Suite:
    """A Debian release koordrp is packaged for, and the Python its virtualenv runs on there."""

    codename: str
    number: str
    python: str  # "3.13"
    glibc_minor: int  # its glibc is 2.<this>: the newest manylinux wheel it runs

    @property
    def interpreter(self) -> str:
        return f"python{self.python}"


SUITES = (Suite("bookworm", "12", "3.11", 36), Suite("trixie", "13", "3.13", 41))
IMAGE_SUITE = SUITES[-1]


@dataclass(frozen=True)
class Architecture:
    """A machine koordrp is packaged for."""

    debian: str  # Debian's name, OCI's too: amd64
    machine: str  # the kernel's name, qemu's and the wheels' platform tags' too: x86_64


ARCHITECTURES = (Architecture("amd64", "x86_64"), Architecture("arm64", "aarch64"))


STARTED = time.monotonic()


def say(text: str) -> None:
    print(f"package: {time.monotonic() - STARTED:5.0f} s  {text}", file=sys.stderr, flush=True)


def run(argv: Sequence[str | Path], quiet: bool = False, **options: Any) -> None:
    """Run a command; ``quiet``: show what it said only if it fails."""
    command = [str(arg) for arg in argv]
    if not quiet:
        subprocess.run(command, check=True, **options)
        return
    result = subprocess.run(command, capture_output=True, text=True, **options)
    if result.returncode != 0:
        sys.stderr.write(result.stdout + result.stderr)
        raise subprocess.CalledProcessError(result.returncode, command)


def project_version() -> str:
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    return setup["metadata"]["version"]


def source_date_epoch() -> int:
    if "SOURCE_DATE_EPOCH" in os.environ:
        return int(os.environ["SOURCE_DATE_EPOCH"])
    found = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%ct"], capture_output=True, text=True)
    if found.returncode != 0 or not found.stdout.strip():
        raise SystemExit("package: not a git checkout: set SOURCE_DATE_EPOCH to the time the packages carry")
    return int(found.stdout)


def debian_architecture() -> str:
    return subprocess.run(["dpkg", "--print-architecture"], check=True, capture_output=True, text=True).stdout.strip()


def mirrors(suite: Suite) -> list[str]:
    """mmdebstrap's sources: the suite and its updates on the machine's mirror, and its security updates."""
    main = subprocess.run([ROOT / "scripts/debian-mirror"], check=True, capture_output=True, text=True).stdout.strip()
    sources = [f"deb {main} {suite.codename} main", f"deb {main} {suite.codename}-updates main"]
    security = subprocess.run(
        [ROOT / "scripts/debian-mirror", "--security"], check=True, capture_output=True, text=True
    ).stdout.strip()
    if security:
        sources.append(f"deb {security} {suite.codename}-security main")
    return sources


def build_python(out: Path, epoch: int) -> Path:
    """The sdist, and the wheel built from it, in ``out``: the wheel."""
    run([PYTHON, "-m", "build", "--outdir", out, ROOT], quiet=True, env={**os.environ, "SOURCE_DATE_EPOCH": str(epoch)})
    clamp_tarball(out / f"koordrp-{project_version()}.tar.gz", epoch)
    [wheel] = out.glob(f"koordrp-{project_version()}-*.whl")
    return wheel


def clamp_tarball(path: Path, epoch: int) -> None:
    """No member of the .tar.gz dated after ``epoch``, nor the gzip: setuptools dates what it makes for the
    sdist (PKG-INFO, its directories) at the time of the build. The same bytes from the same commit."""
    clamped = path.with_name(path.name + ".partial")
    with tarfile.open(path) as source, clamped.open("wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=epoch) as packed, tarfile.open(
            fileobj=packed, mode="w", format=tarfile.PAX_FORMAT
        ) as target:
            for member in source.getmembers():
                member.mtime = min(int(member.mtime), epoch)
                member.pax_headers = {k: v for k, v in member.pax_headers.items() if k not in ("mtime", "atime", "ctime")}
                target.addfile(member, source.extractfile(member) if member.isfile() else None)
    clamped.replace(path)


def download_wheels(wheel: Path, suite: Suite, machine: str, dest: Path) -> None:
    """The wheels of koordrp's dependencies for the suite's Python on ``machine`` (aarch64), at the pinned
    versions, and pip's."""
    tag = "cp" + suite.python.replace(".", "")
    # Every manylinux tag the suite's glibc runs, the legacy names of 2.5, 2.12 and 2.17 too.
    legacy = ["manylinux1", "manylinux2010", "manylinux2014"]
    platforms = [f"manylinux_2_{minor}" for minor in range(5, suite.glibc_minor + 1)] + legacy
    run([
        PYTHON, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary=:all:",
        f"--python-version={suite.python}", "--implementation=cp", f"--abi={tag}",
        *(f"--platform={platform}_{machine}" for platform in platforms),
        "--constraint", PACKAGING / "constraints.txt", "--dest", dest, wheel, "pip",
    ], quiet=True)


@dataclass(frozen=True)
class Built:
    """What a suite's root gave: the virtualenv in a staging tree, the packages it needs."""

    staging: Path
    depends: list[str]


def build_venv(
    suite: Suite, architecture: Architecture, wheel: Path, work: Path, epoch: int, rootfs: Path | None = None
) -> Built:
    """koordrp's virtualenv, made in a fresh root of ``suite`` and ``architecture`` of Debian's essential
    packages and the interpreter (packaging/deb/build-venv). ``rootfs``: that root also goes there, as a
    tar, for the image."""
    build = work / "koordrp-build"
    build.mkdir()
    shutil.copy(PACKAGING / "deb" / "build-venv", build)
    download_wheels(wheel, suite, architecture.machine, build / "wheels")
    staging = work / "staging"
    (staging / "opt/koordrp").mkdir(parents=True)
    emulated = emulation.environment(architecture.machine) if architecture.debian != debian_architecture() else {}
    hooks = [
        f"copy-in {shlex.quote(str(build))} /tmp",
        # A clean environment: the host's pip settings name files the root does not have.
        f"env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin SOURCE_DATE_EPOCH={epoch}"
        + "".join(f" {name}={shlex.quote(value)}" for name, value in emulated.items())
        + f' chroot "$1" sh /tmp/koordrp-build/build-venv {suite.interpreter}',
        f"sync-out /opt/koordrp {shlex.quote(str(staging / 'opt/koordrp'))}",
        f"copy-out /tmp/koordrp-build/depends {shlex.quote(str(work))}",
    ]
    # grpcio's compiled module links to libstdc++.
    options = [f"--arch={architecture.debian}", f"--include={suite.interpreter},libstdc++6"]
    if rootfs is not None:
        hooks.append(IMAGE_TIDY)
        hooks.append(f"copy-in {shlex.quote(str(PACKAGING / 'image' / 'koordrp-options'))} /usr/local/bin")
        flags = " ".join(shlex.quote(flag) for flag in MODE_FLAGS)
        hooks.append(
            f'chmod 0755 "$1"{OPTIONS_COMMAND} && for flag in {flags}; do ln -s koordrp-options "$1/usr/local/bin/$flag"; done'
            f' && touch -h -d @{epoch} "$1"{OPTIONS_COMMAND} "$1"/usr/local/bin/--*'
        )
        options += ["--skip=cleanup/apt,cleanup/mmdebstrap,output/dev", *SLIM]
    run(
        ["mmdebstrap", "--quiet", "--variant=essential", *options, *(f"--customize-hook={hook}" for hook in hooks),
         suite.codename, rootfs or "/dev/null", *mirrors(suite)],
        env={**os.environ, "SOURCE_DATE_EPOCH": str(epoch), **emulated},
    )
    return Built(staging, (work / "depends").read_text().split())


def build_deb(suite: Suite, architecture: Architecture, built: Built, out: Path, epoch: int) -> Path:
    debian_package.lay_out(built.staging)
    control = debian_package.Control(
        version=debian_package.debian_version(project_version(), suite.number),
        architecture=architecture.debian,
        depends=built.depends,
        installed_size=debian_package.installed_size(built.staging),
    )
    return debian_package.build(built.staging, control, out, epoch)


def image_archive_name(version: str) -> str:
    return f"koordrp_{version}.oci.tar"


def build_image(roots: dict[str, Path], out: Path, epoch: int) -> Path:
    """The image's archive, of each architecture's root in ``roots`` (Debian's names)."""
    version = project_version()
    image = Image(
        name=IMAGE_NAME,
        tag=version,
        entrypoint=ENTRYPOINT,
        env=[IMAGE_PATH],
        created=epoch,
        # Root only for what NRI mode needs: containerd's NRI socket and hookserver.d are root's.
        user="0:0",
        labels={
            "org.opencontainers.image.title": "koordrp",
            "org.opencontainers.image.version": version,
            "org.opencontainers.image.licenses": "Apache-2.0",
            "org.opencontainers.image.description": "koordrp, Koordinator's runtime proxy: here as a plugin of containerd's NRI",
        },
        history=f"scripts/package: Debian {IMAGE_SUITE.number}'s essential packages, {IMAGE_SUITE.interpreter}, koordrp's virtualenv",
    )
    archive = out / image_archive_name(version)
    write_oci_archive(image, roots, archive)
    return archive


def build_suite(suite: Suite, architecture: Architecture, wheel: Path, out: Path, work: Path, epoch: int) -> Path | None:
    """The suite's .deb for ``architecture``; for the image's suite, the root for the image too (returned)."""
    started = time.monotonic()
    work.mkdir()
    rootfs = work / "rootfs.tar" if suite == IMAGE_SUITE else None
    built = build_venv(suite, architecture, wheel, work, epoch, rootfs)
    deb = build_deb(suite, architecture, built, out, epoch)
    say(f"{deb.name}, in {time.monotonic() - started:.0f} s")
    return rootfs


def checksums(files: Sequence[Path], out: Path) -> None:
    lines = []
    for path in files:
        digest = hashlib.sha256()
        with path.open("rb") as data:
            while chunk := data.read(1 << 20):
                digest.update(chunk)
        lines.append(f"{digest.hexdigest()}  {path.name}\n")
    (out / "SHA256SUMS").write_text("".join(lines))


def main(argv: Sequence[str]) -> None:
    out = Path(argv[0] if argv else ROOT / "dist").resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("koordrp[-_]*"), out / "SHA256SUMS"]:
        old.unlink(missing_ok=True)
    epoch = source_date_epoch()
    with tempfile.TemporaryDirectory(prefix="koordrp-package-", dir="/tmp") as temporary:
        work = Path(temporary)
        say(f"koordrp {project_version()}: the wheel and the sdist")
        wheel = build_python(out, epoch)
        say(
            "the .debs for Debian " + " and ".join(f"{suite.number} ({suite.interpreter})" for suite in SUITES)
            + ", for " + " and ".join(arch.debian for arch in ARCHITECTURES) + ", and the image"
        )
        foreign = [arch.machine for arch in ARCHITECTURES if arch.debian != debian_architecture()]
        # A root of the machine's architecture mostly waits on the mirror and on dpkg, an emulated one on the
        # CPU: every build at once keeps both cores busy until the last is done.
        with emulation.emulating(*foreign), ThreadPoolExecutor(len(SUITES) * len(ARCHITECTURES)) as builders:
            builds = {
                (suite, arch): builders.submit(build_suite, suite, arch, wheel, out, work / f"{suite.codename}-{arch.debian}", epoch)
                for suite in SUITES
                for arch in ARCHITECTURES
            }
            roots = {arch.debian: root for arch in ARCHITECTURES if (root := builds[IMAGE_SUITE, arch].result()) is not None}
            started = time.monotonic()
            say(f"{build_image(roots, out, epoch).name}, in {time.monotonic() - started:.0f} s")
            for build in builds.values():
                build.result()
    files = sorted(path for path in out.iterdir() if path.name.startswith("koordrp"))
    checksums(files, out)
    for path in files:
        say(f"{path.name}: {path.stat().st_size / 2**20:.1f} MiB")
    say(f"done, in {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
