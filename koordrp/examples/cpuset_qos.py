"""An example hook server: pin annotated pods' containers to CPUs and tell them their QoS class.

    python -m koordrp.examples.cpuset_qos --socket /run/cpuset-qos/cpuset-qos.sock \\
        --register-in /etc/runtime/hookserver.d

PreCreateContainer:

* a pod annotated ``demo.koordrp.io/cpuset: "0-1"`` gets each of its containers pinned to those
  CPUs (``cpuset_cpus``); a malformed value is refused (``Refuse``) rather than sent to the runtime:
  with the Fail policy the container is not created, and kubelet is told why;
* every container gets ``POD_QOS_CLASS`` set from its pod's ``koordinator.sh/qosClass`` label, or
  ``NONE`` when the pod has none.

PreRunPodSandbox is answered with nothing: the pod is created as kubelet asked. The container
answer is ``reply(request)`` (the request as it came) with this server's changes: koordrp takes the
cpuset an answer's resources carry, so an answer built from scratch would clear kubelet's cpuset.
PostStopContainer, a notification, logs each container stop it is told of: once per stop, however
often kubelet repeats it, and also for the containers a pod's stop takes along.
"""

import logging
import re

from koordrp.api.runtime.v1alpha1 import api_pb2
from koordrp.sdk import HookServer, Refuse, command, reply

CPUSET_ANNOTATION = "demo.koordrp.io/cpuset"
QOS_LABEL = "koordinator.sh/qosClass"
QOS_ENV = "POD_QOS_CLASS"
NO_QOS = "NONE"

# The kernel's cpuset list syntax: "0", "0-3", "0,2,4-7".
_CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


class CpusetQoS(HookServer):
    def PreRunPodSandbox(self, request: api_pb2.PodSandboxHookRequest) -> None:
        # Subscribed only to show a hook that changes nothing: None is the empty answer.
        return None

    def PreCreateContainer(self, request: api_pb2.ContainerResourceHookRequest) -> api_pb2.ContainerResourceHookResponse:
        response = reply(request)
        annotated = request.pod_annotations.get(CPUSET_ANNOTATION, "")
        cpuset = annotated.replace(" ", "")
        if cpuset:
            if not _CPU_LIST.match(cpuset):
                raise Refuse(f"annotation {CPUSET_ANNOTATION}={annotated!r} is not a CPU list like 0-1 or 0,2")
            response.container_resources.cpuset_cpus = cpuset
        response.container_envs[QOS_ENV] = request.pod_labels.get(QOS_LABEL, NO_QOS)
        return response

    def PostStopContainer(self, request: api_pb2.ContainerResourceHookRequest) -> None:
        logging.info(
            "PostStopContainer: container %s of pod %s/%s stopped",
            request.container_meta.name,
            request.pod_meta.namespace,
            request.pod_meta.name,
        )


def main(argv: list[str] | None = None) -> None:
    options = command.parser(
        "python -m koordrp.examples.cpuset_qos",
        "Pin annotated pods' containers to CPUs and tell containers their pod's QoS class.",
        socket="/run/koordrp-cpuset-qos/cpuset-qos.sock",
        name="cpuset-qos",
    )
    command.serve_until_stopped(CpusetQoS(), command.parse(options, argv))


if __name__ == "__main__":
    main()
