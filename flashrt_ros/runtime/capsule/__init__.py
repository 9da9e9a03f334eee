"""Capsules: immutable copies of the engine's live state, and everything that keeps them.

- ``capsule.py``: what a capsule is: id and label rules, :class:`CapsuleInfo`, the byte :class:`Layout` (the
  arena's manifest), blocks and segments, :class:`StoredCapsule`.
- ``store.py``: :class:`CapsuleStore`: capsules by id over shared blocks, lineage, numbering, the device budget;
  :class:`LiveRows`.
- ``tiers.py``: the tiers below the device (host, disk) and the eviction policy.
- ``file.py``: the capsule file format, its authentication, the capsule directory.
- ``manager.py``: :class:`CapsuleManager`, the engine's capsule calls that do not touch the live arena.
"""
