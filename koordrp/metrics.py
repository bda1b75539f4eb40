"""What an operator scrapes: CRI calls, hook calls, registrations, the store, the backend, the process.

Off unless ``--metrics-endpoint`` is given: then every CRI call pays for one counter and one
histogram update (a few microseconds), which the pass-through path is otherwise spared.
"""

import time
from typing import Callable, Iterable, Iterator, Protocol, TypeVar

import grpc
from cri_api.v1 import api_pb2 as cri_v1
from cri_api.v1alpha2 import api_pb2 as cri_v1alpha2
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

Request = TypeVar("Request")
"""A streaming call's request: bytes, or an iterator of them."""

OTHER_METHOD = "other"
"""The method label of a call to a method koordrp's CRI schemas do not name: the label set is closed, whatever
names clients call."""


def _cri_methods() -> frozenset[str]:
    """Every ``/service/Method`` of CRI v1 and v1alpha2 (``cri.methods.KNOWN_METHODS``, from the same descriptors)."""
    return frozenset(
        f"/{service.full_name}/{method.name}"
        for module in (cri_v1, cri_v1alpha2)
        for service in module.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    )


CRI_METHODS = _cri_methods()
CRI_METHOD_NAMES = frozenset(method.rsplit("/", 1)[-1] for method in CRI_METHODS)


def method_label(method: str) -> str:
    """``method`` as the label ``koordrp_cri_calls_total`` and ``koordrp_cri_call_seconds`` give it: a CRI method's
    name (from its full ``/service/Method`` path, or the name alone), else ``other``."""
    if method.startswith("/"):
        return method.rsplit("/", 1)[-1] if method in CRI_METHODS else OTHER_METHOD
    return method if method in CRI_METHOD_NAMES else OTHER_METHOD


# CRI calls range from ~0.5 ms (queries) to minutes (image pulls).
_CRI_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_HOOK_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10)


class StoreSizes(Protocol):
    """What ``koordrp.store.Store`` tells of its size, as the metrics read it (the store is not imported here:
    every module that counts imports this one)."""

    @property
    def unreadable_state_files(self) -> int: ...

    def sizes(self) -> tuple[int, int]: ...

    def state_files(self) -> int: ...


class WriteFailures(Protocol):
    """What ``koordrp.checkpoint.Checkpoint`` counts of the writes it could not make."""

    @property
    def write_failures(self) -> int: ...


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.cri_calls = Counter(
            "koordrp_cri_calls", "CRI calls answered, by method and status code", ["method", "code"], registry=self.registry
        )
        self.cri_seconds = Histogram(
            "koordrp_cri_call_seconds", "CRI call latency", ["method"], buckets=_CRI_BUCKETS, registry=self.registry
        )
        self.hook_calls = Counter(
            "koordrp_hook_calls",
            "hook calls by server, hook and result (ok, error, timeout, late, not-answering, skipped, unreadable)",
            ["server", "hook", "result"],
            registry=self.registry,
        )
        self.hook_seconds = Histogram(
            "koordrp_hook_call_seconds", "hook call latency", ["server", "hook"], buckets=_HOOK_BUCKETS, registry=self.registry
        )
        self.changes_left_alone = Counter(
            "koordrp_hook_changes_left_alone",
            "what hook answers asked that koordrp did not apply (the call's log line says why), by server, hook and field",
            ["server", "hook", "field"],
            registry=self.registry,
        )
        self.hook_servers = Gauge("koordrp_hook_servers", "registered hook servers", registry=self.registry)
        self.failed_attempts = Counter(
            "koordrp_failed_attempts",
            "failed attempts at what koordrp retries until it works, by activity (nri-registration, store-resync, "
            "docker-cgroup-driver); the log says when such a trouble starts and ends",
            ["activity"],
            registry=self.registry,
        )
        self.caught_up = Counter(
            "koordrp_caught_up",
            "pods and containers that got the pre hooks they missed while koordrp was away (NRI mode), by kind",
            ["kind"],
            registry=self.registry,
        )
        self.catch_up_unheard = Counter(
            "koordrp_catch_up_unheard",
            "catch-up pre hook calls a Fail-policy server did not answer (what it would refuse runs already), by server",
            ["server"],
            registry=self.registry,
        )
        self.backend_up = Gauge(
            "koordrp_backend_reachable", "1 while the backend is reachable", ["endpoint"], registry=self.registry
        )
        # process_open_fds and process_max_fds (the soft limit) among them: what /livez's 503 is about, so that an
        # alert can come before it (deploy/prometheus/). Three small reads of /proc/self per scrape.
        ProcessCollector(registry=self.registry)

    def watch_store(self, store: StoreSizes) -> None:
        self.registry.register(_StoreCollector(store))

    def watch_checkpoint(self, checkpoint: WriteFailures) -> None:
        self.registry.register(_CheckpointCollector(checkpoint))

    def hook_call(self, server: str, hook: str, result: str, seconds: float | None) -> None:
        self.hook_calls.labels(server, hook, result).inc()
        if seconds is not None:
            self.hook_seconds.labels(server, hook).observe(seconds)

    def cri_call(self, method: str, code: str, seconds: float) -> None:
        """One call answered: ``method`` is the CRI method (a Docker call, the one it stands for; one the schemas do
        not name is ``other``), ``code`` its status."""
        label = method_label(method)
        self.cri_calls.labels(label, code).inc()
        self.cri_seconds.labels(label).observe(seconds)

    def unary(
        self, method: str, behaviour: Callable[[bytes, grpc.ServicerContext], bytes]
    ) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        """``behaviour`` counted and timed; the code is the one the caller gets."""
        short = method_label(method)

        def counted(request: bytes, context: grpc.ServicerContext) -> bytes:
            started = time.perf_counter()
            code = "OK"
            try:
                return behaviour(request, context)
            except Exception:
                code = _code_name(context)
                raise
            finally:
                self.cri_call(short, code, time.perf_counter() - started)

        return counted

    def streaming(
        self, method: str, behaviour: Callable[[Request, grpc.ServicerContext], Iterator[bytes]]
    ) -> Callable[[Request, grpc.ServicerContext], Iterator[bytes]]:
        """``behaviour`` counted (not timed: a stream lasts as long as its caller wants)."""
        short = method_label(method)

        def counted(request: Request, context: grpc.ServicerContext) -> Iterator[bytes]:
            code = "OK"
            try:
                yield from behaviour(request, context)
            except Exception:
                code = _code_name(context)
                raise
            finally:
                self.cri_calls.labels(short, code).inc()

        return counted


class _StoreCollector(Collector):
    """What the store holds, read when /metrics is scraped."""

    def __init__(self, store: StoreSizes) -> None:
        self._store = store

    def collect(self) -> Iterable[Metric]:
        pods, containers = self._store.sizes()
        yield GaugeMetricFamily("koordrp_store_pods", "pods koordrp remembers", value=pods)
        yield GaugeMetricFamily("koordrp_store_containers", "containers koordrp remembers", value=containers)
        yield GaugeMetricFamily(
            "koordrp_state_files",
            "pods and containers for which what kubelet asked is kept in --state-dir",
            value=self._store.state_files(),
        )
        yield CounterMetricFamily(
            "koordrp_state_files_unreadable",
            "state files koordrp could not read (each one's hooks were shown what the runtime has)",
            value=self._store.unreadable_state_files,
        )


class _CheckpointCollector(Collector):
    """What could not be written in --state-dir, read when /metrics is scraped."""

    def __init__(self, checkpoint: WriteFailures) -> None:
        self._checkpoint = checkpoint

    def collect(self) -> Iterable[Metric]:
        yield CounterMetricFamily(
            "koordrp_state_file_write_failures",
            "writes and removals of state files in --state-dir that failed (the log names the first file for each reason)",
            value=self._checkpoint.write_failures,
        )


def _code_name(context: grpc.ServicerContext) -> str:
    code = context.code()  # type: ignore[attr-defined]
    return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
