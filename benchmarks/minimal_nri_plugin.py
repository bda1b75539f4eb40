"""The floor koordrp's NRI mode is measured against: the least an NRI plugin can do.

    python -m benchmarks.minimal_nri_plugin NRI_SOCKET

It registers, subscribes to the events koordrp subscribes to, and answers each at once with an empty
answer, on koordrp's own connection layer (koordrp.nri.connection: NRI's multiplexer and ttrpc as a
Twisted protocol): no flows, no store, no hooks, no log lines. What it adds to a pod start is what
containerd and the round trips of those events cost any plugin.
"""

import subprocess
import sys
from typing import Callable, ContextManager

from twisted.internet import reactor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.endpoints import UNIXClientEndpoint
from twisted.internet.interfaces import IReactorCore, IReactorTime
from twisted.internet.protocol import Factory
from twisted.python.failure import Failure

from koordrp.api.nri.v1alpha1 import api_pb2 as nri
from koordrp.nri.connection import NRIConnection
from benchmarks.processes import running_module
from koordrp.nri.plugin import EVENT_MASK, REGISTER_SECONDS

_ANSWERS = {
    "Configure": nri.ConfigureResponse(events=EVENT_MASK).SerializeToString(),
    "CreateContainer": nri.CreateContainerResponse().SerializeToString(),
    "UpdateContainer": nri.UpdateContainerResponse().SerializeToString(),
    "StopContainer": nri.StopContainerResponse().SerializeToString(),
}
_EMPTY = nri.Empty().SerializeToString()


class MinimalPlugin:
    def made(self, connection: NRIConnection) -> None:
        request = nri.RegisterPluginRequest(plugin_name="minimal", plugin_idx="10")
        connection.call("RegisterPlugin", request.SerializeToString(), REGISTER_SECONDS)

    def called(self, method: str, payload: bytes, timeout: float | None) -> "Deferred[bytes]":
        if method == "Synchronize":
            print("ready", flush=True)  # registered and synchronized: containerd calls it from now on
            return succeed(nri.SynchronizeResponse().SerializeToString())
        return succeed(_ANSWERS.get(method, _EMPTY))

    def oversized(self, length: int) -> None:
        print(f"containerd sent a request of {length} bytes, beyond ttrpc's limit", file=sys.stderr, flush=True)

    def lost(self, reason: Failure) -> None:
        core = IReactorCore(reactor)
        if core.running:  # not when SIGTERM stopped it, and closing the connection brought us here
            core.stop()


def serve(nri_socket: str, plugin: Callable[[], MinimalPlugin] = MinimalPlugin) -> None:
    """Run ``plugin`` as containerd's NRI plugin at ``nri_socket`` until the connection is lost."""
    clock = IReactorTime(reactor)
    endpoint = UNIXClientEndpoint(reactor, nri_socket)  # type: ignore[no-untyped-call]
    endpoint.connect(Factory.forProtocol(lambda: NRIConnection(plugin(), clock)))  # type: ignore[no-untyped-call]
    IReactorCore(reactor).run()


def main() -> None:
    serve(sys.argv[1])


def running(nri_socket: str) -> ContextManager["subprocess.Popen[bytes]"]:
    """This plugin as a process of its own, registered with the containerd at ``nri_socket`` until the block ends."""
    return running_module("benchmarks.minimal_nri_plugin", nri_socket)


if __name__ == "__main__":
    main()
