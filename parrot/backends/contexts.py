"""The adapter's own context tree: Fill / Generate / FreeContext emulated over token ids kept on our side.

An external server (vLLM, SGLang, llama.cpp, any OpenAI-compatible one) knows requests, not contexts. The adapter
keeps each context's content here and sends the whole sequence with every generation; the server's own prefix
cache (vLLM automatic prefix caching, SGLang's radix cache, llama.cpp's ``cache_prompt`` slots) then finds the
shared prefix again, so a fork's reuse stays real on the server while no KV state crosses the wire.

A context is a node holding its own items after its parent's; a fork points at its parent, so siblings share the
parent's items without copying them::

    root  [t0 t1 t2 t3]                      ctx "prefix"
      +-- child [t4 t5 | g0 g1]              ctx "a"  (fill t4 t5, then generated g0 g1)
      +-- child [t6]                         ctx "b"
    sequence(a) = t0 t1 t2 t3 t4 t5 g0 g1

Invariants: a node's items only grow, and only before it has children (appending to a forked parent would change
what its children see, so the node is split: the new items go to a fresh node that takes the parent's place);
freeing a context only drops its name, its node stays alive as long as a child refers to it. Items are token ids
for kinds that take token prompts, and the bytes of the text (one id per byte) for text-only servers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from parrot.common.errors import UnknownContext


@dataclass(eq=False)
class _Node:
    parent: "_Node | None"
    items: list[int] = field(default_factory=list)
    length: int = 0  # items of this node and all its ancestors
    children: int = 0  # live child nodes (forks) pointing here

    def sequence(self) -> list[int]:
        parts: list[list[int]] = []
        node: _Node | None = self
        while node is not None:
            parts.append(node.items)
            node = node.parent
        out: list[int] = []
        for part in reversed(parts):
            out.extend(part)
        return out


class ContextTree:
    """Named contexts over shared nodes. Not thread-safe; the adapter calls it from one event loop."""

    def __init__(self) -> None:
        self._by_name: dict[str, _Node] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def open(self, name: str, parent: str | None) -> tuple[_Node, bool]:
        """The node of ``name``, created (as a fork of ``parent`` if given) when new; (node, created).

        Raises UnknownContext for an unknown parent of a new context (an existing context keeps its parent, as in
        the builtin engine)."""
        node = self._by_name.get(name)
        if node is not None:
            return node, False
        base: _Node | None = None
        if parent is not None:
            base = self._by_name.get(parent)
            if base is None:
                raise UnknownContext(f"unknown parent context {parent!r}", param="parent_context_id")
        node = _Node(parent=base, length=base.length if base is not None else 0)
        if base is not None:
            base.children += 1
        self._by_name[name] = node
        return node, True

    def get(self, name: str) -> _Node:
        node = self._by_name.get(name)
        if node is None:
            raise UnknownContext(f"unknown context {name!r}", param="context_id")
        return node

    def append(self, name: str, items: Sequence[int]) -> int:
        """Append ``items`` to context ``name``; returns its new length."""
        node = self.get(name)
        if not items:
            return node.length
        if node.children:  # forked: keep what the children see, continue in a fresh node
            fresh = _Node(parent=node, items=list(items), length=node.length + len(items))
            node.children += 1
            self._by_name[name] = fresh
            return fresh.length
        node.items.extend(items)
        node.length += len(items)
        return node.length

    def sequence(self, name: str) -> list[int]:
        return self.get(name).sequence()

    def length(self, name: str) -> int:
        return self.get(name).length

    def free(self, name: str) -> None:
        """Drop the name; the node is released with its last child (its parent's count drops then)."""
        node = self._by_name.pop(name, None)
        if node is None:
            raise UnknownContext(f"unknown context {name!r}", param="context_id")
        if node.children == 0:
            self._release(node)

    def _release(self, node: _Node) -> None:
        parent = node.parent
        while parent is not None:
            parent.children -= 1
            if parent.children or any(n is parent for n in self._by_name.values()):
                return
            node, parent = parent, parent.parent

    def total_items(self) -> int:
        """Items held by live nodes, shared ones once (the adapter's memory, reported in its status)."""
        seen: set[int] = set()
        total = 0
        for node in self._by_name.values():
            cur: _Node | None = node
            while cur is not None and id(cur) not in seen:
                seen.add(id(cur))
                total += len(cur.items)
                cur = cur.parent
        return total
