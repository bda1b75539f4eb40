"""Writes the CRI v1 schema koordrp parses kubelet's requests with, as a FileDescriptorSet.

The schema is the one the ``container-runtime-interface-api`` package describes, moved to a
package of koordrp's own (``koordrp.cri.v1``): the wire only sees field numbers and types, and a
name of its own lets both be loaded in one process (the tests build requests with the package's
classes). Services are left out: koordrp routes calls by method name and forwards raw bytes.

One field differs from the package: ``KeyValue.value`` is ``bytes``, as in cri-api v0.34.9,
v0.35.6, v0.36.2 and later (the package still says ``string``). A current kubelet may send an
environment value that is not UTF-8, which a ``string`` field refuses to parse.

    python -m scripts.cri_schema OUT.pb
"""

import sys

from cri_api.v1 import api_pb2
from google.protobuf import descriptor_pb2

FILE_NAME = "koordrp/api/cri/v1/api.proto"
PACKAGE = "koordrp.cri.v1"


def _rename_types(message: descriptor_pb2.DescriptorProto, old: str, new: str) -> None:
    for field in message.field:
        if field.type_name.startswith(old):
            field.type_name = new + field.type_name[len(old) :]
    for nested in message.nested_type:
        _rename_types(nested, old, new)


def koordrp_schema() -> descriptor_pb2.FileDescriptorProto:
    schema = descriptor_pb2.FileDescriptorProto()
    api_pb2.DESCRIPTOR.CopyToProto(schema)
    old_prefix = f".{schema.package}."
    schema.name = FILE_NAME
    schema.package = PACKAGE
    schema.ClearField("options")
    schema.ClearField("service")
    for message in schema.message_type:
        _rename_types(message, old_prefix, f".{PACKAGE}.")
    _bytes_field(schema, "KeyValue", "value")
    return schema


def _bytes_field(schema: descriptor_pb2.FileDescriptorProto, message_name: str, field_name: str) -> None:
    (message,) = [message for message in schema.message_type if message.name == message_name]
    (field,) = [field for field in message.field if field.name == field_name]
    field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES


def main() -> None:
    (out,) = sys.argv[1:]
    files = descriptor_pb2.FileDescriptorSet(file=[koordrp_schema()])
    with open(out, "wb") as stream:
        stream.write(files.SerializeToString())


if __name__ == "__main__":
    main()
