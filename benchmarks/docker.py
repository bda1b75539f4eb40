"""Docker mode pass-through cost: the same Docker API calls to dockerd directly and through koordrp.

Starts a private dockerd and ``twistd -n koordrp --backend-runtime-mode=Docker`` in front of it, then
prints p50/p99 of ``GET /containers/json`` (``--calls``, 10 containers present) and of
``POST /containers/{id}/start`` (``--starts``, a container started and stopped again each time),
both ways, with their ratio.

    .venv/bin/python -m benchmarks.docker [--calls 1000] [--starts 50]
"""

import argparse
import json
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from benchmarks.stats import quantile, timed
from tests.support.dockerd import Dockerd, unix_http
from tests.support.images import BUSYBOX_REF, build_test_images
from tests.support.koordrp_process import KoordrpProcess


@contextmanager
def docker_mode() -> Iterator[tuple[Path, Dockerd, KoordrpProcess]]:
    """A private dockerd and ``twistd -n koordrp --backend-runtime-mode=Docker`` in front of it, in a scratch directory."""
    with tempfile.TemporaryDirectory(prefix="krp-bench-", dir="/tmp") as scratch:
        base = Path(scratch)
        dockerd = Dockerd(base / "dockerd")
        dockerd.start()
        proxy = KoordrpProcess(base, dockerd.host, ["--backend-runtime-mode=Docker"])
        try:
            proxy.start()
            yield base, dockerd, proxy
        finally:
            proxy.stop()
            dockerd.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--starts", type=int, default=50)
    args = parser.parse_args()
    with docker_mode() as (base, dockerd, proxy):
        dockerd.load_images(build_test_images(base / "images"))
        measure(args, dockerd, proxy)


def measure(args: argparse.Namespace, dockerd: Dockerd, proxy: KoordrpProcess) -> None:
    for index in range(10):
        dockerd.docker("create", "--network", "none", "--name", f"bench-{index}", BUSYBOX_REF, "sleep", "3600", check=True)
    sockets = {"direct": dockerd.socket, "koordrp": proxy.socket}
    rows: dict[str, dict[str, list[float]]] = {"GET /containers/json": {}, "POST /containers/{id}/start": {}}
    for label, socket in sockets.items():
        rows["GET /containers/json"][label] = timed(
            args.calls, lambda _: unix_http(socket, "GET", "/v1.41/containers/json?all=1")
        )
    container = json.loads(dockerd.docker("inspect", "bench-0", check=True).stdout)[0]["Id"]
    for label, socket in sockets.items():
        samples = []
        for _ in range(args.starts):
            started = time.perf_counter()
            status = unix_http(socket, "POST", f"/v1.41/containers/{container}/start")[0]
            samples.append(time.perf_counter() - started)
            assert status == 204, status
            unix_http(dockerd.socket, "POST", f"/v1.41/containers/{container}/kill")
            unix_http(dockerd.socket, "POST", f"/v1.41/containers/{container}/wait")
        rows["POST /containers/{id}/start"][label] = samples
    print(f"Docker API, direct vs through koordrp ({args.calls} list calls, {args.starts} starts)")
    print(f"{'call':<30}{'direct p50':>12}{'koordrp p50':>13}{'added':>10}{'ratio':>7}{'direct p99':>12}{'koordrp p99':>13}")
    for call, by_path in rows.items():
        d50, k50 = statistics.median(by_path["direct"]), statistics.median(by_path["koordrp"])
        d99, k99 = quantile(by_path["direct"], 0.99), quantile(by_path["koordrp"], 0.99)
        print(
            f"{call:<30}{d50 * 1e3:>10.2f}ms{k50 * 1e3:>11.2f}ms{(k50 - d50) * 1e3:>8.2f}ms{k50 / d50:>7.2f}"
            f"{d99 * 1e3:>10.2f}ms{k99 * 1e3:>11.2f}ms"
        )


if __name__ == "__main__":
    main()
