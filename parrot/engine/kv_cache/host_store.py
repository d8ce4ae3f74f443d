"""HostStore: accounting of the host-side swap space (KV blocks copied out of the pool while a tool runs). No torch.

The K/V data lives in the runner's host tensors (one slot = one pool block's K/V for every layer); this module
only decides which slot holds which block, by the block's chain hash (the prefix-cache key, so equal hashes mean
equal token prefixes and a swapped block serves any context with that prefix)::

    swap out:  pool block b (full, computed, hash h) --copy--> host slot s      (store: h -> s)
    swap in:   host slot s --copy--> a fresh pool block b'                      (b' is then registered under h)

Slots are kept as a cache after a swap-in (the copy stays valid) and evicted least recently used first when a
new block needs room. A slot named by a copy planned for the next iteration (the target of a swap-out, the source
of a swap-in) is *locked* until the iteration ran (:meth:`unlock_all`): no other block takes it before its copy
ran, and a context's swap-out never evicts its own earlier blocks (a store holding a prefix's tail without its
head serves nothing: matches run from the first block).
"""

from __future__ import annotations

from collections import OrderedDict


class HostStore:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots!r}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # chain hash -> slot, least recently used first
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._locked: set[int] = set()
        self.num_stored = 0  # blocks ever copied in (a metric)
        self.num_evicted = 0
        self.num_hits = 0  # blocks served back to the pool

    # ---- queries -----------------------------------------------------------------------------------------
    @property
    def num_used(self) -> int:
        return len(self._slot_of)

    @property
    def num_available(self) -> int:
        """Slots a new block could get now (free, or held by an unlocked cached block)."""
        return len(self._free) + sum(1 for s in self._slot_of.values() if s not in self._locked)

    def __contains__(self, chain_hash: int) -> bool:
        return chain_hash in self._slot_of

    def slot(self, chain_hash: int) -> int | None:
        return self._slot_of.get(chain_hash)

    # ---- mutations ---------------------------------------------------------------------------------------
    def put(self, chain_hash: int) -> tuple[int, bool] | None:
        """A slot for the block of ``chain_hash``, locked until :meth:`unlock_all`: (slot, True) if the caller must
        copy the block into it, (slot, False) if the store already holds it (touched as recently used); None if
        every slot is locked."""
        slot = self._slot_of.get(chain_hash)
        if slot is not None:
            self._slot_of.move_to_end(chain_hash)
            self._locked.add(slot)
            return slot, False
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slot_of.items() if s not in self._locked), None)
            if victim is None:
                return None
            slot = self._slot_of.pop(victim)
            self.num_evicted += 1
        self._slot_of[chain_hash] = slot
        self._locked.add(slot)
        self.num_stored += 1
        return slot, True

    def take(self, chain_hash: int) -> int | None:
        """The slot holding ``chain_hash`` for a swap-in, locked until :meth:`unlock_all`; None if absent."""
        slot = self._slot_of.get(chain_hash)
        if slot is None:
            return None
        self._slot_of.move_to_end(chain_hash)
        self._locked.add(slot)
        self.num_hits += 1
        return slot

    def unlock_all(self) -> None:
        """The iteration that copied the locked slots ran: they may be reused."""
        self._locked.clear()
