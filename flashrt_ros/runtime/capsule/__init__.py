"""Capsules: immutable copies of the engine's live state, and everything that keeps them.

- ``capsule.py``: what a capsule is: id and label rules, :class:`CapsuleInfo`, the byte :class:`Layout` (the
  arena's manifest), blocks and segments, :class:`StoredCapsule`.
- ``store.py``: :class:`CapsuleStore`: capsules by id over shared blocks, lineage, numbering, the device budget.
- ``live.py``: copies between the live arena and capsules (:class:`LiveCopier`, :class:`LiveRows`): a snapshot
  shares the rows the arena already holds, a restore writes only the rows that differ.
- ``tiers.py``: the tiers below the device (host, disk) and the eviction policy.
- ``file.py``: the capsule file format, its authentication, the capsule directory.
- ``manager.py``: :class:`CapsuleManager`, the engine's capsule calls that do not touch the live arena (the engine
  keeps snapshot, restore, fork and rollback, which move the live state, through ``live.py``).
"""
