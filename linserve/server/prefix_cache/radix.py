"""A radix tree of token prefixes whose nodes may hold a model state (an *entry*).

Why a radix tree and not chained block hashes (vLLM) : a recurrent state exists only at the
positions where it was taken (the end of a prompt, the end of a generation, every N tokens of
a long prefill), not at every block boundary, and a state after token 41 is worth as much as
one after token 48. A tree keyed by the tokens themselves finds the deepest entry on a
request's path in one walk, at any position, with no block size that short prompts fall
under (vLLM's 528-token recurrent blocks never hit below 528 tokens).

Entries are immutable: the engine never advances a state in place that it did not create
(``prefill`` copies its input; the batch pool copies rows in), so a hit hands out the stored
object itself and an eviction only drops the cache's reference; a running sequence that took
a state keeps it. LRU under a byte budget.

Entries may share memory: the states a long prefill leaves along one prompt read one buffer
of keys and values (:class:`linserve.model.state.SharedKV`). An entry is inserted with its
*parts*, bytes by a key naming the memory (the engine's: a tensor storage's address), and the
budget counts each part once while any entry holds it: evicting an entry frees only the
parts no other entry holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from linserve.server.sessions.transcript import common_prefix

S = TypeVar("S")


@dataclass
class CacheStats:
    """Counters for the metrics (tokens, not requests, as vLLM counts them)."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    inserts: int = 0


class Match(NamedTuple, Generic[S]):
    depth: int  # tokens covered by ``state`` (0: no entry)
    state: S | None
    shared: int  # tokens of the query found on the tree's paths, entry or not


@dataclass(eq=False)
class _Node(Generic[S]):
    edge: tuple[int, ...]
    depth: int
    parent: _Node[S] | None
    children: dict[int, _Node[S]] = field(default_factory=dict)
    state: S | None = None
    parts: Mapping[Hashable, int] = field(default_factory=dict)


class PrefixCache(Generic[S]):
    """Longest-prefix lookup of states by token ids, LRU under ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.root: _Node[S] = _Node((), 0, None)
        self.lru: OrderedDict[_Node[S], None] = OrderedDict()
        self.bytes = 0  # each part counted once
        self._held: dict[Hashable, list[int]] = {}  # part -> [entries holding it, bytes]
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self.lru)

    @property
    def longest(self) -> int:
        """Tokens of the deepest entry (0: none)."""
        return max((node.depth for node in self.lru), default=0)

    @property
    def shared_bytes(self) -> int:
        """Bytes held by more than one entry (counted once in :attr:`bytes`)."""
        return sum(nbytes for count, nbytes in self._held.values() if count > 1)

    def states(self) -> list[S]:
        """Every state held, least recently used first."""
        return [node.state for node in self.lru if node.state is not None]

    def match(self, tokens: Sequence[int], limit: int) -> Match[S]:
        """The deepest entry whose prefix is ``tokens[:depth]`` with ``depth <= limit``, and
        how far ``tokens`` follow a path the tree has seen (``shared``: where this prompt
        branches off an earlier one, a good place to keep a state). Counts the query."""
        best: _Node[S] | None = None
        node, i = self.root, 0
        while True:
            if node.state is not None and node.depth <= limit:
                best = node
            if i >= len(tokens):
                break
            child = node.children.get(tokens[i])
            if child is None:
                break
            n = common_prefix(child.edge, tokens[i : i + len(child.edge)])
            if n < len(child.edge):
                i += n
                break
            node, i = child, i + n
        self.stats.queried_tokens += len(tokens)
        if best is None:
            return Match(0, None, i)
        self.lru.move_to_end(best)
        self.stats.hit_tokens += best.depth
        return Match(best.depth, best.state, i)

    def get(self, tokens: Sequence[int]) -> S | None:
        """The state kept after exactly ``tokens`` (None: none), counting nothing."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None or tuple(tokens[i : i + len(child.edge)]) != child.edge:
                return None
            node, i = child, i + len(child.edge)
        return node.state

    def insert(self, tokens: Sequence[int], state: S,
               parts: int | Mapping[Hashable, int]) -> bool:
        """Store ``state`` as the state after ``tokens`` (replacing an entry there); False
        if it cannot fit the budget at all. ``parts``: its bytes by the memory they are
        in, shared with other entries where the keys agree (an int: all its own)."""
        if isinstance(parts, int):
            parts = {object(): parts}
        if not tokens or sum(parts.values()) > self.max_bytes:
            return False
        node = self._node_for(tuple(tokens))
        if node.state is not None:
            self._release(node)
        node.state, node.parts = state, dict(parts)
        for key, nbytes in node.parts.items():
            held = self._held.setdefault(key, [0, nbytes])
            if held[0] == 0:
                self.bytes += nbytes
            held[0] += 1
        self.lru[node] = None
        self.lru.move_to_end(node)
        self.stats.inserts += 1
        self._evict(keep=node)
        return True

    def _release(self, node: _Node[S]) -> None:
        """Let go of ``node``'s parts; the bytes of those no other entry holds are freed."""
        for key in node.parts:
            held = self._held[key]
            held[0] -= 1
            if held[0] == 0:
                self.bytes -= held[1]
                del self._held[key]
        node.parts = {}

    def _node_for(self, tokens: tuple[int, ...]) -> _Node[S]:
        """The node at exactly ``tokens``, creating it (and splitting an edge) if needed."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf: _Node[S] = _Node(tokens[i:], len(tokens), node)
                node.children[tokens[i]] = leaf
                return leaf
            n = common_prefix(child.edge, tokens[i:])
            if n < len(child.edge):
                child = self._split(child, n)
            node, i = child, i + n
        return node

    @staticmethod
    def _split(child: _Node[S], n: int) -> _Node[S]:
        """Cut ``child``'s edge after ``n`` tokens; returns the new middle node."""
        parent = child.parent
        assert parent is not None
        mid: _Node[S] = _Node(child.edge[:n], child.depth - len(child.edge) + n, parent)
        parent.children[child.edge[0]] = mid
        child.edge = child.edge[n:]
        child.parent = mid
        mid.children[child.edge[0]] = child
        return mid

    def _evict(self, keep: _Node[S]) -> None:
        while self.bytes > self.max_bytes and len(self.lru) > 1:
            victim = next(iter(self.lru))
            if victim is keep:
                self.lru.move_to_end(victim)
                continue
            self.drop(victim)
            self.stats.evictions += 1

    def drop(self, node: _Node[S]) -> None:
        """Remove a node's entry and prune the branch it leaves empty."""
        self.lru.pop(node, None)
        self._release(node)
        node.state = None
        while node.parent is not None and node.state is None and not node.children:
            del node.parent.children[node.edge[0]]
            node = node.parent
