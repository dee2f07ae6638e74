"""The prefix cache's radix tree: longest-prefix hits at any depth, edge splits, LRU under a
byte budget, pruning."""

from __future__ import annotations

import random

from linserve.server.prefix_cache import PrefixCache
from linserve.server.sessions.transcript import common_prefix


def test_longest_cached_prefix_wins_and_limit_is_respected() -> None:
    cache: PrefixCache[str] = PrefixCache(10**6)
    cache.insert([1, 2, 3], "a", 10)
    cache.insert([1, 2, 3, 4, 5, 6], "b", 10)
    cache.insert([1, 2, 9], "c", 10)  # splits the edge (1, 2, 3)
    assert cache.match([1, 2, 3, 4, 5, 6, 7], 100) == (6, "b", 6)
    assert cache.match([1, 2, 3, 4, 5, 6], 5) == (3, "a", 6)  # leave a token to prefill
    assert cache.match([1, 2, 3, 4, 9], 100) == (3, "a", 4)  # diverges inside a cached span
    assert cache.match([1, 2, 9, 9], 100) == (3, "c", 3)
    assert cache.match([1, 2], 100) == (0, None, 2)
    assert cache.match([7], 100) == (0, None, 0)
    assert cache.stats.hit_tokens == 6 + 3 + 3 + 3


def test_lru_eviction_under_the_byte_budget_and_pruning() -> None:
    cache: PrefixCache[int] = PrefixCache(30)
    for i in range(3):
        cache.insert([i, 1, 2], i, 10)
    cache.match([0, 1, 2, 3], 10)  # 0 is now most recent
    cache.insert([5, 5], 5, 10)  # evicts 1, the least recent
    assert cache.bytes == 30 and len(cache) == 3 and cache.stats.evictions == 1
    assert cache.match([1, 1, 2, 3], 10).state is None
    assert 1 not in cache.root.children  # its branch was pruned
    assert not cache.insert([9], 9, 31)  # larger than the whole budget


def test_replacing_an_entry_keeps_the_byte_count() -> None:
    cache: PrefixCache[str] = PrefixCache(100)
    cache.insert([1, 2], "x", 40)
    cache.insert([1, 2], "y", 30)
    assert cache.bytes == 30 and cache.match([1, 2, 3], 5) == (2, "y", 2)


def test_random_inserts_agree_with_a_brute_force_search() -> None:
    rng = random.Random(0)
    cache: PrefixCache[tuple[int, ...]] = PrefixCache(10**9)
    stored: list[tuple[int, ...]] = []
    for _ in range(300):
        base = list(rng.choice(stored)) if stored and rng.random() < 0.7 else []
        key = tuple(base[: rng.randint(0, len(base))] + [rng.randint(0, 3)
                                                         for _ in range(rng.randint(1, 6))])
        cache.insert(key, key, 1)
        stored.append(key)
    for _ in range(300):
        query = list(rng.choice(stored)) + [rng.randint(0, 3) for _ in range(3)]
        limit = rng.randint(0, len(query))
        want = max((k for k in stored if len(k) <= limit and tuple(query[: len(k)]) == k),
                   key=len, default=None)
        depth, got, shared = cache.match(query, limit)
        assert got == want and depth == (len(want) if want else 0)
        assert shared == max(common_prefix(k, query) for k in stored)


def test_memory_shared_by_entries_is_counted_once_and_freed_with_the_last() -> None:
    cache: PrefixCache[str] = PrefixCache(100)
    cache.insert([1], "a", {"kv": 40, "a": 5})  # a long prefill's states: one KV buffer
    cache.insert([1, 2], "b", {"kv": 40, "b": 5})
    cache.insert([1, 2, 3], "c", {"kv": 40, "c": 5})
    assert cache.bytes == 40 + 15
    cache.insert([7], "x", {"x": 50})  # over budget: "a" goes, the buffer stays
    assert cache.bytes == 40 + 10 + 50 and cache.stats.evictions == 1
    assert cache.match([1, 2, 3], 3).state == "c"  # the LRU order: b, x, c
    cache.insert([8], "y", {"y": 20})  # "b" goes (5 bytes: not enough), then "x"
    assert cache.bytes == 40 + 5 + 20 and cache.stats.evictions == 3
    cache.insert([9], "z", {"z": 40})  # then "c", and the buffer with it
    assert cache.bytes == 20 + 40 and len(cache) == 2
    assert not cache.insert([5], "w", {"kv2": 60, "w": 41})  # more than the budget alone
