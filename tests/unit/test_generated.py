"""The committed stubs are exactly what scripts/generate-stubs makes: the hook API and ttrpc's envelope from
proto/, the CRI schema from the container-runtime-interface-api package's descriptors, NRI's messages from
the api.proto of Debian sid's golang-github-containerd-nri-dev (NRI 0.8); the hand-written ttrpc envelope
agrees with the request.proto of Debian 13's golang-github-containerd-ttrpc-dev."""

import os
import subprocess
import sys
from pathlib import Path

from twisted.trial.unittest import SynchronousTestCase

from tests.support.tempdirs import short_tempdir

ROOT = Path(__file__).resolve().parents[2]
TTRPC_SOURCE = ROOT / ".deps/trixie/root/usr/share/gocode/src/github.com/containerd/ttrpc"
GENERATED = {
    Path("koordrp/api/runtime/v1alpha1"): ["api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py"],
    Path("koordrp/api/cri/v1"): ["api_pb2.py", "api_pb2.pyi"],
    Path("koordrp/api/nri/v1alpha1"): ["api_pb2.py", "api_pb2.pyi"],
    Path("koordrp/api/ttrpc"): ["ttrpc_pb2.py", "ttrpc_pb2.pyi"],
}


class GeneratedStubsTests(SynchronousTestCase):
    def test_stubs_match_their_sources(self) -> None:
        out = Path(short_tempdir(self))
        subprocess.run(
            [str(ROOT / "scripts" / "generate-stubs"), str(out)],
            cwd=ROOT,
            env={**os.environ, "PYTHON": sys.executable},
            check=True,
            capture_output=True,
        )
        for directory, expected in GENERATED.items():
            names = sorted(path.name for path in (out / directory).iterdir())
            self.assertEqual(names, expected)
            for name in names:
                fresh = (out / directory / name).read_text()
                committed = (ROOT / directory / name).read_text()
                self.assertEqual(committed, fresh, f"{directory / name} is stale: run scripts/generate-stubs")

    def test_the_ttrpc_envelope_names_fields_as_ttrpcs_own_proto_does(self) -> None:
        from importlib.resources import files

        from google.protobuf import descriptor_pb2

        from koordrp.api.ttrpc import ttrpc_pb2

        descriptors = Path(short_tempdir(self)) / "ttrpc.pb"
        subprocess.run(
            [
                sys.executable, "-m", "grpc_tools.protoc", f"-I{TTRPC_SOURCE}", f"-I{files('grpc_tools') / '_proto'}",
                "--include_imports", f"--descriptor_set_out={descriptors}", "request.proto",
            ],
            check=True,
            capture_output=True,
        )
        theirs = {
            message.name: {field.name: (field.number, field.type) for field in message.field}
            for file in descriptor_pb2.FileDescriptorSet.FromString(descriptors.read_bytes()).file
            if file.package == "ttrpc"
            for message in file.message_type
        }
        # Status is google.rpc.Status on the wire; the package's proto/status.proto is a stand-in.
        for name in ("Request", "Response", "KeyValue"):
            ours = {field.name: (field.number, field.type) for field in ttrpc_pb2.DESCRIPTOR.message_types_by_name[name].fields}
            self.assertEqual({field: theirs[name][field] for field in ours}, ours, name)

    def test_the_cri_schema_is_the_packages_with_env_values_as_bytes(self) -> None:
        from cri_api.v1 import api_pb2 as package
        from google.protobuf.descriptor import FieldDescriptor

        from koordrp.api.cri.v1 import api_pb2 as ours

        differences = []
        for name, message in package.DESCRIPTOR.message_types_by_name.items():
            mine = ours.DESCRIPTOR.message_types_by_name[name]
            self.assertEqual(
                [(field.name, field.number) for field in mine.fields], [(field.name, field.number) for field in message.fields]
            )
            differences += [
                (name, field.name, theirs.type, field.type)
                for field, theirs in zip(mine.fields, message.fields)
                if field.type != theirs.type
            ]
        self.assertEqual(differences, [("KeyValue", "value", FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)])

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
