"""An OCI image archive (an OCI image layout in one tar, as ``ctr images import`` and skopeo's
``oci-archive:`` read it) of one image for several platforms, each of one layer made from a root file
system in a tar: the same bytes from the same roots and the same arguments.

index.json lists each platform's manifest, with its platform, then the image index of them all, named:
containerd names an imported image after the annotation of an entry of index.json, so that the name
given to each platform's manifest would end on one platform's alone; given to the image index, it is the
image of every platform, each node running its own. (skopeo's ``oci-archive:FILE:TAG`` finds it by its tag.)
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"

# containerd names an imported image by this annotation of an entry of index.json; OCI's own names a tag.
CONTAINERD_NAME = "io.containerd.image.name"
REF_NAME = "org.opencontainers.image.ref.name"

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Image:
    """What the image is called and how its container runs, on every platform."""

    name: str  # a reference without a registry's host: "localhost/koordrp"
    tag: str
    entrypoint: Sequence[str]
    env: Sequence[str]
    created: int  # seconds since the epoch: SOURCE_DATE_EPOCH
    user: str = "0:0"
    labels: Mapping[str, str] = field(default_factory=dict)
    history: str = ""  # what made the layer, for `history`

    @property
    def reference(self) -> str:
        return f"{self.name}:{self.tag}"


@dataclass(frozen=True)
class Blob:
    digest: str  # "sha256:<hex>"
    size: int

    def descriptor(self, media_type: str, **extra: Any) -> dict[str, Any]:
        return {"mediaType": media_type, "digest": self.digest, "size": self.size, **extra}

    @property
    def path(self) -> str:
        return "blobs/sha256/" + self.digest.split(":", 1)[1]


def _json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _blob(data: bytes) -> Blob:
    return Blob("sha256:" + hashlib.sha256(data).hexdigest(), len(data))


def platform(architecture: str) -> dict[str, str]:
    return {"architecture": architecture, "os": "linux"}


def compress_layer(rootfs: IO[bytes], layer: IO[bytes]) -> tuple[str, Blob]:
    """Gzip the root's tar into ``layer``: its diff id (the tar's digest) and the layer's blob."""
    raw = hashlib.sha256()
    # No file name and a zero time in gzip's header: the layer's digest depends on the root alone.
    with gzip.GzipFile(filename="", mode="wb", fileobj=layer, compresslevel=6, mtime=0) as compressed:
        while chunk := rootfs.read(_CHUNK):
            raw.update(chunk)
            compressed.write(chunk)
    layer.seek(0)
    packed = hashlib.sha256()
    while chunk := layer.read(_CHUNK):
        packed.update(chunk)
    return "sha256:" + raw.hexdigest(), Blob("sha256:" + packed.hexdigest(), layer.tell())


def image_config(image: Image, architecture: str, diff_id: str) -> bytes:
    created = datetime.fromtimestamp(image.created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    config = {
        "created": created,
        **platform(architecture),
        "config": {
            "User": image.user,
            "Env": list(image.env),
            "Entrypoint": list(image.entrypoint),
            "WorkingDir": "/",
            "Labels": dict(image.labels),
            "StopSignal": "SIGTERM",
        },
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": created, "created_by": image.history}],
    }
    return _json(config)


def _member(name: str, size: int, created: int, directory: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.mode = 0o755 if directory else 0o644
    info.size = size
    info.mtime = created
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _compress(rootfs: Path, layer: IO[bytes]) -> tuple[str, Blob]:
    with rootfs.open("rb") as tar:
        return compress_layer(tar, layer)


def write_oci_archive(image: Image, roots: Mapping[str, Path], out: Path) -> Blob:
    """Write ``out``, the image of each architecture's root in ``roots`` (OCI's names, amd64 and arm64, each
    to a tar of its root file system); returns the blob of its image index."""
    architectures = sorted(roots)
    with ExitStack() as stack:
        layers = [stack.enter_context(tempfile.TemporaryFile()) for _ in architectures]
        # zlib lets go of the interpreter while it compresses: one root per core.
        with ThreadPoolExecutor(len(architectures)) as compressing:
            compressed = list(compressing.map(_compress, [roots[arch] for arch in architectures], layers))
        small: dict[str, bytes] = {}
        manifests = []
        for architecture, (diff_id, layer_blob) in zip(architectures, compressed):
            config = image_config(image, architecture, diff_id)
            config_blob = _blob(config)
            manifest = _json({
                "schemaVersion": 2,
                "mediaType": MANIFEST,
                "config": config_blob.descriptor(CONFIG),
                "layers": [layer_blob.descriptor(LAYER)],
            })
            manifest_blob = _blob(manifest)
            small |= {config_blob.path: config, manifest_blob.path: manifest}
            manifests.append(manifest_blob.descriptor(MANIFEST, platform=platform(architecture)))
        image_index = _json({"schemaVersion": 2, "mediaType": INDEX, "manifests": manifests})
        index_blob = _blob(image_index)
        small[index_blob.path] = image_index
        annotations = {CONTAINERD_NAME: image.reference, REF_NAME: image.tag}
        index = _json({
            "schemaVersion": 2,
            "mediaType": INDEX,
            "manifests": [*manifests, index_blob.descriptor(INDEX, annotations=annotations)],
        })
        partial = out.with_name(out.name + ".partial")
        with tarfile.open(partial, "w", format=tarfile.USTAR_FORMAT) as archive:
            for directory in ("blobs", "blobs/sha256"):
                archive.addfile(_member(directory, 0, image.created, directory=True))
            for name, data in {"oci-layout": _json({"imageLayoutVersion": "1.0.0"}), "index.json": index, **small}.items():
                archive.addfile(_member(name, len(data), image.created), io.BytesIO(data))
            # Platforms whose roots are the same bytes share their layer: one member.
            unique = {layer_blob.path: (layer, layer_blob) for layer, (_, layer_blob) in zip(layers, compressed)}
            for layer, layer_blob in unique.values():
                layer.seek(0)
                archive.addfile(_member(layer_blob.path, layer_blob.size, image.created), layer)
        shutil.move(partial, out)
    return index_blob
