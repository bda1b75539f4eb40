"""/metrics and /healthz, served on a unix endpoint as on TCP."""

import os
import socket

from twisted.internet import reactor
from twisted.internet.defer import fail, inlineCallbacks, succeed
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from koordrp.hooks.messages import PodHookRequest
from koordrp.metrics import Metrics
from koordrp.store import Store
from koordrp.web import metrics_service
from tests.support.tempdirs import short_tempdir


def get(path: str, url_path: str) -> bytes:
    """A whole HTTP/1.0 answer to GET ``url_path``, from the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(path)
        client.sendall(f"GET {url_path} HTTP/1.0\r\n\r\n".encode())
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    return answer


class UnixEndpointTests(TestCase):
    @inlineCallbacks
    def test_metrics_and_health_answer_on_a_unix_socket(self):  # type: ignore[no-untyped-def]
        path = os.path.join(short_tempdir(self), "metrics.sock")
        metrics = Metrics()
        metrics.cri_call("StartContainer", "OK", 0.002)
        store = Store()
        metrics.watch_store(store)
        store.put_pod("p1", PodHookRequest(), PodHookRequest())
        served = metrics_service(f"unix:{path}", metrics, lambda: succeed(None), reactor)
        served.startService()
        self.addCleanup(served.stopService)
        scraped = yield deferToThread(get, path, "/metrics")
        self.assertTrue(scraped.startswith(b"HTTP/1.0 200 OK"), scraped[:200])
        self.assertIn(b'koordrp_cri_calls_total{code="OK",method="StartContainer"} 1.0', scraped)
        for sample in (b"koordrp_store_pods 1.0", b"koordrp_store_containers 0.0", b"koordrp_state_files 0.0"):
            self.assertIn(b"\n" + sample + b"\n", scraped)
        self.assertIn(b"\nkoordrp_state_files_unreadable_total 0.0\n", scraped)
        health = yield deferToThread(get, path, "/healthz")
        self.assertTrue(health.startswith(b"HTTP/1.0 200 OK") and health.endswith(b"ok: the backend answers\n"), health)

    @inlineCallbacks
    def test_alive_while_the_runtime_is_away(self):  # type: ignore[no-untyped-def]
        path = os.path.join(short_tempdir(self), "metrics.sock")
        served = metrics_service(f"unix:{path}", Metrics(), lambda: fail(RuntimeError("containerd is away")), reactor)
        served.startService()
        self.addCleanup(served.stopService)
        health = yield deferToThread(get, path, "/healthz")
        self.assertTrue(health.startswith(b"HTTP/1.0 503") and health.endswith(b"unhealthy: containerd is away\n"), health)
        live = yield deferToThread(get, path, "/livez")
        self.assertTrue(live.startswith(b"HTTP/1.0 200 OK") and live.endswith(b"ok: koordrp's reactor answers\n"), live)
