"""The one info line each lifecycle call gets: what it was about, which hooks ran, how it ended."""

from dataclasses import dataclass, field

from twisted.logger import Logger

from koordrp.hooks.messages import ContainerHookRequest, HookRequest

log = Logger(namespace="koordrp.calls")

FORMAT = (
    "{method} pod {namespace}/{pod} ({uid}){container_part}: {outcome} in {duration_ms:.1f} ms; hooks: {hooks}"
)


@dataclass
class CallRecord:
    """Filled in as a lifecycle call goes; written once it ends."""

    method: str
    subject: HookRequest | None = None
    hooks: list[str] = field(default_factory=list)

    def ran(self, hook: str, servers: list[str]) -> None:
        self.hooks += [f"{hook}@{server}" for server in servers]

    def fields(self, outcome: str, seconds: float) -> dict[str, object]:
        subject = self.subject
        container = ""
        if isinstance(subject, ContainerHookRequest):
            container = subject.container_meta.name
        meta = subject.pod_meta if subject is not None else None
        return {
            "method": self.method,
            "namespace": meta.namespace if meta else "",
            "pod": meta.name if meta else "",
            "uid": meta.uid if meta else "",
            "container": container,
            "container_part": f" container {container}" if container else "",
            "hooks": ", ".join(self.hooks) or "none",
            "outcome": outcome,
            "duration_ms": seconds * 1000,
        }


def write(record: CallRecord, outcome: str, seconds: float) -> None:
    log.info(FORMAT, **record.fields(outcome, seconds))
