"""koordrp's packages, installed as an operator installs them. scripts/package builds them once for the
session (KOORDRP_DIST names a directory of them already built): the wheel goes into a fresh virtualenv;
each amd64 .deb into a fresh root of its Debian release (apt-get install, run, purge), each arm64 .deb
into a fresh arm64 root under emulation (apt-get install, run); the image, for both platforms, into the
session's containerd 2.1, run with ctr and as deploy/'s DaemonSet runs it, as containerd's NRI plugin
whose hooks change the containers made through CRI, and its arm64 variant under emulation.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from cri_api.v1 import api_pb2

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from scripts import debian_package, emulation, package
from scripts.oci_archive import CONTAINERD_NAME, INDEX, MANIFEST
from tests.e2e.conftest import Runtimes, require, require_root
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import RELEASES, Containerd
from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.daemons import check_binaries
from tests.support.hook_registration import register
from tests.support.pods import TIMEOUT, remove_pod, running_container, runtime_spec, start_container

ROOT = Path(__file__).resolve().parents[2]
VERSION = package.project_version()
SAYS_VERSION = f"koordrp {VERSION}\n"
RELEASE = "2.1"
INJECTED = "KOORDRP_FROM_THE_IMAGE=1"
HOST = package.debian_architecture()
[ARM64] = [arch for arch in package.ARCHITECTURES if arch.debian == "arm64"]


def require_packaging() -> None:
    check_binaries(("mmdebstrap", "dpkg-deb"), tests="package tests", packages="mmdebstrap")
    require_root()


def require_emulation() -> None:
    check_binaries(
        (f"qemu-{ARM64.machine}-static", "arch-test", "mmdebstrap"), tests="arm64 package tests", packages="qemu-user-static arch-test mmdebstrap"
    )
    require_root()


@pytest.fixture(scope="module")
def emulated() -> Iterator[dict[str, str]]:
    """arm64 programs run here, under Debian's qemu, for the module's tests (binfmt_misc left as it was found):
    what qemu wants in their environment."""
    require(require_emulation, "arm64 package")
    with emulation.emulating(ARM64.machine):
        yield emulation.environment(ARM64.machine)


@pytest.fixture(scope="session")
def dist() -> Iterator[Path]:
    """scripts/package's output for this checkout."""
    given = os.environ.get("KOORDRP_DIST")
    if given:
        yield Path(given).resolve()
        return
    require(require_packaging, "package")
    with tempfile.TemporaryDirectory(prefix="krp-dist-") as out:
        subprocess.run([sys.executable, "-m", "scripts.package", out], cwd=ROOT, check=True)
        yield Path(out)


def run(*argv: str | Path, check: bool = True, **options: Any) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(arg) for arg in argv], capture_output=True, text=True, **options)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return result


# -- the wheel -------------------------------------------------------------------------------------


def test_the_wheel_in_a_fresh_virtualenv_runs_twistd_koordrp_and_koordrp_check(dist: Path, workdir: Path) -> None:
    [wheel] = dist.glob(f"koordrp-{VERSION}-*.whl")
    assert (dist / f"koordrp-{VERSION}.tar.gz").is_file()
    venv = workdir / "venv"
    run(sys.executable, "-m", "venv", venv)
    run(venv / "bin/python", "-m", "pip", "install", "-q", "--constraint", ROOT / "packaging/constraints.txt", wheel)
    for argv in (("twistd", "koordrp", "--version"), ("koordrp", "check", "--version"), ("koordrp", "--version")):
        assert run(venv / "bin" / argv[0], *argv[1:]).stdout == SAYS_VERSION


# -- the .deb --------------------------------------------------------------------------------------

# systemctl as the maintainer scripts meet it on a node: it notes what each package's scripts ask (dpkg
# names the package), and koordrp.service is active while /tmp/koordrp-active exists.
FAKE_SYSTEMCTL = """#!/bin/sh
echo "${DPKG_MAINTSCRIPT_PACKAGE:-}: $*" >>/tmp/systemctl.log
case "$1" in
is-active) [ -e /tmp/koordrp-active ] ;;
esac
"""


def chroot(root: Path, *argv: str, check: bool = True, emulated: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive", **(emulated or {})}
    return run("chroot", root, *argv, check=check, env=environ)


def deb_of(dist: Path, suite: package.Suite, architecture: str) -> Path:
    [deb] = dist.glob(f"koordrp_{debian_package.debian_version(VERSION, suite.number)}_{architecture}.deb")
    return deb


@pytest.fixture(params=package.SUITES, ids=lambda suite: f"debian{suite.number}")
def suite(request: pytest.FixtureRequest) -> package.Suite:
    chosen: package.Suite = request.param
    return chosen


@pytest.fixture
def debian_root(suite: package.Suite, workdir: Path) -> Path:
    """A fresh root of the release with apt and systemd, made by mmdebstrap from the machine's mirror; its
    systemd seen running (the maintainer scripts look for /run/systemd/system) through the fake above."""
    root = workdir / "root"
    # The package lists stay, as on a node that has run apt-get update.
    run(
        "mmdebstrap", "--quiet", "--variant=apt", "--include=systemd", "--skip=cleanup/apt/lists",
        suite.codename, root, *package.mirrors(suite),
    )
    (root / "run/systemd/system").mkdir(parents=True)
    systemctl = root / "usr/bin/systemctl"  # apt runs maintainer scripts with a PATH of its own
    systemctl.unlink()
    systemctl.write_text(FAKE_SYSTEMCTL)
    systemctl.chmod(0o755)
    return root


def test_the_deb_installs_with_apt_runs_and_its_purge_leaves_none_of_its_files(
    dist: Path, suite: package.Suite, debian_root: Path
) -> None:
    root = debian_root
    deb = deb_of(dist, suite, HOST)
    shutil.copy(deb, root / "tmp")
    chroot(root, "apt-get", "install", "-y", "-q", "--no-install-recommends", f"/tmp/{deb.name}")

    # koordrp on PATH, twistd where the unit runs it.
    for argv in (("koordrp", "--version"), ("koordrp", "check", "--version"), (f"/{debian_package.VENV}/bin/twistd", "koordrp", "--version")):
        assert chroot(root, *argv).stdout == SAYS_VERSION
    assert (root / debian_package.UNIT).read_text() == (debian_package.TAP / "koordrp.service").read_text()
    assert (root / debian_package.HOOK_CONFIG_DIR).is_dir()
    assert chroot(root, "dpkg-query", "-W", "-f=${Conffiles}", "koordrp").stdout.split()[0] == f"/{debian_package.CONFFILE}"

    # The unit, and the NRI drop-in installed where the operator puts it, as systemd reads them.
    drop_ins = root / "etc/systemd/system/koordrp.service.d"
    drop_ins.mkdir(parents=True)
    shutil.copy(root / "usr/share/koordrp/nri/10-nri-mode.conf", drop_ins)
    analyzed = chroot(root, "systemd-analyze", "verify", "--man=no", "koordrp.service", check=False)
    assert (analyzed.returncode, analyzed.stdout + analyzed.stderr) == (0, "")
    shutil.rmtree(drop_ins)

    # Installing reloaded systemd and started, enabled, restarted nothing.
    asked = [line for line in (root / "tmp/systemctl.log").read_text().splitlines() if line.startswith("koordrp: ")]
    assert asked == ["koordrp: daemon-reload"]
    # koordrp ran and wrote nothing of its own among the package's files, nor changed one (its bytecode and
    # Twisted's plugin cache are shipped, and stay valid).
    owned = set(chroot(root, "dpkg-query", "-L", "koordrp").stdout.splitlines()) - {"/."}
    made = {"/" + str(path.relative_to(root)) for path in (root / "opt/koordrp").rglob("*")}
    assert made - owned == set()
    verified = chroot(root, "dpkg", "--verify", "koordrp", check=False)
    assert (verified.returncode, verified.stdout) == (0, "")

    # While koordrp.service runs, the package stays and says what to do first.
    (root / "tmp/koordrp-active").touch()
    refused = chroot(root, "apt-get", "purge", "-y", "-q", "koordrp", check=False)
    assert refused.returncode != 0 and "koordrp.service is running" in refused.stdout + refused.stderr
    assert (root / debian_package.VENV / "bin/twistd").exists()
    (root / "tmp/koordrp-active").unlink()

    # Enabled as `systemctl enable koordrp` enables it; then purged.
    wants = root / "etc/systemd/system/multi-user.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    (wants / "koordrp.service").symlink_to(f"/{debian_package.UNIT}")
    chroot(root, "apt-get", "purge", "-y", "-q", "koordrp")
    assert chroot(root, "dpkg-query", "-W", "koordrp", check=False).returncode != 0
    left = sorted(path for path in owned if os.path.lexists(f"{root}{path}"))
    assert all(os.path.isdir(f"{root}{path}") and not os.path.islink(f"{root}{path}") for path in left), left
    # A directory of the package that stays is another package's too.
    others = chroot(root, "dpkg-query", "-S", *left, check=False)
    assert others.returncode == 0, others.stderr
    assert not (wants / "koordrp.service").is_symlink()
    assert not (root / "opt/koordrp").exists() and not (root / "etc/runtime").exists()


@pytest.fixture
def arm64_root(suite: package.Suite, workdir: Path, emulated: dict[str, str]) -> Path:
    """A fresh arm64 root of the release with apt, made by mmdebstrap from the machine's mirror under emulation."""
    root = workdir / "root"
    run(
        "mmdebstrap", "--quiet", f"--arch={ARM64.debian}", "--variant=apt", "--skip=cleanup/apt/lists",
        suite.codename, root, *package.mirrors(suite), env={**os.environ, **emulated},
    )
    return root


def test_the_arm64_deb_installs_with_apt_into_an_arm64_root_and_runs_there_under_emulation(
    dist: Path, suite: package.Suite, arm64_root: Path, emulated: dict[str, str]
) -> None:
    root = arm64_root
    deb = deb_of(dist, suite, ARM64.debian)
    assert run("dpkg-deb", "--field", deb, "Architecture").stdout == f"{ARM64.debian}\n"
    shutil.copy(deb, root / "tmp")
    chroot(root, "apt-get", "install", "-y", "-q", "--no-install-recommends", f"/tmp/{deb.name}", emulated=emulated)
    # The root's programs are arm64's, run by qemu.
    assert chroot(root, "dpkg", "--print-architecture", emulated=emulated).stdout == f"{ARM64.debian}\n"
    assert chroot(root, "uname", "-m", emulated=emulated).stdout == f"{ARM64.machine}\n"
    for argv in (("koordrp", "check", "--version"), (f"/{debian_package.VENV}/bin/twistd", "koordrp", "--version")):
        assert chroot(root, *argv, emulated=emulated).stdout == SAYS_VERSION
    # Nothing it shipped was changed by running it (its bytecode and Twisted's plugin cache, made under
    # emulation, are valid here).
    verified = chroot(root, "dpkg", "--verify", "koordrp", check=False, emulated=emulated)
    assert (verified.returncode, verified.stdout) == (0, "")


# -- the image -------------------------------------------------------------------------------------


def archive_json(archive: Path, name: str) -> Any:
    """A JSON file of an OCI archive: index.json, or a blob by its digest."""
    with tarfile.open(archive) as tar:
        member = tar.extractfile(name if name == "index.json" else "blobs/sha256/" + name.split(":")[1])
        assert member is not None
        return json.load(member)


def image_config(archive: Path, architecture: str) -> dict[str, Any]:
    """The config of the image for linux/``architecture`` in an OCI archive, found through its index and manifest."""
    [entry] = [entry for entry in archive_json(archive, "index.json")["manifests"] if entry.get("platform", {}).get("architecture") == architecture]
    manifest = archive_json(archive, entry["digest"])
    config: dict[str, Any] = archive_json(archive, manifest["config"]["digest"])
    return config


def test_the_archive_is_one_image_for_linux_amd64_and_linux_arm64(dist: Path) -> None:
    [archive] = dist.glob("koordrp_*.oci.tar")
    assert archive.name == package.image_archive_name(VERSION)
    manifests = archive_json(archive, "index.json")["manifests"]
    platforms = [entry for entry in manifests if "platform" in entry]
    assert sorted((entry["platform"]["os"], entry["platform"]["architecture"]) for entry in platforms) == [
        ("linux", "amd64"), ("linux", "arm64")
    ]
    assert {entry["mediaType"] for entry in platforms} == {MANIFEST}
    # The image containerd imports by its name: the index of both.
    [named] = [entry for entry in manifests if "platform" not in entry]
    assert (named["mediaType"], named["annotations"][CONTAINERD_NAME]) == (INDEX, f"{package.IMAGE_NAME}:{VERSION}")
    assert archive_json(archive, named["digest"])["manifests"] == platforms
    for entry in platforms:
        config = image_config(archive, entry["platform"]["architecture"])
        assert (config["os"], config["architecture"]) == ("linux", entry["platform"]["architecture"])
        assert config["config"]["Entrypoint"] == list(package.ENTRYPOINT)


def ctr(containerd: Containerd, *argv: str | Path) -> list[str]:
    return [RELEASES[RELEASE].binary("ctr"), "--address", containerd.address, "-n", "k8s.io", *map(str, argv)]


class Image:
    def __init__(self, containerd: Containerd, archive: Path) -> None:
        self.containerd = containerd
        self.reference = f"{package.IMAGE_NAME}:{VERSION}"
        self.config = image_config(archive, HOST)


@pytest.fixture(scope="module")
def image(dist: Path, runtimes: Runtimes) -> Iterator[Image]:
    """The image, imported into the session's containerd 2.1 (NRI enabled) as an operator imports it; every
    platform's, where a node's import takes its own alone, for the arm64 variant's test."""
    containerd = runtimes.get(RELEASE)
    archive = dist / package.image_archive_name(VERSION)
    imported = run(*ctr(containerd, "images", "import", "--all-platforms", archive), env=containerd.env())
    assert f"{package.IMAGE_NAME}:{VERSION}" in imported.stdout
    yield Image(containerd, archive)
    run(*ctr(containerd, "images", "rm", f"{package.IMAGE_NAME}:{VERSION}"), env=containerd.env())


def test_the_images_arm64_variant_starts_koordrp_under_emulation(image: Image, emulated: dict[str, str]) -> None:
    containerd = image.containerd
    qemu = [f"--env={name}={value}" for name, value in emulated.items()]

    def in_arm64_container(*argv: str) -> str:
        name = f"koordrp-arm64-{uuid.uuid4().hex[:8]}"
        command = ctr(containerd, "run", "--rm", "--platform", f"linux/{ARM64.debian}", *qemu, image.reference, name, *argv)
        return run(*command, env=containerd.env()).stdout

    assert in_arm64_container("uname", "-m") == f"{ARM64.machine}\n"
    # koordrp as the image's entrypoint starts it (ctr: through the mode flag's command, as above).
    assert in_arm64_container("--backend-runtime-mode=NRI", "--version") == SAYS_VERSION


def wait_for_line(log: Path, text: str, timeout: float = 60.0) -> str:
    """The first line of ``log`` with ``text`` in it, once it is there."""
    deadline = time.monotonic() + timeout
    while True:
        said = log.read_text(errors="replace") if log.exists() else ""
        found = [line for line in said.splitlines() if text in line]
        if found:
            return found[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} in {log} within {timeout}s:\n{said}")
        time.sleep(0.1)


@pytest.fixture
def injector(workdir: Path, servers: dict[str, FakeHookServer]) -> FakeHookServer:
    """A hook server whose PreCreateContainer adds an environment variable, in a directory of its own."""
    (workdir / "injector").mkdir()
    server = FakeHookServer(str(workdir / "injector" / "injector.sock")).start()
    servers["injector"] = server
    server.behaviours["PreCreateContainerHook"] = lambda request: hook.ContainerResourceHookResponse(
        container_envs=dict([INJECTED.split("=")])
    )
    return server


def assert_containers_get_the_hooks_env(containerd: Containerd, workdir: Path, name: str) -> None:
    """A container made through CRI, as kubelet makes it on an NRI node, gets the hook's change."""
    with running_container(containerd.runtime(), name, workdir) as pod:
        assert INJECTED in runtime_spec(containerd.runtime(), pod.container_id)["process"]["env"]


def test_the_image_run_with_ctr_is_containerds_nri_plugin_and_its_hooks_change_containers(
    image: Image, injector: FakeHookServer, workdir: Path
) -> None:
    containerd = image.containerd
    hooks = workdir / "hookserver.d"
    register(hooks, "injector", injector.path, ["PreCreateContainer"])
    sockets = Path(injector.path).parent
    name = f"koordrp-{uuid.uuid4().hex[:8]}"
    assert image.config["config"]["Entrypoint"] == list(package.ENTRYPOINT)
    # ctr runs what follows the container's id in place of the image's entrypoint (Docker and Kubernetes
    # append it): koordrp's options after the id all the same, the mode flag first.
    argv = ctr(
        containerd, "run", "--rm",
        "--mount", f"type=bind,src={containerd.paths.nri_socket.parent},dst=/var/run/nri,options=rbind:rw",
        "--mount", f"type=bind,src={hooks},dst=/etc/runtime/hookserver.d,options=rbind:ro",
        "--mount", f"type=bind,src={sockets},dst={sockets},options=rbind:rw",
        image.reference, name,
        "--backend-runtime-mode=NRI", "--nri-socket=/var/run/nri/nri.sock", "--hook-config-dir=/etc/runtime/hookserver.d",
    )
    log = workdir / "koordrp.log"
    with log.open("wb") as output:
        koordrp = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, env=containerd.env())
    try:
        wait_for_line(log, "] store rebuilt from containerd's NRI")
        wait_for_line(log, "] hook servers: injector.json")
        assert_containers_get_the_hooks_env(containerd, workdir, "from-ctr")
        run(*ctr(containerd, "task", "kill", "--signal", "SIGTERM", name), env=containerd.env())
        assert koordrp.wait(60) == 0, log.read_text()
    finally:
        if koordrp.poll() is None:
            run(*ctr(containerd, "task", "kill", "--signal", "SIGKILL", name), check=False, env=containerd.env())
            koordrp.wait(60)
    assert "Traceback" not in log.read_text()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def healthz(port: int, path: str = "healthz") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except OSError as error:
        return 0, str(error)


# What CRI mounts into every container of a pod from containerd's own directories: the pod's files.
POD_FILES = {"/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/dev/shm"}


def test_the_image_runs_as_the_daemonset_runs_it(image: Image, injector: FakeHookServer, workdir: Path) -> None:
    """deploy/'s container: its arguments after the image's entrypoint, its mounts (each from a directory of
    the test's, the NRI socket's from containerd's), read-only and without capabilities; through CRI."""
    containerd = image.containerd
    [daemonset] = [document for document in yaml.safe_load_all((ROOT / "deploy/daemonset.yaml").read_text())]
    [spec] = daemonset["spec"]["template"]["spec"]["containers"]
    assert spec["image"] == image.reference
    # Host networking here (the machine has no CNI): koordrp's metrics on a free port of loopback.
    port = free_port()
    args = [arg for arg in spec["args"] if not arg.startswith("--metrics-endpoint=")]
    args.append(f"--metrics-endpoint=tcp:{port}:interface=127.0.0.1")
    koordlet_dir = next(mount["mountPath"] for mount in spec["volumeMounts"] if mount["name"] == "koordlet")
    register(workdir / "hookserver.d", "injector", f"{koordlet_dir}/injector.sock", ["PreCreateContainer"])
    host_paths = {
        "nri": containerd.paths.nri_socket.parent,
        "hookserver-d": workdir / "hookserver.d",
        "state": workdir / "state",
        "koordlet": Path(injector.path).parent,
    }
    assert {mount["name"] for mount in spec["volumeMounts"]} == set(host_paths)
    (workdir / "state").mkdir()
    config = container_config("koordrp", image=image.reference, args=args, log_path="koordrp.log")
    for mount in spec["volumeMounts"]:
        config.mounts.append(api_pb2.Mount(
            container_path=mount["mountPath"], host_path=str(host_paths[mount["name"]]), readonly=mount.get("readOnly", False)
        ))
    security = spec["securityContext"]
    config.linux.security_context.readonly_rootfs = security["readOnlyRootFilesystem"]
    config.linux.security_context.run_as_user.value = security["runAsUser"]
    config.linux.security_context.capabilities.drop_capabilities.extend(security["capabilities"]["drop"])
    runtime = containerd.runtime()
    pod = pod_sandbox_config("koordrp", namespace="koordrp-system", log_directory=workdir / "pod")
    sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
    try:
        container_id = start_container(runtime, sandbox_id, pod, config)
        wait_for_line(workdir / "pod/koordrp.log", "] hook servers: injector.json")
        deadline = time.monotonic() + 60
        while (answer := healthz(port))[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert answer[0] == 200, answer
        assert healthz(port, "livez")[0] == 200
        assert_containers_get_the_hooks_env(containerd, workdir, "from-daemonset")
        mounts = runtime_spec(runtime, container_id)["mounts"]
        # As an operator runs it: kubectl exec into koordrp's container.
        checked = runtime.ExecSync(
            api_pb2.ExecSyncRequest(container_id=container_id, cmd=["koordrp", "check", "--backend-runtime-mode=NRI"], timeout=60),
            timeout=TIMEOUT,
        )
    finally:
        remove_pod(runtime, sandbox_id)
    said = (workdir / "pod/koordrp.log").read_text()
    assert "Traceback" not in said and "plugin cache" not in said, said
    # Of containerd's, only the NRI socket's directory is in the container (beside the pod's own files).
    containerds = (containerd.paths.base, containerd.paths.socket_dir)
    reached = {
        mount["destination"]: mount["source"]
        for mount in mounts
        if any(Path(mount.get("source", "/")).is_relative_to(directory) for directory in containerds)
        and mount["destination"] not in POD_FILES
    }
    assert reached == {"/var/run/nri": str(containerd.paths.nri_socket.parent)}, mounts
    # koordrp check, beside koordrp, finds it given nothing beyond what NRI mode needs: no option, mount or capability.
    said = checked.stdout.decode() + checked.stderr.decode()
    assert "✓ koordrp's container mounts only what NRI mode needs: " in said, said
    assert "does not use" not in said and "more than NRI mode needs" not in said and "CapEff" not in said, said
