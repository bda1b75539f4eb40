"""``koordrp check`` on fake node layouts, against a real koordrp in front of a real containerd.

Each layout is a node's files under a temporary root, with kubelet's process as systemd would start
it from those files (tests/support/node.py): the three common set-ups (kubeadm from deb and from rpm,
a kubelet config file, plain flags), working and broken.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from koordrp import koordrp_version
from tests.e2e.conftest import hook_server
from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import Containerd
from tests.support.hook_registration import register
from tests.support.koordrp_process import KoordrpProcess
from tests.support.node import CONTAINERD_SOCKET, DROP_IN, FakeNode, run_check

KUBEADM_FLAGS = f'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint={CONTAINERD_SOCKET} --pod-infra-container-image=registry.k8s.io/pause:3.9"\n'
# What kubeadm's docs tell users to put in /etc/default/kubelet (or /etc/sysconfig/kubelet).
EXTRA_ARGS = f'KUBELET_EXTRA_ARGS="--node-ip=10.0.0.5 --container-runtime-endpoint={CONTAINERD_SOCKET}"\n'
CONFIG = f"apiVersion: kubelet.config.k8s.io/v1beta1\nkind: KubeletConfiguration\ncontainerRuntimeEndpoint: {CONTAINERD_SOCKET}\n"
# The drop-in koordrp used to ship: an Environment= the EnvironmentFile above overrides.
OLD_DROP_IN = (
    '[Service]\nEnvironment="KUBELET_EXTRA_ARGS=--container-runtime-endpoint=unix:///var/run/koord-runtimeproxy/'
    'runtimeproxy.sock --image-service-endpoint=unix:///var/run/koord-runtimeproxy/runtimeproxy.sock"\n'
)


@pytest.fixture
def node(koordrp: KoordrpProcess, workdir: Path) -> FakeNode:
    return FakeNode(workdir / "node", str(koordrp.socket))


def marks(output: str) -> list[str]:
    return [line[0] for line in output.splitlines() if line[:1] in "✓✗"]


@pytest.mark.parametrize(("package", "extra_args_file"), [("deb", "/etc/default/kubelet"), ("rpm", "/etc/sysconfig/kubelet")])
def test_a_kubeadm_node_with_koordrps_drop_in(package: str, extra_args_file: str, node: FakeNode) -> None:
    files = {extra_args_file: EXTRA_ARGS, "/var/lib/kubelet/kubeadm-flags.env": KUBEADM_FLAGS, "/var/lib/kubelet/config.yaml": CONFIG}
    pid = node.run_kubeadm_kubelet([DROP_IN.read_text()], files, package)
    argv = node.argv(pid)
    # Both of kubeadm's files name containerd's socket, and both reached kubelet's command line:
    assert "--node-ip=10.0.0.5" in argv and argv.count(f"--container-runtime-endpoint={CONTAINERD_SOCKET}") == 2, argv
    code, output = run_check(node)
    assert code == 0, output
    assert f"✓ kubelet (pid {pid}) sends runtime calls to koordrp, unix://{node.koordrp_socket} (its flag --container-runtime-endpoint)" in output
    assert f"✓ kubelet (pid {pid}) sends image calls to koordrp" in output
    assert "✓ koordrp answers at" in output and "its runtime behind it (containerd" in output


def test_a_kubeadm_node_where_etc_default_kubelet_overrides_the_old_drop_in(node: FakeNode) -> None:
    node.run_kubeadm_kubelet(
        [OLD_DROP_IN],
        {"/etc/default/kubelet": EXTRA_ARGS, "/var/lib/kubelet/kubeadm-flags.env": KUBEADM_FLAGS, "/var/lib/kubelet/config.yaml": CONFIG},
    )
    code, output = run_check(node)
    assert code == 1
    assert f"sends runtime calls to {CONTAINERD_SOCKET} (its flag --container-runtime-endpoint), not to koordrp" in output
    assert "install tap/kubeadm/20-koordrp.conf" in output


def test_a_kubelet_config_file(node: FakeNode) -> None:
    config = node.write("/var/lib/kubelet/config.yaml", CONFIG.replace(CONTAINERD_SOCKET, f"unix://{node.koordrp_socket}"))
    node.run_kubelet(["/usr/local/bin/kubelet", f"--config={config}", "--v=2"])
    code, output = run_check(node)
    assert code == 0, output
    assert f"(its config file {config}, containerRuntimeEndpoint)" in output
    assert f"sends image calls to koordrp, unix://{node.koordrp_socket} (as the runtime endpoint: its config file" in output


def test_a_flag_wins_over_the_config_file(node: FakeNode) -> None:
    config = node.write("/var/lib/kubelet/config.yaml", CONFIG.replace(CONTAINERD_SOCKET, f"unix://{node.koordrp_socket}"))
    node.run_kubelet(["kubelet", "--config", config, f"--container-runtime-endpoint={CONTAINERD_SOCKET}"])
    code, output = run_check(node)
    assert code == 1
    assert marks(output)[:2] == ["✗", "✗"], output
    assert "a flag on kubelet's command line decides" in output


def test_plain_flags(node: FakeNode) -> None:
    socket = f"unix://{node.koordrp_socket}"
    node.run_kubelet(["/usr/bin/kubelet", "--container-runtime-endpoint", socket, f"--image-service-endpoint={socket}"])
    assert run_check(node)[0] == 0


def test_hook_servers_as_koordrp_reads_them_and_containerds_nri(
    node: FakeNode, servers: dict[str, FakeHookServer], workdir: Path
) -> None:
    socket = f"unix://{node.koordrp_socket}"
    node.run_kubelet(["kubelet", f"--container-runtime-endpoint={socket}"])
    hooks = node.root / "etc/runtime/hookserver.d"
    serving = hook_server(servers, workdir, "serving")
    register(hooks, "10-serving", serving.path, ["PreCreateContainer"])
    register(hooks, "20-gone", str(workdir / "nobody.sock"), ["PreRunPodSandbox"])
    register(hooks, "30-bad", serving.path, ["PreRunPodSandbox"], policy="Sometimes")
    node.write("/etc/containerd/config.toml", 'version = 2\n[plugins."io.containerd.nri.v1.nri"]\n  disable = false\n')
    code, output = run_check(node)
    assert code == 1
    assert f"✓ {hooks}/10-serving.json registers 10-serving.json ({serving.path}, Ignore, 60s): PreCreateContainer; its socket accepts connections" in output
    assert f"✗ {hooks}/20-gone.json registers" in output and "its socket does not accept connections: No such file or directory" in output
    assert f'✗ {hooks}/30-bad.json is rejected: "failure-policy" must be "Fail" or "Ignore", not "Sometimes"' in output
    assert "✗ containerd's NRI is enabled" in output and "2 hook server(s) are registered" in output
    node.write("/etc/containerd/config.toml", "version = 2\n")
    assert "✓ containerd's NRI is disabled" in run_check(node)[1]


def test_koordrp_without_its_runtime(containerd: Containerd, workdir: Path) -> None:
    proxy = KoordrpProcess(workdir, str(workdir / "no-containerd.sock"))
    proxy.start()
    try:
        node = FakeNode(workdir / "node", str(proxy.socket))
        node.run_kubelet(["kubelet", f"--container-runtime-endpoint=unix://{proxy.socket}"])
        code, output = run_check(node)
    finally:
        proxy.stop()
    assert code == 1
    assert f"✓ koordrp answers at unix://{proxy.socket}" in output
    assert f"✗ backend unix://{workdir}/no-containerd.sock is unavailable" in output
    code, output = run_check(node)
    assert code == 1 and f"✗ nothing listens at unix://{proxy.socket}: no socket there" in output


def test_versions() -> None:
    for argv in (["--version"], ["check", "--version"]):
        result = subprocess.run([str(Path(sys.executable).with_name("koordrp")), *argv], capture_output=True, text=True)
        assert (result.returncode, result.stdout) == (0, f"koordrp {koordrp_version()}\n")
