"""Test helpers that reach into the capsule store (what bit rot in memory would do)."""
import torch

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
