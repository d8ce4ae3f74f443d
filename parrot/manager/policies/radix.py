"""The global prefix radix tree of Preble's E2 scheduler (§4.2): token-id prefixes of recent prompts, which engines
cache each, and how many requests hit each node per engine within a window. No torch, no I/O.

    root ── [sys prompt: 1200 tok] ─┬─ [tool A instr: 600] ─┬─ [query 1: 40]     engines {e0}     hits {e0: 1}
            engines {e0,e1}         │   engines {e0}        └─ [query 2: 35]     engines {e0}     hits {e0: 1}
            hits {e0: 9, e1: 7}     └─ [tool B instr: 800] ── [query 3: 52]     engines {e1}     hits {e1: 1}

Invariants:

* a node's tokens are its own (``key``); ``start`` = tokens of its ancestors, so the node covers prompt positions
  [start, start + len(key));
* children of a node start with distinct tokens (``children`` is keyed by the first token);
* ``engines[e]`` is the tree's *belief* that engine ``e`` holds the node's KV: set when a request is placed
  there (Preble's allocation), cleared by an eviction notice from the engine or by the tree's emulation of
  the engine's LRU (:meth:`RadixTree.evict_lru`) when the engine's cached tokens exceed its capacity;
* if ``e`` holds a node it holds all of the node's ancestors (a placement marks the whole path; eviction
  removes a node and its whole subtree from ``e``);
* ``hits[e]`` counts requests placed on ``e`` through this node within the last ``window_s`` seconds;
* a node that no engine holds and no request hit within the window is pruned (with its subtree, which then
  holds nothing either).

LRU emulation: per engine an ordered set of the nodes it holds, least recently used first; a placement touches
its path leaf first, root last, so an ancestor is never older than its descendants and the LRU order evicts
leaves before the prefixes they extend (Preble §4.3's eviction of tree nodes by access time).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence


class Node:
    __slots__ = ("key", "start", "parent", "children", "engines", "hits", "hashes", "__weakref__")

    def __init__(self, key: tuple[int, ...], start: int, parent: "Node | None") -> None:
        self.key = key
        self.start = start
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.engines: set[str] = set()
        self.hits: dict[str, int] = {}
        self.hashes: list[int] = []  # block chain hashes registered at this node (see RadixTree.register_blocks)

    @property
    def num_tokens(self) -> int:
        return len(self.key)

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def total_hits(self) -> int:
        return sum(self.hits.values())

    def __repr__(self) -> str:
        return f"Node([{self.start}, {self.end}), engines={sorted(self.engines)}, hits={self.hits})"


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of ``a`` and ``b`` (binary search on C-speed slice compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class RadixTree:
    def __init__(self, window_s: float = 60.0) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = window_s
        self.root = Node((), 0, None)
        self._events: deque[tuple[float, str, Node]] = deque()  # (time, engine, last node of the path) in the window
        self._lru: dict[str, OrderedDict[Node, None]] = {}  # engine -> nodes it holds, least recently used first
        self.cached_tokens: dict[str, int] = {}  # engine -> tokens of the nodes it holds
        self._blocks: dict[int, tuple[Node, int]] = {}  # block chain hash -> (node registered, block's last position)
        self.num_nodes = 1

    # ---- matching ---------------------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> tuple[list[Node], int]:
        """(nodes matched root-first, the last one possibly only partly; tokens matched in all)."""
        toks = tokens if isinstance(tokens, tuple) else tuple(tokens)
        node, pos, path, n = self.root, 0, [], len(toks)
        while pos < n:
            child = node.children.get(toks[pos])
            if child is None:
                break
            k = len(child.key)
            if toks[pos:pos + k] == child.key:
                path.append(child)
                pos += k
                node = child
                continue
            c = _common(child.key, toks[pos:pos + k])
            if c:
                path.append(child)
                pos += c
            break
        return path, pos

    def cached_len(self, path: Sequence[Node], engine: str, matched: int | None = None) -> int:
        """Tokens of the matched ``path`` (``matched`` tokens in all, the last node possibly partly) that ``engine``
        holds: the prefix up to its first node not held."""
        held = 0
        for node in path:
            if engine not in node.engines:
                break
            held = node.end
        return held if matched is None else min(held, matched)

    # ---- insertion --------------------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int]) -> list[Node]:
        """The path of nodes covering ``tokens`` exactly (splitting a node or adding a leaf as needed)."""
        toks = tokens if isinstance(tokens, tuple) else tuple(tokens)
        node, pos, path, n = self.root, 0, [], len(toks)
        while pos < n:
            child = node.children.get(toks[pos])
            if child is None:
                leaf = Node(toks[pos:], pos, node)
                node.children[toks[pos]] = leaf
                self.num_nodes += 1
                path.append(leaf)
                return path
            k = len(child.key)
            c = _common(child.key, toks[pos:pos + k])
            if c < k:
                child = self._split(child, c)
            path.append(child)
            pos += c
            node = child
        return path

    def _split(self, node: Node, at: int) -> Node:
        """Split ``node`` after ``at`` tokens; returns the new upper node (``node`` keeps the tail and its identity,
        so references to it -- LRU entries, block hashes -- stay valid for the tail)."""
        parent = node.parent
        assert parent is not None
        upper = Node(node.key[:at], node.start, parent)
        upper.engines = set(node.engines)
        upper.hits = dict(node.hits)
        parent.children[node.key[0]] = upper
        node.key = node.key[at:]
        node.start += at
        node.parent = upper
        upper.children[node.key[0]] = node
        self.num_nodes += 1
        for e in upper.engines:  # approximation: both halves become the engine's most recently used, the
            lru = self._lru[e]   # upper one last (an ancestor is never older than its descendants)
            lru.move_to_end(node)
            lru[upper] = None
        return upper

    # ---- placement and hits -------------------------------------------------------------------------------------
    def record(self, path: Sequence[Node], engine: str, now: float) -> None:
        """A request through ``path`` was placed on ``engine``: it holds the path now, and each node gets a hit."""
        lru = self._lru.setdefault(engine, OrderedDict())
        added = 0
        for node in reversed(path):  # leaf first: ancestors end up more recently used than their descendants
            if engine not in node.engines:
                node.engines.add(engine)
                added += len(node.key)
            node.hits[engine] = node.hits.get(engine, 0) + 1
            lru[node] = None
            lru.move_to_end(node)
        self.cached_tokens[engine] = self.cached_tokens.get(engine, 0) + added
        if path:
            self._events.append((now, engine, path[-1]))

    def expire(self, now: float) -> None:
        """Forget hits older than the window; prune nodes nobody holds or hit within it."""
        limit = now - self.window_s
        events = self._events
        while events and events[0][0] < limit:
            _, engine, node = events.popleft()
            # the path is the leaf's ancestors: a split since inserted a node between them, which copied the hits
            n: Node | None = node
            while n is not None and n is not self.root:
                c = n.hits.get(engine, 0) - 1
                if c > 0:
                    n.hits[engine] = c
                else:
                    n.hits.pop(engine, None)
                n = n.parent
            self._maybe_prune(node)

    def _maybe_prune(self, node: Node) -> None:
        while node is not self.root and node.parent is not None and not node.engines and not node.hits \
                and not node.children:
            parent = node.parent
            if parent.children.get(node.key[0]) is node:
                del parent.children[node.key[0]]
            node.parent = None
            self.num_nodes -= 1
            for h in node.hashes:  # blocks that ended in this node are gone with it
                if h in self._blocks and self._blocks[h][0] is node:
                    del self._blocks[h]
            node = parent

    # ---- eviction ---------------------------------------------------------------------------------------------
    def evict(self, node: Node, engine: str) -> int:
        """``engine`` no longer holds ``node`` nor anything below it; returns the tokens dropped."""
        dropped = 0
        stack = [node]
        lru = self._lru.get(engine)
        while stack:
            n = stack.pop()
            if engine in n.engines:
                n.engines.discard(engine)
                dropped += len(n.key)
                if lru is not None:
                    lru.pop(n, None)
                stack.extend(n.children.values())
        self.cached_tokens[engine] = self.cached_tokens.get(engine, 0) - dropped
        for n in (node,):
            if n.parent is not None:
                self._maybe_prune(n)
        return dropped

    def lru_victims(self, engine: str, need_tokens: int, keep: Iterable[Node] = ()) -> list[Node]:
        """The nodes ``engine``'s LRU would drop to free ``need_tokens`` (least recently used first, never one of
        ``keep``); fewer if it holds too little. Read-only (Algorithm 2's T)."""
        out: list[Node] = []
        if need_tokens <= 0:
            return out
        keep_set = set(keep)
        freed = 0
        for node in self._lru.get(engine, ()):
            if node in keep_set:
                continue
            out.append(node)
            freed += len(node.key)
            if freed >= need_tokens:
                break
        return out

    def evict_lru(self, engine: str, capacity_tokens: int, keep: Iterable[Node] = ()) -> int:
        """Emulate ``engine``'s LRU: drop its least recently used nodes until it holds at most
        ``capacity_tokens``; returns the tokens dropped."""
        over = self.cached_tokens.get(engine, 0) - capacity_tokens
        dropped = 0
        for node in self.lru_victims(engine, over, keep):
            if engine in node.engines:
                dropped += self.evict(node, engine)
        return dropped

    def forget_engine(self, engine: str) -> None:
        """``engine`` is gone (dead or replaced): it holds nothing any more."""
        for node in list(self._lru.get(engine, ())):
            if engine in node.engines:
                self.evict(node, engine)
        self._lru.pop(engine, None)
        self.cached_tokens.pop(engine, None)

    # ---- eviction notices by block hash ----------------------------------------------------------------------------
    def register_blocks(self, path: Sequence[Node], hashes: Sequence[int], block_size: int,
                        from_block: int = 0) -> None:
        """Remember which node holds the last token of each full block ``i >= from_block`` of the prompt whose path
        is ``path`` (``hashes[i]`` = the engines' chain hash of block i), so a notice naming a block maps to a node."""
        if not path:
            return
        j = 0
        for i in range(from_block, len(hashes)):
            last = (i + 1) * block_size - 1
            while j < len(path) and path[j].end <= last:
                j += 1
            if j == len(path):
                break
            node = path[j]
            h = hashes[i]
            if h not in self._blocks:
                self._blocks[h] = (node, last)
                node.hashes.append(h)

    def node_of_block(self, chain_hash: int) -> Node | None:
        """The node holding the last token of the block (an ancestor of the one registered if that was split
        since); None if unknown or pruned."""
        hit = self._blocks.get(chain_hash)
        if hit is None:
            return None
        node, pos = hit
        while node is not None and node.start > pos:
            node = node.parent
        return node if node is not None and node.parent is not None else None

    # ---- introspection ----------------------------------------------------------------------------------------
    def nodes(self) -> Iterable[Node]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def dump(self, fmt: Callable[[Node], str] = repr) -> str:
        lines: list[str] = []

        def walk(n: Node, depth: int) -> None:
            for c in n.children.values():
                lines.append("  " * depth + fmt(c))
                walk(c, depth + 1)

        walk(self.root, 0)
        return "\n".join(lines)
