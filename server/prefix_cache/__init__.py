"""The automatic prefix-state cache: states after token prefixes, reused by stateless requests."""

from server.prefix_cache.radix import CacheStats, PrefixCache

__all__ = ["CacheStats", "PrefixCache"]
