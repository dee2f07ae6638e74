"""The automatic prefix-state cache: states after token prefixes, reused by stateless requests."""

from linserve.server.prefix_cache.radix import CacheStats, PrefixCache

__all__ = ["CacheStats", "PrefixCache"]
