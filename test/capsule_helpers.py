"""Test helpers that reach into the capsule store (what bit rot in memory would do) and take capsule files apart."""
import json

import torch

from flashrt_ros.runtime.capsule import file as capsule_file
from flashrt_ros.runtime.capsule.capsule import opaque_rows, segment_bytes


def flip_capsule_byte(engine, capsule_id: str, index: int, mask: int = 0x01) -> None:
    """Flip bits of byte ``index`` (capsule layout) where the store holds it; capsules sharing that block see it too."""
    if index < 0:
        index += engine.capsule(capsule_id).nbytes
    for segments in engine.store.get(capsule_id).rows.values():
        for segment in segments:
            data = segment_bytes(segment)
            if index < data.numel():
                with torch.inference_mode():
                    data[index] ^= mask
                return
            index -= data.numel()
    raise IndexError(f"capsule {capsule_id!r} has no byte {index}")


def plant_foreign_capsule(engine, source, capsule_id: str) -> None:
    """Put ``source``'s capsule into ``engine``'s store as it is, fingerprint and all: an import refuses a capsule of
    another model, so this is how a test reaches restore's own fingerprint check."""
    capsule = source.store.full_capsule(capsule_id)
    engine.store.add_rows(capsule.info, capsule.fingerprint, opaque_rows(capsule.data), lineage_parent="")


def split(blob: bytes) -> tuple[dict, bytes]:
    """(header fields, payload) of a format-2 file."""
    _, _, length = capsule_file._PRELUDE.unpack_from(blob)
    start = capsule_file._PRELUDE.size
    payload = blob[start + length + capsule_file._TAG_BYTES:-capsule_file._TAG_BYTES]
    return json.loads(blob[start:start + length]), payload


def assemble(header: dict | bytes, payload: bytes, key: bytes | None = None) -> bytes:
    """A well-formed file whose digests (or, with ``key``, HMACs) are computed over whatever it holds."""
    encoded = header if isinstance(header, bytes) else json.dumps(header).encode()
    prelude = capsule_file._PRELUDE.pack(capsule_file._MAGIC, capsule_file._VERSION, len(encoded))
    header_mac = capsule_file._mac(key, capsule_file._HEADER_DOMAIN)
    header_mac.update(prelude + encoded)
    file_mac = capsule_file._mac(key, capsule_file._FILE_DOMAIN)
    file_mac.update(prelude + encoded + header_mac.digest() + payload)
    return prelude + encoded + header_mac.digest() + payload + file_mac.digest()
