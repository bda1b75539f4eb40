"""koordlet's hookserver.d registration, byte for byte as its proxy-mode ``Register`` writes it.

koordlet marshals ``{remote-endpoint, failure-policy, runtime-hooks}`` with Go's
``json.MarshalIndent(config, "", "\\t")`` (no trailing newline) and writes it with ``os.WriteFile``
(mode 0644, in place) to ``koordlet.json``. ``runtime-hooks`` lists the stages its enabled plugins
registered, in Go map order (any order); with every stage disabled the key is left out. The default
plugins (GroupIdentity, CPUSetAllocator, BatchResource) give the first list; Resctrl on a host with
resctrl adds ``PreRemoveRunPodSandbox``, a stage with no RPC.
"""

import os
from pathlib import Path
from typing import Sequence

ENDPOINT = "/var/run/koordlet/koordlet.sock"
DEFAULT_STAGES = ("PreRunPodSandbox", "PreCreateContainer", "PreUpdateContainerResources")
RESCTRL_STAGES = (*DEFAULT_STAGES, "PreRemoveRunPodSandbox")

DEFAULT = (
    b'{\n\t"remote-endpoint": "/var/run/koordlet/koordlet.sock",\n\t"failure-policy": "Ignore",\n'
    b'\t"runtime-hooks": [\n\t\t"PreRunPodSandbox",\n\t\t"PreCreateContainer",\n\t\t"PreUpdateContainerResources"\n'
    b"\t]\n}"
)
WITH_RESCTRL = (
    b'{\n\t"remote-endpoint": "/var/run/koordlet/koordlet.sock",\n\t"failure-policy": "Ignore",\n'
    b'\t"runtime-hooks": [\n\t\t"PreRunPodSandbox",\n\t\t"PreCreateContainer",\n\t\t"PreUpdateContainerResources",\n'
    b'\t\t"PreRemoveRunPodSandbox"\n\t]\n}'
)
NO_STAGES = b'{\n\t"remote-endpoint": "/var/run/koordlet/koordlet.sock",\n\t"failure-policy": "Ignore"\n}'


def registration(endpoint: str, stages: Sequence[str], policy: str = "Ignore") -> bytes:
    """The same shape for another endpoint (a test's own socket), as ``json.MarshalIndent`` lays it out."""
    lines = [f'\t"remote-endpoint": "{endpoint}"', f'\t"failure-policy": "{policy}"']
    if stages:
        listed = ",\n".join(f'\t\t"{stage}"' for stage in stages)
        lines.append(f'\t"runtime-hooks": [\n{listed}\n\t]')
    return ("{\n" + ",\n".join(lines) + "\n}").encode()


def register(directory: Path, data: bytes) -> Path:
    """Write ``koordlet.json`` as koordlet does: in place, mode 0644."""
    path = directory / "koordlet.json"
    directory.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as stream:
        stream.write(data)
    os.chmod(path, 0o644)
    return path
