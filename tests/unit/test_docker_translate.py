"""Docker Engine API JSON ⇄ hook requests (koordrp.docker.translate)."""

import copy
import json
from typing import Any, Callable

from twisted.trial.unittest import SynchronousTestCase

from koordrp.hooks import messages
from koordrp.api.runtime.v1alpha1 import api_pb2 as hook
from koordrp.adapters import LeftAlone
from koordrp.docker import inspect, translate
from koordrp.docker.translate import DockerShapeError
from koordrp.docker.translate import to_docker_cgroup_parent as to_docker
from koordrp.docker.translate import to_hook_cgroup_parent as to_hook

UID = "0f6a1c2e-7a3b-4c1d-9e8f-123456789abc"
SANDBOX_ID = "5b0c3f1e9d2a4b6c8e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d"
CONTAINER_ID = "9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b1a0f9e8d"
POD_SLICE = "kubepods-burstable-pod0f6a1c2e_7a3b_4c1d_9e8f_123456789abc.slice"
POD_PATH = "/kubepods.slice/kubepods-burstable.slice/" + POD_SLICE

SANDBOX_NAME = f"k8s_POD_web-5d9c7b_prod_{UID}_0"
CONTAINER_NAME = f"k8s_app_web-5d9c7b_prod_{UID}_1"

# POST /v1.41/containers/create?name=k8s_POD_... as cri-dockerd sends it (dockerd's systemd driver).
SANDBOX_BODY = """{
  "Hostname": "web-5d9c7b",
  "Domainname": "",
  "User": "",
  "AttachStdin": false,
  "AttachStdout": false,
  "AttachStderr": false,
  "Tty": false,
  "OpenStdin": false,
  "StdinOnce": false,
  "Env": null,
  "Cmd": null,
  "Image": "registry.k8s.io/pause:3.9",
  "Volumes": null,
  "WorkingDir": "",
  "Entrypoint": null,
  "OnBuild": null,
  "Labels": {
    "annotation.kubernetes.io/config.seen": "2024-05-02T10:11:12.123456789Z",
    "annotation.kubernetes.io/config.source": "api",
    "app": "web",
    "io.kubernetes.container.name": "POD",
    "io.kubernetes.docker.type": "podsandbox",
    "io.kubernetes.pod.name": "web-5d9c7b",
    "io.kubernetes.pod.namespace": "prod",
    "io.kubernetes.pod.uid": "0f6a1c2e-7a3b-4c1d-9e8f-123456789abc",
    "pod-template-hash": "5d9c7b"
  },
  "HostConfig": {
    "Binds": null,
    "ContainerIDFile": "",
    "LogConfig": {"Type": "", "Config": null},
    "NetworkMode": "none",
    "PortBindings": {},
    "RestartPolicy": {"Name": "", "MaximumRetryCount": 0},
    "AutoRemove": false,
    "VolumeDriver": "",
    "VolumesFrom": null,
    "ConsoleSize": [0, 0],
    "CapAdd": null,
    "CapDrop": null,
    "CgroupnsMode": "",
    "Dns": null,
    "DnsOptions": null,
    "DnsSearch": null,
    "ExtraHosts": null,
    "GroupAdd": null,
    "IpcMode": "shareable",
    "Cgroup": "",
    "Links": null,
    "OomScoreAdj": -998,
    "PidMode": "",
    "Privileged": false,
    "PublishAllPorts": false,
    "ReadonlyRootfs": false,
    "SecurityOpt": ["no-new-privileges", "seccomp=unconfined"],
    "UTSMode": "",
    "UsernsMode": "",
    "ShmSize": 0,
    "Isolation": "",
    "CpuShares": 2,
    "Memory": 0,
    "NanoCpus": 0,
    "CgroupParent": "kubepods-burstable-pod0f6a1c2e_7a3b_4c1d_9e8f_123456789abc.slice",
    "BlkioWeight": 0,
    "BlkioWeightDevice": null,
    "CpuPeriod": 0,
    "CpuQuota": 0,
    "CpuRealtimePeriod": 0,
    "CpuRealtimeRuntime": 0,
    "CpusetCpus": "",
    "CpusetMems": "",
    "Devices": null,
    "DeviceCgroupRules": null,
    "DeviceRequests": null,
    "MemoryReservation": 0,
    "MemorySwap": 0,
    "MemorySwappiness": null,
    "OomKillDisable": null,
    "PidsLimit": null,
    "Ulimits": null,
    "MaskedPaths": null,
    "ReadonlyPaths": null,
    "XKoordFutureHostField": {"nested": [1, 2, {"a": null}]}
  },
  "NetworkingConfig": {"EndpointsConfig": null},
  "XKoordFutureTopField": 1.5
}"""

# The pod's first container, as cri-dockerd creates it once the sandbox runs.
CONTAINER_BODY = """{
  "Hostname": "",
  "Domainname": "",
  "User": "",
  "AttachStdin": false,
  "AttachStdout": false,
  "AttachStderr": false,
  "Tty": false,
  "OpenStdin": false,
  "StdinOnce": false,
  "Env": [
    "KUBERNETES_SERVICE_HOST=10.96.0.1",
    "MODE=fast",
    "DSN=postgres://db:5432/app?sslmode=disable",
    "UNSET_ME",
    "MODE=slow",
    "KUBERNETES_SERVICE_PORT=443"
  ],
  "Cmd": ["--port=8080"],
  "Healthcheck": {"Test": ["NONE"]},
  "Image": "sha256:4f2a1d1c0e2b3a4f5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4",
  "Volumes": null,
  "WorkingDir": "/srv",
  "Entrypoint": ["/bin/web"],
  "OnBuild": null,
  "Labels": {
    "annotation.io.kubernetes.container.hash": "8a3b2c1d",
    "annotation.io.kubernetes.container.restartCount": "1",
    "annotation.io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
    "annotation.io.kubernetes.container.terminationMessagePolicy": "File",
    "annotation.io.kubernetes.pod.terminationGracePeriod": "30",
    "io.kubernetes.container.logpath": "/var/log/pods/prod_web-5d9c7b_0f6a1c2e-7a3b-4c1d-9e8f-123456789abc/app/1.log",
    "io.kubernetes.container.name": "app",
    "io.kubernetes.docker.type": "container",
    "io.kubernetes.pod.name": "web-5d9c7b",
    "io.kubernetes.pod.namespace": "prod",
    "io.kubernetes.pod.uid": "0f6a1c2e-7a3b-4c1d-9e8f-123456789abc",
    "io.kubernetes.sandbox.id": "5b0c3f1e9d2a4b6c8e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d"
  },
  "HostConfig": {
    "Binds": [
      "/var/lib/kubelet/pods/0f6a1c2e-7a3b-4c1d-9e8f-123456789abc/volumes/kubernetes.io~projected/kube-api-access-x7k2p:/var/run/secrets/kubernetes.io/serviceaccount:ro",
      "/var/lib/kubelet/pods/0f6a1c2e-7a3b-4c1d-9e8f-123456789abc/containers/app/3c1d2e4f:/dev/termination-log"
    ],
    "ContainerIDFile": "",
    "LogConfig": {"Type": "", "Config": null},
    "NetworkMode": "container:5b0c3f1e9d2a4b6c8e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d",
    "PortBindings": null,
    "RestartPolicy": {"Name": "no", "MaximumRetryCount": 0},
    "AutoRemove": false,
    "VolumeDriver": "",
    "VolumesFrom": null,
    "ConsoleSize": [0, 0],
    "CapAdd": null,
    "CapDrop": null,
    "CgroupnsMode": "",
    "Dns": null,
    "DnsOptions": null,
    "DnsSearch": null,
    "ExtraHosts": null,
    "GroupAdd": null,
    "IpcMode": "container:5b0c3f1e9d2a4b6c8e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d",
    "Cgroup": "",
    "Links": null,
    "OomScoreAdj": 968,
    "PidMode": "",
    "Privileged": false,
    "PublishAllPorts": false,
    "ReadonlyRootfs": false,
    "SecurityOpt": ["seccomp=unconfined"],
    "UTSMode": "",
    "UsernsMode": "",
    "ShmSize": 0,
    "Isolation": "",
    "CpuShares": 204,
    "Memory": 268435456,
    "NanoCpus": 0,
    "CgroupParent": "kubepods-burstable-pod0f6a1c2e_7a3b_4c1d_9e8f_123456789abc.slice",
    "BlkioWeight": 0,
    "BlkioWeightDevice": null,
    "CpuPeriod": 100000,
    "CpuQuota": 50000,
    "CpuRealtimePeriod": 0,
    "CpuRealtimeRuntime": 0,
    "CpusetCpus": "",
    "CpusetMems": "",
    "Devices": [],
    "DeviceCgroupRules": null,
    "DeviceRequests": null,
    "MemoryReservation": 0,
    "MemorySwap": 268435456,
    "MemorySwappiness": null,
    "OomKillDisable": null,
    "PidsLimit": null,
    "Ulimits": null,
    "MaskedPaths": ["/proc/acpi", "/proc/kcore"],
    "ReadonlyPaths": ["/proc/bus", "/proc/sys"],
    "XKoordFutureHostField": true
  },
  "NetworkingConfig": {"EndpointsConfig": null},
  "XKoordFutureTopField": {"keep": ["me", 1]}
}"""

# POST /containers/{id}/update as cri-dockerd sends it for UpdateContainerResources.
UPDATE_BODY = """{
  "CpuShares": 512,
  "Memory": 536870912,
  "NanoCpus": 0,
  "CgroupParent": "",
  "BlkioWeight": 0,
  "CpuPeriod": 100000,
  "CpuQuota": 100000,
  "CpusetCpus": "",
  "CpusetMems": "",
  "Devices": null,
  "MemoryReservation": 0,
  "MemorySwap": 0,
  "PidsLimit": null,
  "RestartPolicy": {"Name": "", "MaximumRetryCount": 0},
  "XKoordFutureUpdateField": "x"
}"""

# GET /containers/{id}/json of the running sandbox and container (trimmed to what matters, plus noise).
SANDBOX_INSPECT = """{
  "Id": "5b0c3f1e9d2a4b6c8e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d",
  "Created": "2024-05-02T10:11:13.5Z",
  "Path": "/pause",
  "Args": [],
  "State": {"Status": "running", "Running": true, "Pid": 4242, "ExitCode": 0},
  "Image": "sha256:e6f1816883972d4be47bd48879a08919b96afcd344132622e4d444987919323c",
  "Name": "/k8s_POD_web-5d9c7b_prod_0f6a1c2e-7a3b-4c1d-9e8f-123456789abc_0",
  "RestartCount": 0,
  "HostConfig": {
    "CgroupParent": "kubepods-burstable-pod0f6a1c2e_7a3b_4c1d_9e8f_123456789abc.slice",
    "CpuShares": 2, "Memory": 0, "CpuPeriod": 0, "CpuQuota": 0, "CpusetCpus": "", "CpusetMems": "",
    "MemorySwap": 0, "OomScoreAdj": -998, "IpcMode": "shareable", "NetworkMode": "none"
  },
  "Config": {
    "Hostname": "web-5d9c7b",
    "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
    "Image": "registry.k8s.io/pause:3.9",
    "Labels": {
      "annotation.kubernetes.io/config.seen": "2024-05-02T10:11:12.123456789Z",
      "annotation.kubernetes.io/config.source": "api",
      "app": "web",
      "io.kubernetes.container.name": "POD",
      "io.kubernetes.docker.type": "podsandbox",
      "io.kubernetes.pod.name": "web-5d9c7b",
      "io.kubernetes.pod.namespace": "prod",
      "io.kubernetes.pod.uid": "0f6a1c2e-7a3b-4c1d-9e8f-123456789abc",
      "pod-template-hash": "5d9c7b"
    }
  },
  "NetworkSettings": {"IPAddress": "", "Networks": {"none": {}}}
}"""

CONTAINER_INSPECT = """{
  "Id": "9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b1a0f9e8d",
  "Created": "2024-05-02T10:11:15.1Z",
  "Path": "/bin/web",
  "Args": ["--port=8080"],
  "State": {"Status": "running", "Running": true, "Pid": 4300},
  "Name": "/k8s_app_web-5d9c7b_prod_0f6a1c2e-7a3b-4c1d-9e8f-123456789abc_1",
  "HostConfig": {
    "CgroupParent": "kubepods-burstable-pod0f6a1c2e_7a3b_4c1d_9e8f_123456789abc.slice",
    "CpuShares": 204, "Memory": 268435456, "CpuPeriod": 100000, "CpuQuota": 50000,
    "CpusetCpus": "0-3", "CpusetMems": "", "MemorySwap": 268435456, "OomScoreAdj": 968
  },
  "Image": "sha256:4f2a1d1c0e2b3a4f5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4",
  "Config": {
    "Image": "sha256:4f2a1d1c0e2b3a4f5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4",
    "Env": ["KUBERNETES_SERVICE_HOST=10.96.0.1", "MODE=slow", "PATH=/usr/bin:/bin", "HOOKED=yes"],
    "Labels": {
      "annotation.io.kubernetes.container.hash": "8a3b2c1d",
      "annotation.io.kubernetes.container.restartCount": "1",
      "annotation.node.koordinator.sh/cpuset": "0-3",
      "io.kubernetes.container.logpath": "/var/log/pods/prod_web-5d9c7b_0f6a1c2e-7a3b-4c1d-9e8f-123456789abc/app/1.log",
      "io.kubernetes.container.name": "app",
      "io.kubernetes.docker.type": "container",
      "io.kubernetes.pod.name": "web-5d9c7b",
      "io.kubernetes.pod.namespace": "prod",
      "io.kubernetes.pod.uid": "0f6a1c2e-7a3b-4c1d-9e8f-123456789abc",
      "io.kubernetes.sandbox.id": "5b0c3f1e9d2a4b6c8e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d"
    }
  }
}"""


def sandbox_body() -> dict[str, Any]:
    body: dict[str, Any] = json.loads(SANDBOX_BODY)
    return body


def container_body() -> dict[str, Any]:
    body: dict[str, Any] = json.loads(CONTAINER_BODY)
    return body


def update_body() -> dict[str, Any]:
    body: dict[str, Any] = json.loads(UPDATE_BODY)
    return body


def stored_pod() -> hook.PodSandboxHookRequest:
    return translate.sandbox_hook_request(SANDBOX_NAME, sandbox_body(), "systemd")


def own_request(body: Any, driver: str = "systemd", name: str = CONTAINER_NAME) -> hook.ContainerResourceHookRequest:
    """The container as its create body has it (``sent`` in flows.create_container): placed under its own CgroupParent."""
    return translate.ContainerCreate(name, body, driver).hook_request()


def placed(sent: hook.ContainerResourceHookRequest, pod: hook.PodSandboxHookRequest) -> hook.ContainerResourceHookRequest:
    """The PreCreateContainer request, as flows.create_container builds it from ``sent`` and the stored pod."""
    return messages.placed_in_pod(copy_of(sent), pod)


def container_request() -> hook.ContainerResourceHookRequest:
    return placed(own_request(container_body()), stored_pod())


def folded(stored: hook.ContainerResourceHookRequest, body: Any) -> hook.ContainerResourceHookRequest:
    """The PreUpdateContainerResources request for ``POST /containers/{id}/update`` with ``body``."""
    return messages.folded_update(stored, CONTAINER_ID, translate.update_resources(body), {})


def copy_of(message: Any) -> Any:
    duplicate = type(message)()
    duplicate.CopyFrom(message)
    return duplicate


class KindTests(SynchronousTestCase):
    def test_cri_dockerd_creates(self) -> None:
        self.assertEqual(translate.kind_of(sandbox_body()), "sandbox")
        self.assertEqual(translate.kind_of(container_body()), "container")

    def test_other_creates_pass_through(self) -> None:
        body: object
        for body in (
            {"Image": "busybox", "Cmd": ["echo", "hi"]},
            {"Image": "busybox", "Labels": None},
            {"Image": "busybox", "Labels": {}},
            {"Labels": {"io.kubernetes.docker.type": "something-else"}},
            {"Labels": {"io.kubernetes.docker.type": 1}},
            {"Labels": ["io.kubernetes.docker.type"]},
            {"Labels": "io.kubernetes.docker.type=podsandbox"},
            [],
            None,
            "podsandbox",
        ):
            self.assertIsNone(translate.kind_of(body), body)

    def test_inspect_kind_and_sandbox_id(self) -> None:
        self.assertEqual(inspect.kind_of_inspect(json.loads(SANDBOX_INSPECT)), "sandbox")
        self.assertEqual(inspect.kind_of_inspect(json.loads(CONTAINER_INSPECT)), "container")
        self.assertIsNone(inspect.kind_of_inspect({"Config": None}))
        self.assertIsNone(inspect.kind_of_inspect({"Id": "x"}))
        self.assertEqual(translate.sandbox_id_of(container_body()), SANDBOX_ID)
        self.assertEqual(inspect.sandbox_id_of_inspect(json.loads(CONTAINER_INSPECT)), SANDBOX_ID)
        self.assertRaises(DockerShapeError, translate.sandbox_id_of, sandbox_body())


class SandboxRequestTests(SynchronousTestCase):
    def test_everything_kubelet_said_comes_back(self) -> None:
        pod = translate.sandbox_hook_request(SANDBOX_NAME, sandbox_body(), "systemd")
        self.assertEqual(
            (pod.pod_meta.name, pod.pod_meta.namespace, pod.pod_meta.uid, pod.pod_meta.attempt),
            ("web-5d9c7b", "prod", UID, 0),
        )
        self.assertEqual(pod.runtime_handler, "docker")
        # dockershim's own labels are not pod labels; kubelet's io.kubernetes.pod.* ones are.
        self.assertEqual(
            dict(pod.labels),
            {
                "app": "web",
                "io.kubernetes.pod.name": "web-5d9c7b",
                "io.kubernetes.pod.namespace": "prod",
                "io.kubernetes.pod.uid": UID,
                "pod-template-hash": "5d9c7b",
            },
        )
        self.assertEqual(
            dict(pod.annotations),
            {"kubernetes.io/config.seen": "2024-05-02T10:11:12.123456789Z", "kubernetes.io/config.source": "api"},
        )
        self.assertEqual(pod.cgroup_parent, POD_PATH)
        self.assertEqual(pod.resources, hook.LinuxContainerResources(cpu_shares=2, oom_score_adj=-998))

    def test_cgroupfs_driver_keeps_the_path(self) -> None:
        body = sandbox_body()
        body["HostConfig"]["CgroupParent"] = "/kubepods/burstable/pod" + UID
        pod = translate.sandbox_hook_request(SANDBOX_NAME, body, "cgroupfs")
        self.assertEqual(pod.cgroup_parent, "/kubepods/burstable/pod" + UID)

    def test_name_with_conflict_suffix_and_leading_slash(self) -> None:
        name = f"/k8s_POD_web-5d9c7b_prod_{UID}_3_a1b2c3d4"
        pod = translate.sandbox_hook_request(name, sandbox_body(), "systemd")
        self.assertEqual((pod.pod_meta.name, pod.pod_meta.uid, pod.pod_meta.attempt), ("web-5d9c7b", UID, 3))

    def test_no_host_config(self) -> None:
        body = sandbox_body()
        del body["HostConfig"]
        pod = translate.sandbox_hook_request(SANDBOX_NAME, body, "systemd")
        self.assertEqual(pod.cgroup_parent, "")
        self.assertFalse(pod.HasField("resources"))


class ContainerRequestTests(SynchronousTestCase):
    def test_container_and_pod_fields(self) -> None:
        pod = stored_pod()
        pod.cgroup_parent = "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice"
        sent = own_request(container_body())
        # The body places the container under its own HostConfig.CgroupParent: kubelet's copy of the pod's.
        self.assertEqual(sent.pod_cgroup_parent, POD_PATH)
        container = placed(sent, pod)
        self.assertEqual((container.container_meta.name, container.container_meta.attempt), ("app", 1))
        self.assertEqual(container.container_meta.id, "")
        self.assertEqual(container.pod_meta, pod.pod_meta)
        self.assertEqual(dict(container.pod_labels), dict(pod.labels))
        self.assertEqual(dict(container.pod_annotations), dict(pod.annotations))
        self.assertEqual(container.pod_resources, pod.resources)
        # The stored pod's cgroup parent (hooks may have moved it), not the container's copy of kubelet's.
        self.assertEqual(container.pod_cgroup_parent, pod.cgroup_parent)
        self.assertEqual(
            dict(container.container_annotations),
            {
                "io.kubernetes.container.hash": "8a3b2c1d",
                "io.kubernetes.container.restartCount": "1",
                "io.kubernetes.container.terminationMessagePath": "/dev/termination-log",
                "io.kubernetes.container.terminationMessagePolicy": "File",
                "io.kubernetes.pod.terminationGracePeriod": "30",
                # The image the body names (kubelet's id, as cri-dockerd passes it on), under containerd's key.
                messages.IMAGE_NAME_ANNOTATION: "sha256:4f2a1d1c0e2b3a4f5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4",
            },
        )
        self.assertEqual(
            dict(container.container_envs),
            {
                "KUBERNETES_SERVICE_HOST": "10.96.0.1",
                "MODE": "slow",
                "DSN": "postgres://db:5432/app?sslmode=disable",
                "KUBERNETES_SERVICE_PORT": "443",
            },
        )
        self.assertEqual(
            container.container_resources,
            hook.LinuxContainerResources(
                cpu_shares=204,
                cpu_quota=50000,
                cpu_period=100000,
                memory_limit_in_bytes=268435456,
                memory_swap_limit_in_bytes=268435456,
                oom_score_adj=968,
            ),
        )

    def test_pod_without_cgroup_parent_takes_the_containers(self) -> None:
        pod = stored_pod()
        pod.cgroup_parent = ""
        container = placed(own_request(container_body()), pod)
        self.assertEqual(container.pod_cgroup_parent, POD_PATH)

    def test_kind_is_checked(self) -> None:
        self.assertRaises(DockerShapeError, translate._container_create, SANDBOX_NAME, sandbox_body(), "systemd")
        self.assertRaises(DockerShapeError, translate.sandbox_hook_request, CONTAINER_NAME, container_body(), "systemd")


class NothingChangedTests(SynchronousTestCase):
    def test_unchanged_requests_leave_the_bodies_alone(self) -> None:
        for driver in ("systemd", "cgroupfs"):
            body = sandbox_body()
            pod = translate.sandbox_hook_request(SANDBOX_NAME, body, driver)
            self.assertFalse(translate.apply_to_sandbox_create(body, pod, copy_of(pod), driver))
            self.assertEqual(json.dumps(body), json.dumps(sandbox_body()))

            body = container_body()
            pod = translate.sandbox_hook_request(SANDBOX_NAME, sandbox_body(), driver)
            create = translate.ContainerCreate(CONTAINER_NAME, body, driver)
            sent = create.hook_request()
            container = placed(sent, pod)
            self.assertFalse(translate.apply_to_container_create(body, sent, copy_of(container), driver))
            self.assertIsNone(create.rewritten(sent, container).request)
            self.assertEqual(json.dumps(body), json.dumps(container_body()))

            body = update_body()
            update = folded(container, body)
            self.assertFalse(translate.apply_to_update(body, update, copy_of(update)))
            self.assertEqual(json.dumps(body), json.dumps(update_body()))

    def test_a_hook_echoing_the_request_changes_nothing(self) -> None:
        # koordlet answers with a copy of the request: merged, it is the request again.
        body = container_body()
        before = container_request()
        after = copy_of(before)
        messages.merge_container_response(
            after,
            hook.ContainerResourceHookResponse(
                container_annotations=before.container_annotations,
                container_resources=before.container_resources,
                pod_cgroup_parent=before.pod_cgroup_parent,
                container_envs=before.container_envs,
            ),
        )
        self.assertFalse(translate.apply_to_container_create(body, before, after, "systemd"))
        self.assertEqual(json.dumps(body), json.dumps(container_body()))


class SandboxApplyTests(SynchronousTestCase):
    def test_only_what_hooks_changed_is_written(self) -> None:
        body = sandbox_body()
        before = translate.sandbox_hook_request(SANDBOX_NAME, body, "systemd")
        after = copy_of(before)
        messages.merge_pod_response(
            after,
            hook.PodSandboxHookResponse(
                labels={"koordinator.sh/qos": "BE", "app": "web"},
                annotations={"node.koordinator.sh/cpuset": "0-1"},
                cgroup_parent=POD_PATH.replace("burstable", "besteffort"),
                resources=hook.LinuxContainerResources(cpu_shares=1024, cpuset_cpus="0-1"),
            ),
            apply_resources=True,
        )
        self.assertTrue(translate.apply_to_sandbox_create(body, before, after, "systemd"))

        expected = sandbox_body()
        expected["Labels"]["koordinator.sh/qos"] = "BE"
        expected["Labels"]["annotation.node.koordinator.sh/cpuset"] = "0-1"
        expected["HostConfig"]["CgroupParent"] = "kubepods-besteffort-pod0f6a1c2e_7a3b_4c1d_9e8f_123456789abc.slice"
        expected["HostConfig"]["CpuShares"] = 1024
        expected["HostConfig"]["CpusetCpus"] = "0-1"
        self.assertEqual(body, expected)
        # Key order too: nothing was removed and re-added.
        self.assertEqual(list(body["HostConfig"]), list(expected["HostConfig"]))
        self.assertEqual(body["XKoordFutureTopField"], 1.5)
        self.assertEqual(body["HostConfig"]["XKoordFutureHostField"], {"nested": [1, 2, {"a": None}]})

        # Read back, the body says what the hooks left.
        self.assertEqual(translate.sandbox_hook_request(SANDBOX_NAME, body, "systemd"), after)

    def test_shim_labels_are_never_overwritten(self) -> None:
        body = sandbox_body()
        before = translate.sandbox_hook_request(SANDBOX_NAME, body, "systemd")
        after = copy_of(before)
        after.labels["io.kubernetes.docker.type"] = "container"
        after.labels["io.kubernetes.container.name"] = "evil"
        after.labels["io.kubernetes.sandbox.id"] = "x"
        self.assertFalse(translate.apply_to_sandbox_create(body, before, after, "systemd"))
        self.assertEqual(body, sandbox_body())

    def test_missing_host_config_is_created_when_needed(self) -> None:
        body = sandbox_body()
        body["HostConfig"] = None
        before = translate.sandbox_hook_request(SANDBOX_NAME, body, "cgroupfs")
        after = copy_of(before)
        after.cgroup_parent = "/kubepods/besteffort/pod1"
        self.assertTrue(translate.apply_to_sandbox_create(body, before, after, "cgroupfs"))
        self.assertEqual(body["HostConfig"], {"CgroupParent": "/kubepods/besteffort/pod1"})


class ContainerApplyTests(SynchronousTestCase):
    def test_the_image_hooks_are_shown_is_never_written(self) -> None:
        body = container_body()
        body["Image"] = "registry.example/forbidden/app:1"
        before = placed(own_request(body), stored_pod())
        self.assertEqual(before.container_annotations[messages.IMAGE_NAME_ANNOTATION], "registry.example/forbidden/app:1")
        after = copy_of(before)
        answer = hook.ContainerResourceHookResponse(container_annotations={messages.IMAGE_NAME_ANNOTATION: "allowed/app:1"})
        [change] = messages.merge_container_response(after, answer)
        self.assertFalse(change.applied)
        self.assertFalse(translate.apply_to_container_create(body, before, after, "systemd"))
        self.assertNotIn(f"annotation.{messages.IMAGE_NAME_ANNOTATION}", body["Labels"])

    def test_resources_annotations_and_envs(self) -> None:
        body = container_body()
        before = container_request()
        after = copy_of(before)
        messages.merge_container_response(
            after,
            hook.ContainerResourceHookResponse(
                container_annotations={"node.koordinator.sh/cpuset": "0-3"},
                container_resources=hook.LinuxContainerResources(cpuset_cpus="0-3", cpu_quota=-1, oom_score_adj=0),
                container_envs={"MODE": "turbo", "ZED": "1", "ALPHA": "a=b", "UNSET_ME": "now-set"},
            ),
        )
        self.assertTrue(translate.apply_to_container_create(body, before, after, "systemd"))

        expected = container_body()
        expected["Labels"]["annotation.node.koordinator.sh/cpuset"] = "0-3"
        expected["HostConfig"]["CpusetCpus"] = "0-3"
        expected["HostConfig"]["CpuQuota"] = -1
        # kubelet's order kept, every occurrence of a changed key replaced in place, the entry
        # without "=" left where it was, new keys appended sorted.
        expected["Env"] = [
            "KUBERNETES_SERVICE_HOST=10.96.0.1",
            "MODE=turbo",
            "DSN=postgres://db:5432/app?sslmode=disable",
            "UNSET_ME",
            "MODE=turbo",
            "KUBERNETES_SERVICE_PORT=443",
            "ALPHA=a=b",
            "UNSET_ME=now-set",
            "ZED=1",
        ]
        self.assertEqual(body, expected)
        self.assertEqual(json.dumps(body), json.dumps(expected))

    def test_pod_cgroup_parent_set_by_run_pod_sandbox_hooks_wins(self) -> None:
        # PreRunPodSandbox moved the pod; cri-dockerd still copies kubelet's parent into the container.
        # As flows.create_container does it, with no PreCreateContainer hook to change anything.
        pod = stored_pod()
        pod.cgroup_parent = "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podmoved.slice"
        body = container_body()
        create = translate.ContainerCreate(CONTAINER_NAME, body, "systemd")
        sent = create.hook_request()
        final = placed(sent, pod)
        rewritten = create.rewritten(sent, final).request
        expected = container_body()
        expected["HostConfig"]["CgroupParent"] = "kubepods-besteffort-podmoved.slice"
        assert rewritten is not None
        self.assertEqual(json.loads(rewritten), expected)
        self.assertEqual(body, expected)

    def test_pod_cgroup_parent_set_by_a_container_hook(self) -> None:
        body = container_body()
        body["HostConfig"]["CgroupParent"] = "/kubepods/burstable/pod" + UID
        sandbox = {**sandbox_body(), "HostConfig": {"CgroupParent": "/kubepods/burstable/pod" + UID}}
        pod = translate.sandbox_hook_request(SANDBOX_NAME, sandbox, "cgroupfs")
        sent = own_request(body, "cgroupfs")
        after = placed(sent, pod)
        messages.merge_container_response(
            after, hook.ContainerResourceHookResponse(pod_cgroup_parent="/kubepods/besteffort/pod" + UID)
        )
        self.assertTrue(translate.apply_to_container_create(body, sent, after, "cgroupfs"))
        self.assertEqual(body["HostConfig"]["CgroupParent"], "/kubepods/besteffort/pod" + UID)

    def test_without_the_driver_the_cgroup_parent_is_left_as_sent_and_named(self) -> None:
        # dockerd did not name its driver: the pod's parent (moved by its hooks) and a container
        # hook's own change cannot be written in a syntax dockerd is known to take.
        pod = stored_pod()
        pod.cgroup_parent = "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podmoved.slice"
        create = translate.ContainerCreate(CONTAINER_NAME, container_body(), None)
        sent = create.hook_request()
        self.assertEqual(sent.pod_cgroup_parent, POD_PATH)  # a slice name is read as systemd's
        final = placed(sent, pod)
        final.pod_cgroup_parent = "/kubepods/besteffort/podother"
        final.container_envs["ADDED"] = "1"
        written = create.rewritten(sent, final)
        assert written.request is not None
        expected = container_body()
        expected["Env"].append("ADDED=1")
        self.assertEqual(json.loads(written.request), expected)
        self.assertIn(
            LeftAlone("pod_cgroup_parent", "dockerd's cgroup driver is not known: GET /info failed"), written.left_alone
        )

    def test_envs_added_to_a_body_without_env(self) -> None:
        body = container_body()
        body["Env"] = None
        sent = own_request(body)
        after = placed(sent, stored_pod())
        after.container_envs.update({"B": "2", "A": "1"})
        self.assertTrue(translate.apply_to_container_create(body, sent, after, "systemd"))
        self.assertEqual(body["Env"], ["A=1", "B=2"])

    def test_unmappable_changes_are_not_a_change(self) -> None:
        # Docker has no field for unified or hugepage limits.
        body = container_body()
        before = container_request()
        after = copy_of(before)
        after.container_resources.unified["memory.high"] = "max"
        after.container_resources.hugepage_limits.add(page_size="2MB", limit=1 << 21)
        self.assertFalse(translate.apply_to_container_create(body, before, after, "systemd"))
        self.assertEqual(body, container_body())

    def test_round_trip_reads_back_the_hooks_result(self) -> None:
        body = container_body()
        pod = stored_pod()
        sent = own_request(body)
        after = placed(sent, pod)
        messages.merge_container_response(
            after,
            hook.ContainerResourceHookResponse(
                container_annotations={"a": "1"},
                container_resources=hook.LinuxContainerResources(
                    cpu_shares=1000, memory_limit_in_bytes=1 << 30, memory_swap_limit_in_bytes=1 << 30, cpuset_mems="0"
                ),
                container_envs={"NEW": "x"},
            ),
        )
        translate.apply_to_container_create(body, sent, after, "systemd")
        self.assertEqual(placed(own_request(body), pod), after)


class UpdateTests(SynchronousTestCase):
    def test_fold_takes_what_the_update_names(self) -> None:
        stored = container_request()
        stored.container_meta.id = CONTAINER_ID
        update = folded(stored, update_body())
        self.assertEqual(update.container_meta.id, CONTAINER_ID)
        self.assertEqual(dict(update.container_annotations), dict(stored.container_annotations))  # no labels
        self.assertEqual(
            update.container_resources,
            hook.LinuxContainerResources(
                cpu_shares=512,
                cpu_quota=100000,
                cpu_period=100000,
                memory_limit_in_bytes=536870912,
                memory_swap_limit_in_bytes=268435456,  # 0 in an update means "keep"
                oom_score_adj=968,
            ),
        )
        self.assertEqual(stored.container_resources.cpu_shares, 204)  # the stored copy is untouched

    def test_only_changed_top_level_fields_are_written(self) -> None:
        body = update_body()
        before = folded(container_request(), body)
        after = copy_of(before)
        messages.merge_container_response(
            after,
            hook.ContainerResourceHookResponse(
                container_resources=hook.LinuxContainerResources(
                    cpu_shares=512, cpuset_cpus="2-3", oom_score_adj=-5, cpu_quota=-1
                )
            ),
        )
        self.assertTrue(translate.apply_to_update(body, before, after))
        expected = update_body()
        expected["CpusetCpus"] = "2-3"
        expected["CpuQuota"] = -1
        self.assertEqual(json.dumps(body), json.dumps(expected))  # no OomScoreAdj: update has none

    def test_fields_absent_from_the_update_are_added(self) -> None:
        body: dict[str, Any] = {"CpuShares": 2}
        before = folded(container_request(), body)
        after = copy_of(before)
        after.container_resources.cpuset_mems = "0"
        self.assertTrue(translate.apply_to_update(body, before, after))
        self.assertEqual(body, {"CpuShares": 2, "CpusetMems": "0"})


class CgroupParentTests(SynchronousTestCase):
    SYSTEMD = (
        (
            "kubepods-besteffort-pod123.slice",
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod123.slice",
        ),
        (POD_SLICE, POD_PATH),
        ("kubepods-pod0f6a1c2e_7a3b.slice", "/kubepods.slice/kubepods-pod0f6a1c2e_7a3b.slice"),
        ("kubepods.slice", "/kubepods.slice"),
        ("", ""),
    )

    def test_systemd_slice_names_and_paths(self) -> None:
        for docker, hook_path in self.SYSTEMD:
            self.assertEqual(translate.to_hook_cgroup_parent(docker, "systemd"), hook_path)
            self.assertEqual(translate.to_docker_cgroup_parent(hook_path, "systemd"), docker)
            # Round trips both ways.
            self.assertEqual(to_docker(to_hook(docker, "systemd"), "systemd"), docker)
            self.assertEqual(to_hook(to_docker(hook_path, "systemd"), "systemd"), hook_path)

    def test_systemd_with_a_cgroupfs_style_hook_path(self) -> None:
        self.assertEqual(to_docker("/kubepods/besteffort/pod123", "systemd"), "kubepods-besteffort-pod123.slice")
        self.assertEqual(to_docker("/kubepods/besteffort/pod12-34/", "systemd"), "kubepods-besteffort-pod12_34.slice")
        self.assertEqual(translate.to_docker_cgroup_parent("/", "systemd"), "")
        self.assertEqual(
            to_hook(to_docker("/kubepods/besteffort/pod123", "systemd"), "systemd"),
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod123.slice",
        )

    def test_systemd_values_that_are_not_slice_names_stay(self) -> None:
        for value in ("-.slice", "a--b.slice", "-a.slice", "a-.slice", "a.slice/x.slice", "/kubepods/pod1", "docker"):
            self.assertEqual(translate.to_hook_cgroup_parent(value, "systemd"), value)

    def test_without_the_driver_a_slice_name_reads_as_systemds(self) -> None:
        for docker, hook_path in self.SYSTEMD:
            self.assertEqual(translate.to_hook_cgroup_parent(docker, None), hook_path)
        for value in ("/kubepods/besteffort/pod123", "a--b.slice", "docker", ""):
            self.assertEqual(translate.to_hook_cgroup_parent(value, None), value)

    def test_cgroupfs_is_a_plain_path(self) -> None:
        for value in ("/kubepods/besteffort/pod123", "kubepods-besteffort-pod123.slice", "", "/"):
            self.assertEqual(translate.to_hook_cgroup_parent(value, "cgroupfs"), value)
            self.assertEqual(translate.to_docker_cgroup_parent(value, "cgroupfs"), value)


class InspectTests(SynchronousTestCase):
    def test_sandbox_from_inspect_matches_the_create(self) -> None:
        pod = inspect.stored_sandbox_from_inspect(json.loads(SANDBOX_INSPECT), "systemd")
        self.assertEqual(pod, stored_pod())

    def test_container_from_inspect(self) -> None:
        pod = inspect.stored_sandbox_from_inspect(json.loads(SANDBOX_INSPECT), "systemd")
        container = inspect.stored_container_from_inspect(json.loads(CONTAINER_INSPECT), pod, "systemd")
        self.assertEqual(
            (container.container_meta.name, container.container_meta.attempt, container.container_meta.id),
            ("app", 1, CONTAINER_ID),
        )
        self.assertEqual(container.pod_meta, pod.pod_meta)
        self.assertEqual(container.pod_cgroup_parent, POD_PATH)
        self.assertEqual(container.container_annotations["node.koordinator.sh/cpuset"], "0-3")
        self.assertEqual(container.container_resources.cpuset_cpus, "0-3")
        self.assertEqual(container.container_envs["HOOKED"], "yes")
        # As the create named it (Config keeps it so), as hooks were shown it then.
        self.assertEqual(container.container_annotations[messages.IMAGE_NAME_ANNOTATION], json.loads(CONTAINER_INSPECT)["Config"]["Image"])

    def test_container_without_its_pod(self) -> None:
        container = inspect.stored_container_from_inspect(json.loads(CONTAINER_INSPECT), None, "systemd")
        self.assertEqual(container.pod_meta, hook.PodSandboxMetadata(name="web-5d9c7b", namespace="prod", uid=UID))
        self.assertEqual(container.pod_cgroup_parent, POD_PATH)
        self.assertEqual(dict(container.pod_labels), {})


class MalformedTests(SynchronousTestCase):
    def assertShapeError(self, function: Any, *args: Any) -> None:
        error = self.assertRaises(DockerShapeError, function, *args)
        self.assertIsInstance(error, ValueError)
        self.assertNotIn("\n", str(error))
        self.assertTrue(str(error))

    def test_names(self) -> None:
        for name in (
            "",
            "web",
            "k8s_POD_web_prod_uid",
            "k8s_POD_web_prod_uid_0_x_y",
            "k9s_POD_web_prod_uid_0",
            "k8s_POD_web_prod_uid_x",
            "k8s_POD_web_prod_uid_-1",
            "k8s_POD_web_prod_uid_4294967296",
            "k8s_POD__prod_uid_0",
            "k8s_POD_web_prod_uid_\n0",
            "k8s_POD_web_prod_uid_٣",
            None,
            7,
        ):
            self.assertShapeError(translate.sandbox_hook_request, name, sandbox_body(), "systemd")
            self.assertShapeError(translate.ContainerCreate, name, container_body(), "systemd")

    def test_bodies(self) -> None:
        def sandbox_with(change: Any) -> dict[str, Any]:
            body = sandbox_body()
            change(body)
            return body

        body: object
        for body in (
            None,
            [],
            {"Labels": {"io.kubernetes.docker.type": "podsandbox", "app": 1}},
            {"Labels": {"io.kubernetes.docker.type": "podsandbox"}, "HostConfig": []},
            {"Labels": {"io.kubernetes.docker.type": "podsandbox"}, "HostConfig": {"CgroupParent": 5}},
            {"Labels": {"io.kubernetes.docker.type": "podsandbox"}, "HostConfig": {"CpuShares": "2"}},
            {"Labels": {"io.kubernetes.docker.type": "podsandbox"}, "HostConfig": {"CpuShares": True}},
            {"Labels": {"io.kubernetes.docker.type": "podsandbox"}, "HostConfig": {"Memory": 1.5}},
            {"Labels": {"io.kubernetes.docker.type": "podsandbox"}, "HostConfig": {"Memory": 1 << 63}},
            {"Labels": {"io.kubernetes.docker.type": "podsandbox"}, "HostConfig": {"CpusetCpus": 0}},
            {"Labels": None},
            sandbox_with(lambda body: body["Labels"].pop("io.kubernetes.docker.type")),
        ):
            self.assertShapeError(translate.sandbox_hook_request, SANDBOX_NAME, body, "systemd")

    def test_container_bodies(self) -> None:
        for env in ("A=1", ["A=1", 2], {"A": "1"}):
            body = container_body()
            body["Env"] = env
            self.assertShapeError(translate.ContainerCreate, CONTAINER_NAME, body, "systemd")
        body = container_body()
        body["Image"] = ["busybox"]
        self.assertShapeError(translate.ContainerCreate, CONTAINER_NAME, body, "systemd")
        self.assertShapeError(translate.update_resources, [])
        self.assertShapeError(translate.update_resources, {"CpuQuota": "1"})
        self.assertShapeError(translate.ContainerUpdate, CONTAINER_ID, [])
        self.assertShapeError(translate.sandbox_id_of, {"Labels": {}})

    def test_inspects(self) -> None:
        good = json.loads(CONTAINER_INSPECT)
        change: Callable[[dict[str, Any]], object]
        for change in (
            lambda found: found.pop("Config"),
            lambda found: found.update(Config="x"),
            lambda found: found.pop("Name"),
            lambda found: found.update(Name="/nginx"),
            lambda found: found.pop("Id"),
            lambda found: found.update(Id=""),
            lambda found: found.update(HostConfig=[]),
            lambda found: found["Config"].update(Env="A=1"),
            lambda found: found["Config"]["Labels"].update({"io.kubernetes.docker.type": "podsandbox"}),
        ):
            found = copy.deepcopy(good)
            change(found)
            self.assertShapeError(inspect.stored_container_from_inspect, found, None, "systemd")
        self.assertShapeError(inspect.stored_container_from_inspect, None, None, "systemd")
        self.assertShapeError(inspect.stored_sandbox_from_inspect, good, "systemd")
        nameless = {"Config": {"Labels": {"io.kubernetes.docker.type": "podsandbox"}}}
        self.assertShapeError(inspect.stored_sandbox_from_inspect, nameless, "systemd")

    def test_applying_into_a_malformed_body(self) -> None:
        before = container_request()
        after = copy_of(before)
        after.container_envs["X"] = "1"
        self.assertShapeError(translate.apply_to_container_create, {"Env": "A=1"}, before, after, "systemd")
        after = copy_of(before)
        after.container_resources.cpu_shares = 7
        self.assertShapeError(translate.apply_to_container_create, {"HostConfig": "x"}, before, after, "systemd")
        self.assertShapeError(translate.apply_to_update, [], before, after)
