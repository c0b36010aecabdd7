"""The defaults every entry point shares (saves, loads, copies, the manager's tiers)."""

DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
DEFAULT_THREADS = 4
# New tensors a load may hold at once for what it cannot read in place (resharding,
# strided or GPU destinations); the undo copy of an atomic load is on top of it.
DEFAULT_LOAD_HOST_BYTES = 512 * 1024**2
