"""The committed hook API stubs are exactly what scripts/generate-stubs makes from proto/."""

import os
import subprocess
import sys
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from tests.support.tempdirs import short_tempdir

ROOT = Path(__file__).resolve().parents[2]
GENERATED = Path("koordrp/api/runtime/v1alpha1")


class GeneratedStubsTests(SynchronousTestCase):
    def test_stubs_match_the_proto(self) -> None:
        out = Path(short_tempdir(self))
        subprocess.run(
            [str(ROOT / "scripts" / "generate-stubs"), str(out)],
            cwd=ROOT,
            env={**os.environ, "PYTHON": sys.executable},
            check=True,
            capture_output=True,
        )
        names = sorted(path.name for path in (out / GENERATED).iterdir())
        self.assertEqual(names, ["api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"])
        for name in names:
            fresh = (out / GENERATED / name).read_text()
            committed = (ROOT / GENERATED / name).read_text()
            self.assertEqual(committed, fresh, f"{GENERATED / name} is stale: run scripts/generate-stubs")

    def test_wire_names_are_koordinators(self) -> None:
        from koordrp.api.runtime.v1alpha1 import api_pb2

        service = api_pb2.DESCRIPTOR.services_by_name["RuntimeHookService"]
        self.assertEqual(service.full_name, "runtime.v1alpha1.RuntimeHookService")
        self.assertEqual(
            sorted(method.name for method in service.methods),
            sorted(
                [
                    "PreRunPodSandboxHook",
                    "PostStopPodSandboxHook",
                    "PreCreateContainerHook",
                    "PreStartContainerHook",
                    "PostStartContainerHook",
                    "PostStopContainerHook",
                    "PreUpdateContainerResourcesHook",
                ]
            ),
        )
        request = api_pb2.ContainerResourceHookRequest.DESCRIPTOR
        self.assertEqual(
            [(field.name, field.number) for field in request.fields],
            [
                ("pod_meta", 1),
                ("container_meta", 2),
                ("container_annotations", 3),
                ("container_resources", 4),
                ("pod_resources", 5),
                ("pod_annotations", 6),
                ("pod_labels", 7),
                ("pod_cgroup_parent", 8),
                ("container_envs", 9),
            ],
        )
