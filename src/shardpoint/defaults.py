"""The defaults every entry point shares (saves, loads, copies, the manager's tiers)."""

DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3
DEFAULT_THREADS = 4
