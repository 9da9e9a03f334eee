"""Capsules: immutable copies of the engine's live state, the budgeted store that holds them, the tiers below the
device, and capsule files."""
