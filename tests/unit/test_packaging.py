"""scripts/package's parts that need no Debian root: the OCI archive, the .deb's control file and layout,
the one version."""

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
from scripts import debian_package, package
from scripts.oci_archive import CONTAINERD_NAME, LAYER, REF_NAME, Image, write_oci_archive
from tests.support.tempdirs import short_tempdir

IMAGE = Image(
    name="localhost/koordrp",
    tag="1.2.3",
    architecture="amd64",
    entrypoint=("twistd", "-n", "--pidfile=", "--logfile=-", "koordrp"),
    env=["PATH=/opt/koordrp/venv/bin:/usr/bin:/bin"],
    created=946684800,
    labels={"org.opencontainers.image.version": "1.2.3"},
    history="a test",
)


def rootfs(path: Path) -> bytes:
    with tarfile.open(path, "w") as tar:
        info = tarfile.TarInfo("etc/hostname")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"node\n"))
    return path.read_bytes()


class OCIArchiveTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.directory = Path(short_tempdir(self))
        self.tar = rootfs(self.directory / "rootfs.tar")
        self.archive = self.directory / "image.oci.tar"
        write_oci_archive(self.directory / "rootfs.tar", IMAGE, self.archive)

    def blobs(self) -> dict[str, bytes]:
        with tarfile.open(self.archive) as archive:
            return {
                member.name: archive.extractfile(member).read()  # type: ignore[union-attr]
                for member in archive.getmembers()
                if member.isfile()
            }

    def blob(self, blobs: dict[str, bytes], descriptor: dict[str, Any]) -> bytes:
        data = blobs["blobs/sha256/" + descriptor["digest"].split(":")[1]]
        self.assertEqual((len(data), "sha256:" + hashlib.sha256(data).hexdigest()), (descriptor["size"], descriptor["digest"]))
        return data

    def test_an_image_layout_whose_every_blob_is_what_its_descriptor_says(self) -> None:
        blobs = self.blobs()
        self.assertEqual(json.loads(blobs["oci-layout"]), {"imageLayoutVersion": "1.0.0"})
        [entry] = json.loads(blobs["index.json"])["manifests"]
        self.assertEqual(entry["annotations"], {CONTAINERD_NAME: "localhost/koordrp:1.2.3", REF_NAME: "1.2.3"})
        manifest = json.loads(self.blob(blobs, entry))
        config = json.loads(self.blob(blobs, manifest["config"]))
        [layer] = manifest["layers"]
        self.assertEqual(layer["mediaType"], LAYER)
        self.assertEqual(gzip.decompress(self.blob(blobs, layer)), self.tar)
        self.assertEqual(config["rootfs"]["diff_ids"], ["sha256:" + hashlib.sha256(self.tar).hexdigest()])
        self.assertEqual(config["config"]["Entrypoint"], list(IMAGE.entrypoint))
        self.assertEqual((config["config"]["User"], config["created"]), ("0:0", "2000-01-01T00:00:00Z"))

    def test_the_same_root_makes_the_same_bytes(self) -> None:
        again = self.directory / "again.oci.tar"
        write_oci_archive(self.directory / "rootfs.tar", IMAGE, again)
        self.assertEqual(again.read_bytes(), self.archive.read_bytes())
        self.assertEqual(list(self.directory.glob("*.partial")), [])


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
