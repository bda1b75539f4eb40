"""scripts/package's parts that need no Debian root: the OCI archive, the .deb's control file and layout,
the one version, the emulation's registration."""

import gzip
import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from koordrp import koordrp_version
from scripts import debian_package, emulation, package
from scripts.oci_archive import CONTAINERD_NAME, INDEX, LAYER, MANIFEST, REF_NAME, Image, write_oci_archive
from tests.support.tempdirs import short_tempdir

IMAGE = Image(
    name="localhost/koordrp",
    tag="1.2.3",
    entrypoint=("twistd", "-n", "--pidfile=", "--logfile=-", "koordrp"),
    env=["PATH=/opt/koordrp/venv/bin:/usr/bin:/bin"],
    created=946684800,
    labels={"org.opencontainers.image.version": "1.2.3"},
    history="a test",
)
ARCHITECTURES = ("amd64", "arm64")


def rootfs(path: Path, hostname: bytes) -> bytes:
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("etc/hostname")
        info.size = len(hostname)
        tar.addfile(info, io.BytesIO(hostname))
    return path.read_bytes()


class OCIArchiveTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.directory = Path(short_tempdir(self))
        self.roots = {arch: self.directory / f"{arch}.tar" for arch in ARCHITECTURES}
        self.tars = {arch: rootfs(path, f"{arch}\n".encode()) for arch, path in self.roots.items()}
        self.archive = self.directory / "image.oci.tar"
        write_oci_archive(IMAGE, self.roots, self.archive)

    def blobs(self, archive: Path) -> dict[str, bytes]:
        with tarfile.open(archive) as tar:
            names = tar.getnames()
            self.assertEqual(len(names), len(set(names)))
            return {
                member.name: tar.extractfile(member).read()  # type: ignore[union-attr]
                for member in tar.getmembers()
                if member.isfile()
            }

    def blob(self, blobs: dict[str, bytes], descriptor: dict[str, Any]) -> bytes:
        data = blobs["blobs/sha256/" + descriptor["digest"].split(":")[1]]
        self.assertEqual((len(data), "sha256:" + hashlib.sha256(data).hexdigest()), (descriptor["size"], descriptor["digest"]))
        return data

    def test_an_image_layout_whose_every_blob_is_what_its_descriptor_says(self) -> None:
        blobs = self.blobs(self.archive)
        self.assertEqual(json.loads(blobs["oci-layout"]), {"imageLayoutVersion": "1.0.0"})
        *platforms, named = json.loads(blobs["index.json"])["manifests"]
        self.assertEqual(named["annotations"], {CONTAINERD_NAME: "localhost/koordrp:1.2.3", REF_NAME: "1.2.3"})
        self.assertEqual(named["mediaType"], INDEX)
        self.assertEqual(json.loads(self.blob(blobs, named))["manifests"], platforms)
        self.assertEqual([entry["platform"] for entry in platforms], [{"architecture": arch, "os": "linux"} for arch in ARCHITECTURES])
        for arch, entry in zip(ARCHITECTURES, platforms):
            self.assertEqual((entry["mediaType"], "annotations" in entry), (MANIFEST, False))
            manifest = json.loads(self.blob(blobs, entry))
            config = json.loads(self.blob(blobs, manifest["config"]))
            [layer] = manifest["layers"]
            self.assertEqual(layer["mediaType"], LAYER)
            self.assertEqual(gzip.decompress(self.blob(blobs, layer)), self.tars[arch])
            self.assertEqual(config["rootfs"]["diff_ids"], ["sha256:" + hashlib.sha256(self.tars[arch]).hexdigest()])
            self.assertEqual((config["architecture"], config["os"]), (arch, "linux"))
            self.assertEqual(config["config"]["Entrypoint"], list(IMAGE.entrypoint))
            self.assertEqual((config["config"]["User"], config["created"]), ("0:0", "2000-01-01T00:00:00Z"))

    def test_the_same_roots_make_the_same_bytes(self) -> None:
        again = self.directory / "again.oci.tar"
        write_oci_archive(IMAGE, dict(reversed(self.roots.items())), again)
        self.assertEqual(again.read_bytes(), self.archive.read_bytes())
        self.assertEqual(list(self.directory.glob("*.partial")), [])

    def test_platforms_of_the_same_root_share_one_layer(self) -> None:
        shared = self.directory / "shared.oci.tar"
        write_oci_archive(IMAGE, dict.fromkeys(ARCHITECTURES, self.roots["amd64"]), shared)
        blobs = self.blobs(shared)  # each member once
        *platforms, _ = json.loads(blobs["index.json"])["manifests"]
        amd64, arm64 = (json.loads(self.blob(blobs, entry))["layers"] for entry in platforms)
        self.assertEqual(amd64, arm64)


class DebianPackageTests(SynchronousTestCase):
    def test_the_control_file(self) -> None:
        control = debian_package.Control(
            version=debian_package.debian_version("1.2.3", "12"),
            architecture="amd64",
            depends=["python3.11", "libc6", "libc6"],
            installed_size=2048,
        )
        fields = dict(line.split(": ", 1) for line in control.text().splitlines() if not line.startswith(" "))
        self.assertEqual(fields["Version"], "1.2.3-1+deb12")
        self.assertEqual(fields["Depends"], "libc6, python3.11")
        self.assertEqual((fields["Package"], fields["Installed-Size"]), ("koordrp", "2048"))
        self.assertTrue(control.text().endswith("\n") and "\n\n" not in control.text())

    def test_debian_13s_package_upgrades_debian_12s(self) -> None:
        twelve, thirteen = (debian_package.debian_version("1.0", number) for number in ("12", "13"))
        self.assertEqual(subprocess.run(["dpkg", "--compare-versions", twelve, "lt", thirteen]).returncode, 0)

    def test_installed_size_counts_files_by_the_kib_and_not_the_control_files(self) -> None:
        root = Path(short_tempdir(self))
        (root / "DEBIAN").mkdir()
        (root / "DEBIAN" / "control").write_text("x" * 5000)
        (root / "opt").mkdir()
        (root / "opt" / "one").write_bytes(b"x" * 1025)
        (root / "opt" / "link").symlink_to("one")
        self.assertEqual(debian_package.installed_size(root), 1 + 2 + 1)

    def test_the_layout_ships_taps_unit_and_the_conffile_and_makes_the_hook_servers_directory(self) -> None:
        staging = Path(short_tempdir(self))
        site_packages = staging / debian_package.VENV / "lib" / "python3.11" / "site-packages"
        site_packages.mkdir(parents=True)
        debian_package.lay_out(staging)
        unit = staging / debian_package.UNIT
        self.assertEqual(unit.read_text(), (debian_package.TAP / "koordrp.service").read_text())
        self.assertTrue((staging / debian_package.HOOK_CONFIG_DIR).is_dir())
        self.assertEqual((staging / "DEBIAN" / "conffiles").read_text(), f"/{debian_package.CONFFILE}\n")
        self.assertEqual(str((staging / "usr/bin/koordrp").readlink()), f"/{debian_package.VENV}/bin/koordrp")
        for script in debian_package.MAINTAINER_SCRIPTS:
            self.assertEqual((staging / "DEBIAN" / script).stat().st_mode & 0o777, 0o755)

    def test_md5sums_lists_every_file_but_the_conffile_and_the_control_files(self) -> None:
        staging = Path(short_tempdir(self))
        for name in ("DEBIAN/control", "etc/default/koordrp", "opt/koordrp/venv/bin/twistd"):
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_text("x")
        (staging / "usr/bin").mkdir(parents=True)
        (staging / "usr/bin/koordrp").symlink_to("/opt/koordrp/venv/bin/koordrp")
        self.assertEqual(debian_package.md5sums(staging), f"{hashlib.md5(b'x').hexdigest()}  opt/koordrp/venv/bin/twistd\n")

    def test_the_unit_runs_the_twistd_the_package_ships(self) -> None:
        unit = (debian_package.TAP / "koordrp.service").read_text()
        self.assertIn(f"\nExecStart=/{debian_package.VENV}/bin/twistd ", unit)


class SdistTests(SynchronousTestCase):
    def sdist(self, path: Path, mtime: int) -> Path:
        with tarfile.open(path, "w:gz") as tar:
            info = tarfile.TarInfo("koordrp-1.2.3/PKG-INFO")
            info.size, info.mtime = 3, mtime
            tar.addfile(info, io.BytesIO(b"x=1"))
        return path

    def test_what_setuptools_dated_at_build_time_is_dated_at_the_commit(self) -> None:
        directory = Path(short_tempdir(self))
        built = [self.sdist(directory / f"{name}.tar.gz", mtime) for name, mtime in (("one", 2000000000), ("two", 2100000000))]
        for path in built:
            package.clamp_tarball(path, 1900000000)
        self.assertEqual(built[0].read_bytes(), built[1].read_bytes())
        with tarfile.open(built[0]) as tar:
            [member] = tar.getmembers()
            self.assertEqual((member.mtime, tar.extractfile(member).read()), (1900000000, b"x=1"))  # type: ignore[union-attr]


class VersionTests(SynchronousTestCase):
    def test_setup_cfg_names_the_version_koordrp_says(self) -> None:
        self.assertEqual(koordrp_version(), package.project_version())


class EmulationTests(SynchronousTestCase):
    """The registration of qemu with binfmt_misc, on a stand-in for /proc/sys/fs/binfmt_misc and Debian's
    definitions: what the kernel would be told, and that what was there is left as it was."""

    def setUp(self) -> None:
        directory = Path(short_tempdir(self))
        self.binfmt_misc = directory / "binfmt_misc"
        self.binfmt_misc.mkdir()
        self.definitions = directory / "binfmt.d"
        self.definitions.mkdir()
        self.interpreter = directory / "aarch64-binfmt-P"
        self.interpreter.touch()
        self.patch(emulation, "BINFMT_MISC", self.binfmt_misc)
        self.patch(emulation, "DEFINITIONS", self.definitions)
        self.patch(emulation, "binfmt_misc_mounted", lambda: True)

    def define(self, flags: str) -> str:
        line = f":qemu-aarch64:M::\\x7f\\x45\\x4c\\x46\\x02:\\xff\\xff\\xff\\xff\\xff:{self.interpreter}:{flags}"
        (self.definitions / "qemu-aarch64.conf").write_text(f"# qemu's\n{line}\n")
        return line

    def test_debians_definition_gains_the_F_flag_that_chroots_need(self) -> None:
        line = self.define("OP")
        self.assertEqual(emulation.definition("aarch64"), line + "F")
        line = self.define("OPF")
        self.assertEqual(emulation.definition("aarch64"), line)

    def test_without_qemu_user_static_it_says_what_to_install(self) -> None:
        error = self.assertRaises(emulation.EmulationError, emulation.definition, "aarch64")
        self.assertIn("apt-get install qemu-user-static", str(error))
        self.define("OPF")
        self.interpreter.unlink()
        error = self.assertRaises(emulation.EmulationError, emulation.definition, "aarch64")
        self.assertIn(str(self.interpreter), str(error))

    def test_what_it_registered_it_unregisters(self) -> None:
        line = self.define("OP")
        with emulation.emulating("aarch64"):
            self.assertEqual((self.binfmt_misc / "register").read_text(), line + "F")
        self.assertEqual((self.binfmt_misc / "qemu-aarch64").read_text(), "-1")

    def test_what_it_registered_it_unregisters_on_failure_too(self) -> None:
        self.define("OP")

        def fail() -> None:
            with emulation.emulating("aarch64"):
                raise ValueError("the build failed")

        self.assertRaises(ValueError, fail)
        self.assertEqual((self.binfmt_misc / "qemu-aarch64").read_text(), "-1")

    def test_a_registration_found_is_used_and_left_as_it_was(self) -> None:
        found = "enabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\nflags: POF\noffset 0\n"
        (self.binfmt_misc / "qemu-aarch64").write_text(found)
        with emulation.emulating("aarch64"):
            pass
        self.assertEqual((self.binfmt_misc / "qemu-aarch64").read_text(), found)
        self.assertFalse((self.binfmt_misc / "register").exists())

    def test_a_registration_found_that_chroots_cannot_use_is_refused_and_left(self) -> None:
        found = "enabled\ninterpreter /usr/bin/qemu-aarch64\nflags: \noffset 0\n"
        (self.binfmt_misc / "qemu-aarch64").write_text(found)

        def enter() -> None:
            with emulation.emulating("aarch64"):
                pass

        error = self.assertRaises(emulation.EmulationError, enter)
        self.assertIn("F flag", str(error))
        self.assertEqual((self.binfmt_misc / "qemu-aarch64").read_text(), found)

    def test_qemu_is_told_a_cpu_for_arm64_only(self) -> None:
        self.assertEqual(set(emulation.environment("aarch64")), {"QEMU_CPU"})
        self.assertEqual(emulation.environment("x86_64"), {})
