"""koordrp's hook client against a hook server on grpc-go, the library koordlet's own is built on.

The Python hook servers of the other tests speak grpcio's HTTP/2; koordlet speaks grpc-go's: its HPACK
(Huffman-coded strings, a dynamic table the next headers refer to), its BDP PINGs and WINDOW_UPDATEs, its
SETTINGS, its GOAWAY when it stops. tests/go_hook_server (built into .deps/go-hook-server by scripts/build-go,
which scripts/test runs) is such a server, answering as koordlet's proxyserver does (the request's fields
copied into the response) with the cgroup parent or the cpuset its default plugins would set, or failing,
or late. Here koordrp's ``HookClient`` calls it on the real reactor (pytest-twisted): many calls on one
connection, at once, large ones, refusals, a late answer, a server that stops or dies and comes back; and
koordrp in front of containerd applies what it answers to a pod.
"""

import json
from pathlib import Path
from typing import Any, Callable, Coroutine, Iterator, TypeVar

import pytest
import pytest_twisted  # type: ignore[import-untyped]
from cri_api.v1 import api_pb2
from twisted.internet import reactor
from twisted.internet.defer import gatherResults

from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.hooks.client import HookCallError, HookClient, HookTimedOut
from koordrp.hooks.messages import HookRequest, HookResponse
from koordrp.hooks.types import HookType
from tests.e2e.conftest import require, wait_registered
from tests.support import koordlet
from tests.support.daemons import remove_cgroup
from tests.support.go_hook_server import CGROUP_PARENT, CPUSET, GoHookServer, echo_answer, require_binary
from tests.support.koordrp_process import KoordrpProcess
from tests.support.pods import running_container, runtime_spec

CALL_TIMEOUT = 15.0
"""A bound for a loaded test machine, not a measure of speed: every call here is answered at once."""
HOOKS = list(HookType)

AsyncTest = TypeVar("AsyncTest", bound=Callable[..., Coroutine[Any, Any, None]])


def on_reactor(test: AsyncTest) -> AsyncTest:
    """The coroutine ``test`` runs on the reactor: pytest-twisted's mark (its ensureDeferred only marks it)."""
    marked: AsyncTest = pytest_twisted.ensureDeferred(test)
    return marked


@pytest.fixture(scope="session")
def go_hook_server_built() -> None:
    """The server is built: if not, the tests skip (saying to run scripts/build-go), and in CI fail."""
    require(require_binary, "grpc-go hook server")


@pytest.fixture
def go_server(go_hook_server_built: None, workdir: Path) -> Iterator[Callable[..., GoHookServer]]:
    """Starts the server on the test's socket with these arguments; every one started is stopped at the end."""
    started: list[GoHookServer] = []

    def start(*args: str) -> GoHookServer:
        server = GoHookServer(workdir / "go-hook.sock", args).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def hook_client() -> Iterator[Callable[[GoHookServer], HookClient]]:
    """A HookClient on the server's socket, closed at the end."""
    clients: list[HookClient] = []

    def make(server: GoHookServer) -> HookClient:
        client = HookClient(server.endpoint, reactor)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def pod_request(index: int, annotations: int = 2, value: str = "") -> hook.PodSandboxHookRequest:
    return hook.PodSandboxHookRequest(
        pod_meta=hook.PodSandboxMetadata(name=f"pod-{index}", uid=f"3f1c-{index:04}", namespace="default"),
        runtime_handler="runc",
        labels={"app": "go-hook", "koordrp.test/index": str(index)},
        annotations={f"koordrp.test/annotation-{n:05}": f"{value}{index}-{n:05}" for n in range(annotations)},
        cgroup_parent=f"/kubepods/besteffort/pod3f1c-{index:04}",
        resources=hook.LinuxContainerResources(cpu_shares=2 + index, memory_limit_in_bytes=64 << 20),
    )


def container_request(index: int, annotations: int = 2, value: str = "") -> hook.ContainerResourceHookRequest:
    return hook.ContainerResourceHookRequest(
        pod_meta=hook.PodSandboxMetadata(name=f"pod-{index}", uid=f"3f1c-{index:04}", namespace="default"),
        container_meta=hook.ContainerMetadata(name="main", attempt=index % 3, id=f"{index:064x}"),
        container_annotations={f"koordrp.test/annotation-{n:05}": f"{value}{index}-{n:05}" for n in range(annotations)},
        container_resources=hook.LinuxContainerResources(cpu_shares=2 + index, cpuset_cpus="0-1", cpu_quota=-1),
        pod_annotations={"koordrp.test/pod": str(index)},
        pod_labels={"app": "go-hook"},
        pod_cgroup_parent=f"/kubepods/burstable/pod3f1c-{index:04}",
        container_envs={"INDEX": str(index), "PATH": "/bin"},
    )


def request_for(hook_type: HookType, index: int, annotations: int = 2, value: str = "") -> HookRequest:
    if hook_type.is_pod_hook:
        return pod_request(index, annotations, value)
    return container_request(index, annotations, value)


def sized_request(hook_type: HookType, index: int, size: int) -> HookRequest:
    """A request of ``hook_type`` of at most ``size`` bytes, and less than one annotation short of it."""
    value = "v" * 200
    bare = request_for(hook_type, index, 0, value).ByteSize()
    entry = request_for(hook_type, index, 1, value).ByteSize() - bare
    return request_for(hook_type, index, (size - bare) // entry, value)


async def call(client: HookClient, hook_type: HookType, request: HookRequest, timeout: float = CALL_TIMEOUT) -> HookResponse:
    return await client.call(hook_type, request, timeout)


async def refusal(client: HookClient, hook_type: HookType, request: HookRequest, timeout: float = CALL_TIMEOUT) -> HookCallError:
    """The HookCallError the call fails with (AssertionError if it is answered)."""
    try:
        response = await call(client, hook_type, request, timeout)
    except HookCallError as error:
        return error
    raise AssertionError(f"{hook_type.rpc_name} was answered: {response}")


def assert_echoed(hook_type: HookType, request: HookRequest, response: HookResponse) -> None:
    assert response == echo_answer(hook_type, request), f"{hook_type.rpc_name}: {response} for {request}"


@on_reactor
async def test_many_calls_on_one_connection_each_answered(
    go_server: Callable[..., GoHookServer], hook_client: Callable[[GoHookServer], HookClient]
) -> None:
    """500 calls one after another, every hook in turn: grpc-go's HPACK table fills and is referred to, its
    PINGs (BDP estimation) and WINDOW_UPDATEs come and go between them."""
    client = hook_client(go_server())
    for index in range(500):
        hook_type = HOOKS[index % len(HOOKS)]
        request = request_for(hook_type, index)
        assert_echoed(hook_type, request, await call(client, hook_type, request))


@on_reactor
async def test_concurrent_calls_each_get_their_own_answer(
    go_server: Callable[..., GoHookServer], hook_client: Callable[[GoHookServer], HookClient]
) -> None:
    client = hook_client(go_server())
    # One call first, so that the 50 share the connection it opened.
    await call(client, HookType.PRE_START_CONTAINER, container_request(0))
    calls = [(HOOKS[index % len(HOOKS)], request_for(HOOKS[index % len(HOOKS)], index)) for index in range(50)]
    responses = await gatherResults([client.call(hook_type, request, CALL_TIMEOUT) for hook_type, request in calls])
    for (hook_type, request), response in zip(calls, responses):
        assert_echoed(hook_type, request, response)


@pytest.mark.parametrize(
    ("size", "hook_type"),
    [(70 << 10, HookType.PRE_RUN_POD_SANDBOX), ((1 << 20) - (16 << 10), HookType.PRE_CREATE_CONTAINER)],
    ids=["70KiB", "1MiB"],
)
@on_reactor
async def test_large_requests_are_answered(
    size: int, hook_type: HookType, go_server: Callable[..., GoHookServer], hook_client: Callable[[GoHookServer], HookClient]
) -> None:
    """Larger than HTTP/2's initial window (64 KiB), and close to 1 MiB: both ways flow control opens the
    windows as the messages go (the answer, its annotations copied, is as large)."""
    client = hook_client(go_server())
    request = sized_request(hook_type, 7, size)
    assert size - 300 < request.ByteSize() <= size
    response = await call(client, hook_type, request)
    assert_echoed(hook_type, request, response)
    assert response.ByteSize() > 64 << 10
    # And the connection still serves a small call after them.
    small = request_for(hook_type, 8)
    assert_echoed(hook_type, small, await call(client, hook_type, small))


@pytest.mark.parametrize(
    "code", ["INVALID_ARGUMENT", "NOT_FOUND", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "INTERNAL", "UNKNOWN"]
)
@on_reactor
async def test_a_status_the_server_sends_is_named(
    code: str, go_server: Callable[..., GoHookServer], hook_client: Callable[[GoHookServer], HookClient]
) -> None:
    """Codes a hook server itself answers with (not UNAVAILABLE, CANCELLED or DEADLINE_EXCEEDED, which are also
    grpc's words for a server not reached or a call given up)."""
    client = hook_client(go_server("--fail", code))
    for hook_type in (HookType.PRE_RUN_POD_SANDBOX, HookType.PRE_CREATE_CONTAINER):
        error = await refusal(client, hook_type, request_for(hook_type, 1))
        assert not isinstance(error, HookTimedOut), error
        assert code in str(error), str(error)
        assert error.sent_back, f"{code} came from the server, but sent_back is False: {error}"


@on_reactor
async def test_an_answer_later_than_the_timeout_is_a_timeout(
    go_server: Callable[..., GoHookServer], hook_client: Callable[[GoHookServer], HookClient]
) -> None:
    """grpc-go ends a call itself once the grpc-timeout the client sent has passed: RST_STREAM (CANCEL), no status.
    That comes at about the moment the client's own bound does; either way, the call timed out. Ten calls, one after
    another, since which of the two comes first varies."""
    client = hook_client(go_server("--delay", "20s"))
    others = []
    for index in range(10):
        # A call that waited for the server would end in its answer, 20 s on: a timeout is the call ended at its bound.
        error = await refusal(client, HookType.PRE_CREATE_CONTAINER, container_request(index), timeout=0.5)
        if not isinstance(error, HookTimedOut):
            others.append(f"{type(error).__name__}: {error}")
    assert not others, f"{len(others)} of 10 calls did not time out: {others}"


@pytest.mark.parametrize("called_while_down", [False, True], ids=["restarted", "called-while-down"])
@pytest.mark.parametrize("how", ["stopped", "killed"])
@on_reactor
async def test_the_next_call_after_the_server_comes_back_is_answered(
    how: str, called_while_down: bool, go_server: Callable[..., GoHookServer], hook_client: Callable[[GoHookServer], HookClient]
) -> None:
    """Stopped, grpc-go sends GOAWAY and removes its socket; killed, the connection just drops and the socket file
    stays (a call then is refused by the kernel). Either way the server is back on the same socket, and the very
    next call must reach it: the client connects again, with no backoff to wait out."""
    server = go_server()
    client = hook_client(server)
    request = container_request(1)
    assert_echoed(HookType.PRE_CREATE_CONTAINER, request, await call(client, HookType.PRE_CREATE_CONTAINER, request))
    if how == "killed":
        server.kill()
    else:
        server.stop()
    if called_while_down:
        error = await refusal(client, HookType.PRE_CREATE_CONTAINER, request)
        assert not isinstance(error, HookTimedOut), error
        assert not error.sent_back, error
    server.start()
    request = container_request(2)
    assert_echoed(HookType.PRE_CREATE_CONTAINER, request, await call(client, HookType.PRE_CREATE_CONTAINER, request))


def test_koordrp_applies_what_the_go_server_answers_to_a_pod(
    go_server: Callable[..., GoHookServer], koordrp: KoordrpProcess, runtime: Any, workdir: Path, hooks_dir: Path
) -> None:
    """koordrp in front of containerd 1.6, the Go server registered as koordlet registers itself (its stages, its
    file's bytes): the pod's sandbox and container get the cgroup parent it answers, the container its cpuset."""
    server = go_server()
    koordlet.register(hooks_dir, koordlet.registration(server.endpoint, koordlet.DEFAULT_STAGES))
    wait_registered(koordrp, 1)
    try:
        with running_container(runtime, "gohook", workdir) as pod:
            sandbox = runtime.PodSandboxStatus(api_pb2.PodSandboxStatusRequest(pod_sandbox_id=pod.sandbox_id, verbose=True))
            sandbox_spec = json.loads(sandbox.info["info"])["runtimeSpec"]
            assert sandbox_spec["linux"]["cgroupsPath"].startswith(CGROUP_PARENT + "/"), sandbox_spec["linux"]
            spec = runtime_spec(runtime, pod.container_id)
            assert spec["linux"]["cgroupsPath"].startswith(CGROUP_PARENT + "/"), spec["linux"]
            assert spec["linux"]["resources"]["cpu"]["cpus"] == CPUSET, spec["linux"]["resources"]
        [run] = koordrp.log_lines("[koordrp.calls#info] RunPodSandbox pod default/gohook")
        assert "PreRunPodSandbox@koordlet.json: ok" in run and f'→"{CGROUP_PARENT}"' in run, run
        [create] = koordrp.log_lines("[koordrp.calls#info] CreateContainer pod default/gohook")
        assert "PreCreateContainer@koordlet.json: ok" in create and f'resources.cpuset_cpus ""→"{CPUSET}"' in create, create
    finally:
        remove_cgroup(CGROUP_PARENT)
