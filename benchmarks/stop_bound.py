"""How long SIGTERM takes to end koordrp while a post hook server is wedged, proxy and NRI mode.

    .venv/bin/python -m benchmarks.stop_bound [--grace 10] [--rounds 3] [--mode proxy --mode nri] [--release 2.1]
        [--others 20] [--meanwhile] [--checkout DIR]

A private containerd (the machine's 1.6 for the proxy, a release with NRI for NRI mode), koordrp with
``--grace-period`` ``--grace``, and hook servers on PostStopContainer (in this process): one wedged (it
takes the call and never answers; its own timeout is an hour), registered first, and one that answers at
once (``--others``: that many more registrations of it). Each round: a pod of one running container made
and stopped through the front end (the wedged server holds the stop's post hook), then SIGTERM; with
``--meanwhile`` (NRI mode), a pod made and removed on containerd while koordrp drains. It prints, as
seconds after SIGTERM (p50 and max over the rounds):

* **SIGTERM received**, **cut** (koordrp's warning that it cut the wedged post hook), **loop ended**
  (twistd's "Main loop terminated.": every service stopped, the reactor's shutdown done), from koordrp's
  own log;
* **exit**: the process's exit, as this process sees it (``wait``);

and the stop's bound, ``--grace`` + 1 s, beside them. koordrp logs here with microseconds
(``log_observer``, through twistd's ``--logger``) instead of twistd's file log (whole seconds).
``--checkout DIR`` runs another checkout's code (first on koordrp's ``PYTHONPATH``), with this
virtualenv, to compare.

A server that never answers the connection (``tests/support/wedged.py``) does not hold a post hook:
grpc fails the call at once ("connection attempt timed out before receiving SETTINGS frame").
"""

import argparse
import os
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from cri_api.v1 import api_pb2
from twisted.logger import ILogObserver, textFileLogObserver

from tests.fake.hook_server import FakeHookServer
from tests.support.containerd import NRI_RELEASES, Containerd
from tests.support.hook_registration import register
from tests.support.images import ImageSet, build_test_images
from tests.support.koordrp_process import KoordrpProcess
from tests.support.cri_objects import container_config, pod_sandbox_config
from tests.support.images import BUSYBOX_REF
from tests.support.pods import TIMEOUT, remove_pod, start_container
from tests.support.stack import start_containerd

ROOT = Path(__file__).resolve().parents[1]
LOG_VARIABLE = "KOORDRP_BENCH_LOG"
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%f%z"
POST_STOP = "PostStopContainerHook"
PHASES = {
    "SIGTERM received": "SIGTERM received: shutting down",
    "cut": "cut at the stop's bound",
    "loop ended": "Main loop terminated.",
}


def log_observer() -> ILogObserver:
    """twistd's ``--logger``: its text lines, timed to the microsecond, in the file ``$KOORDRP_BENCH_LOG`` names."""
    return textFileLogObserver(open(os.environ[LOG_VARIABLE], "a"), timeFormat=_TIME_FORMAT)


class FinelyLogged(KoordrpProcess):
    """koordrp whose log lines carry microseconds (``log_observer``), in the same file ``log()`` reads; ``checkout``:
    another checkout's code run instead (first on its ``PYTHONPATH``), with this virtualenv."""

    checkout: Path | None = None

    def argv(self) -> list[str]:
        self.environ[LOG_VARIABLE] = str(self.logfile)
        code = [str(self.checkout)] if self.checkout is not None else []
        self.environ["PYTHONPATH"] = os.pathsep.join([*code, str(ROOT), *filter(None, [self.environ.get("PYTHONPATH")])])
        return [
            "--logger=benchmarks.stop_bound.log_observer" if argument.startswith("--logfile=") else argument
            for argument in super().argv()
        ]

    def logged_at(self, text: str) -> float | None:
        """When koordrp logged the first line with ``text`` in it (seconds since the epoch)."""
        for line in self.log().splitlines():
            if text in line:
                return datetime.strptime(line.split(" ", 1)[0], _TIME_FORMAT).timestamp()
        return None


def wait(condition: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"not within {timeout:g}s: {what}")
        time.sleep(0.005)


@dataclass(frozen=True)
class Setting:
    grace: float
    others: int
    """Registrations of answering servers beside the two."""
    meanwhile: bool
    """NRI mode: a pod of one container made and removed on containerd while koordrp drains (it is still its plugin)."""
    checkout: Path | None
    """Another checkout's code, run with this virtualenv."""


def one_stop(work: Path, containerd: Containerd, nri: bool, setting: Setting) -> dict[str, float]:
    """One round: seconds after SIGTERM of each phase."""
    answering, wedged = (FakeHookServer(str(work / f"{name}.sock")).start() for name in ("answering", "wedged"))
    wedged.delays[POST_STOP] = 3600
    try:
        hooks = work / "hookserver.d"
        hour: dict[str, Any] = {"timeout-seconds": 3600}
        register(hooks, "a-wedged", wedged.path, ["PostStopContainer"], **hour)
        register(hooks, "b-answering", answering.path, ["PostStopContainer"])
        for index in range(setting.others):
            register(hooks, f"c-{index:03}", answering.path, ["PostStopContainer"])
        koordrp = FinelyLogged(
            work, containerd.endpoint, [f"--grace-period={setting.grace:g}"], nri_socket=containerd.paths.nri_socket if nri else None
        )
        koordrp.checkout = setting.checkout
        koordrp.start()
        try:
            koordrp.wait_for_servers(2 + setting.others, timeout=60)
            channel = None if nri else koordrp.channel()
            # Made and stopped through the front end (in NRI mode containerd is it); removed on containerd itself.
            runtime = containerd.runtime() if channel is None else koordrp.runtime(channel)
            pod = pod_sandbox_config("stopped", log_directory=work / "stopped")
            sandbox_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=pod), timeout=TIMEOUT).pod_sandbox_id
            try:
                container = container_config("stopped", command=["sleep", "3600"], log_path="stopped.log", image=BUSYBOX_REF)
                container_id = start_container(runtime, sandbox_id, pod, container)
                runtime.StopContainer(api_pb2.StopContainerRequest(container_id=container_id, timeout=0), timeout=TIMEOUT)
                wait(lambda: wedged.rpcs() == [POST_STOP], "the wedged server holding the stop's post hook")
                assert koordrp.process is not None
                sent = time.time()
                koordrp.process.send_signal(signal.SIGTERM)
                if nri and setting.meanwhile:
                    koordrp.log_lines("stopping: post hooks are still running")
                    made = pod_sandbox_config("meanwhile", log_directory=work / "meanwhile")
                    made_id = runtime.RunPodSandbox(api_pb2.RunPodSandboxRequest(config=made), timeout=TIMEOUT).pod_sandbox_id
                    config = container_config("meanwhile", command=["sleep", "3600"], log_path="meanwhile.log", image=BUSYBOX_REF)
                    start_container(runtime, made_id, made, config)
                    remove_pod(runtime, made_id)
                status = koordrp.process.wait(setting.grace + 60)
                exited = time.time()
            finally:
                if channel is not None:
                    channel.close()
                remove_pod(containerd.runtime(), sandbox_id)
            if status != 0:
                raise RuntimeError(f"koordrp exited with {status}:\n{koordrp.log()}")
        finally:
            koordrp.stop()
    finally:
        wedged.stop()
        answering.stop()
    figures = {"exit": exited - sent}
    for phase, text in PHASES.items():
        at = koordrp.logged_at(text)
        if at is None:
            raise RuntimeError(f"koordrp did not log {text!r}:\n{koordrp.log()}")
        figures[phase] = at - sent
    return figures


def measure(images: ImageSet, base: Path, mode: str, release: str, setting: Setting, rounds: int) -> dict[str, list[float]]:
    nri = mode == "nri"
    containerd = start_containerd(images, base / f"containerd-{mode}", release=release if nri else "1.6", nri=nri)
    figures: dict[str, list[float]] = {}
    try:
        for round_ in range(rounds):
            work = base / f"{mode}-{round_}"
            work.mkdir()
            for phase, seconds in one_stop(work, containerd, nri, setting).items():
                figures.setdefault(phase, []).append(seconds)
    finally:
        containerd.stop()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grace", type=float, default=10.0, help="koordrp's --grace-period")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=("proxy", "nri"), action="append", help="default: both")
    parser.add_argument("--release", choices=NRI_RELEASES, default=NRI_RELEASES[-1], help="NRI mode's containerd")
    parser.add_argument("--others", type=int, default=0, help="registrations of answering servers beside the two")
    parser.add_argument("--meanwhile", action="store_true", help="NRI mode: a pod made and removed while koordrp drains")
    parser.add_argument("--checkout", type=Path, help="another checkout's code, run with this virtualenv (to compare)")
    args = parser.parse_args()
    setting = Setting(args.grace, args.others, args.meanwhile, args.checkout)
    with tempfile.TemporaryDirectory(prefix="krp-stop-", dir="/tmp") as scratch:
        images = build_test_images(Path(scratch) / "images")
        for mode in args.mode or ["proxy", "nri"]:
            figures = measure(images, Path(scratch), mode, args.release, setting, args.rounds)
            where = f"containerd {args.release}" if mode == "nri" else "containerd 1.6"
            print(f"== {mode} ({where}), --grace-period {args.grace:g}: seconds after SIGTERM, {args.rounds} rounds")
            for phase, values in figures.items():
                print(f"  {phase:<18} p50 {statistics.median(values):7.3f}   max {max(values):7.3f}")
            print(f"  {'bound':<18}     {args.grace + 1:7.3f}")


if __name__ == "__main__":
    main()
