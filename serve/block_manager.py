"""KV block bookkeeping: a block pool with a prefix cache, and per-sequence block tables.

No tensors here: `serve/paged_cache.py` holds the data, this module decides which block ids each
sequence owns. A block holds `block_size` token positions; position p of a sequence lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

- Reference counts: forks (n > 1 sampling) and prefix-cache hits share blocks. A shared block is
  never written in place: the first write into it copies it first (copy-on-write, COW).
- Prefix caching: a FULL block is registered under `hash_block(parent hash, its token ids, extra)`,
  so its hash names the whole prefix up to the block's end. A block whose last holder lets go
  stays findable ("evictable") until the pool runs out of never-cached blocks; then the least
  recently freed one is evicted first.

Worked example (block_size 4). Prompt A = [0..9] is computed into blocks [a0 a1 a2], a2 holding
2 tokens. Committing A caches a0 under h0 = H(None, 0..3) and a1 under h1 = H(h0, 4..7); a2 is
partial, so it is not cached. Prompt B = [0..7, 50, 51] then finds h0 and h1: B's table starts
[a0 a1], both now with ref_count 2, and `allocate_prompt` reports 8 tokens already computed.

The engine's contract, per sequence:
1. `allocate_prompt(seq, prompt)` once on admission: shares the longest cached run of full prompt
   blocks and returns how many tokens are already computed (never the whole prompt, so the last
   prompt token is always run and yields logits). Nothing else is allocated yet.
2. `append_slots(seq, tokens, n)` before a forward: reserves positions [num_tokens, num_tokens + n)
   and advances `num_tokens`. It returns the COW pairs (src, dst) the caller must copy in the
   tensor cache BEFORE the forward writes, or None when the pool is short (nothing changed: preempt
   a sequence and retry).
3. The forward writes the new tokens' KV into their slots, which the paged cache computes from
   `block_table(seq)` (serve/paged_cache.py); `slot_mapping(seq, start, end)` is the same mapping
   position by position, for tests and inspection.
4. `commit(seq, tokens)` after the forward: registers every newly full block in the prefix cache.
   Registration waits for the data, so a prefix hit never points at a block not yet written.
5. `free(seq)` when the sequence finishes, aborts or is preempted.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

SeqId = int | str
# Extra hash keys (an adapter id, a cache salt, ...): ints, strings or tuples of them, whose
# repr() is stable across processes.
ExtraKey = int | str | tuple[int | str, ...] | None


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for; nothing was allocated."""


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the prefix cache


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra: ExtraKey = None) -> int:
    """A 64-bit hash of one block chained on its parent's: equal prefixes give equal hashes, and a
    change anywhere earlier changes every later hash. sha256 over a fixed byte encoding, so the
    value is the same in every process (unlike `hash()` of a str under hash randomization)."""
    h = hashlib.sha256()
    h.update(b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(8, "little"))
    h.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))  # length-prefixed
    if extra is not None:
        h.update(b"\x01" + repr(extra).encode())
    return int.from_bytes(h.digest()[:8], "little")


class BlockPool:
    """`num_blocks` blocks: reference counts, a free list, and the prefix cache.

    A block with ref_count 0 is either on the free list (never cached, or evicted) or evictable
    (still registered under its hash, in LRU order). `num_free()` counts both.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]  # read-only outside this class
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, no hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; first out first
        self._cached: dict[int, int] = {}  # block hash -> block id, held or evictable
        self._num_used = 0
        self.queries = 0  # prefix-cache lookups, in blocks
        self.hits = 0

    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def num_used(self) -> int:
        return self._num_used

    def num_cached_evictable(self) -> int:
        return len(self._evictable)

    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, held or evictable."""
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (ref_count 1): never-cached ones first, then evict the least recently
        freed cached ones. All or nothing: raises NoFreeBlocksError if fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free():
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free()} free")
        ids = []
        for _ in range(n):
            if self._free:
                block = self.blocks[self._free.popleft()]
            else:
                block = self.blocks[self._evictable.popitem(last=False)[0]]
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            ids.append(block.block_id)
        self._num_used += n
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block. `block_ids` in sequence order: they are released in
        reverse, so a sequence's tail blocks are evicted before its head (a later request is more
        likely to share the head)."""
        blocks = self._blocks(block_ids)
        for block_id, count in Counter(block_ids).items():
            if self.blocks[block_id].ref_count < count:
                raise ValueError(f"block {block_id} released {count} time(s) but has ref_count "
                                 f"{self.blocks[block_id].ref_count} (double free?)")
        for block in reversed(blocks):
            block.ref_count -= 1
            if block.ref_count == 0:
                self._num_used -= 1
                if block.block_hash is None:
                    self._free.append(block.block_id)
                else:
                    self._evictable[block.block_id] = None  # most recently freed: evicted last

    def incref(self, block_ids: Iterable[int]) -> None:
        """Share blocks (a fork, a prefix hit). An evictable block is taken back off the free side;
        a block on the free list holds stale data and cannot be shared."""
        blocks = self._blocks(block_ids)
        for block in blocks:
            if block.ref_count == 0 and block.block_id not in self._evictable:
                raise ValueError(f"block {block.block_id} is free and uncached: nothing to share")
        for block in blocks:
            if block.ref_count == 0:
                del self._evictable[block.block_id]
                self._num_used += 1
            block.ref_count += 1

    def cache_full_block(self, block_id: int, block_hash: int) -> bool:
        """Register a full, written block under `block_hash`. Returns whether `block_id` is now the
        cached block for that hash: False when caching is off, or when another block already holds
        the same prefix (two sequences computed it at once; the first copy stays canonical)."""
        if not self.enable_prefix_caching:
            return False
        (block,) = self._blocks([block_id])
        if block.ref_count == 0:
            raise ValueError(f"block {block_id} is free: only a held block can be cached")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block_id} is already cached under another hash")
            return True
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def lookup(self, block_hash: int) -> int | None:
        """The cached block for `block_hash` (held or evictable), or None. Does not take a
        reference: `incref` the result to keep it."""
        if not self.enable_prefix_caching:
            return None
        self.queries += 1
        block_id = self._cached.get(block_hash)
        if block_id is not None:
            self.hits += 1
        return block_id

    def _blocks(self, block_ids: Iterable[int]) -> list[Block]:
        blocks = []
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
            blocks.append(self.blocks[block_id])
        return blocks


@dataclass
class _SeqBlocks:
    table: list[int] = field(default_factory=list)  # len == ceil(num_tokens / block_size)
    num_tokens: int = 0  # positions reserved (written once the step's forward has run)
    hashes: list[int] = field(default_factory=list)  # hash chain of the committed full blocks
    extra: ExtraKey = None


def hit_rate(hits: int, queries: int) -> float:
    return hits / queries if queries else 0.0


@dataclass(frozen=True)
class BlockStats:
    num_blocks: int
    used_blocks: int  # ref_count > 0
    free_blocks: int  # includes cached_evictable
    cached_evictable: int
    prefix_query_tokens: int  # prompt tokens looked up (vLLM's prefix-cache "queries")
    prefix_hit_tokens: int  # of those, found computed
    reserved_slots: int  # distinct blocks held by live sequences x block_size
    used_slots: int  # token positions stored in those blocks

    @property
    def usage(self) -> float:
        return self.used_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return hit_rate(self.prefix_hit_tokens, self.prefix_query_tokens)

    @property
    def fragmentation(self) -> float:
        """Unused share of reserved KV memory."""
        return 1 - self.used_slots / self.reserved_slots if self.reserved_slots else 0.0


class BlockManager:
    """Per-sequence block tables over a `BlockPool`; see the module docstring for the contract."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self._seqs: dict[SeqId, _SeqBlocks] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- queries ---------------------------------------------------------------------------

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / looked up, from counters (no walk)."""
        return hit_rate(self.prefix_hit_tokens, self.prefix_query_tokens)

    def has(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: SeqId) -> list[int]:
        return list(self._seq(seq_id).table)

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_tokens

    def slot_mapping(self, seq_id: SeqId, start: int, end: int) -> list[int]:
        """Physical slots of positions [start, end), all within the reserved `num_tokens`."""
        seq, bs = self._seq(seq_id), self.block_size
        if not 0 <= start <= end <= seq.num_tokens:
            raise ValueError(f"sequence {seq_id!r}: positions [{start}, {end}) outside the "
                             f"{seq.num_tokens} reserved")
        return [seq.table[p // bs] * bs + p % bs for p in range(start, end)]

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free()

    def num_used(self) -> int:
        return self.pool.num_used()

    def num_free(self) -> int:
        """Free blocks, evictable cached ones included."""
        return self.pool.num_free()

    # ---- lifecycle -------------------------------------------------------------------------

    def allocate_prompt(self, seq_id: SeqId, token_ids: Sequence[int], extra: ExtraKey = None,
                        lookup: bool = True) -> int:
        """Start a sequence: share the longest cached run of leading full prompt blocks; return
        the number of tokens already computed, at most ((len - 1) // block_size) * block_size.
        `lookup=False` shares nothing (the whole prompt is computed; its blocks still enter
        the cache for others)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        if not token_ids:
            raise ValueError(f"sequence {seq_id!r}: empty prompt")
        seq, bs = _SeqBlocks(extra=extra), self.block_size
        if self.pool.enable_prefix_caching and lookup:
            parent = None
            for i in range((len(token_ids) - 1) // bs):  # the last token is always computed
                block_hash = hash_block(parent, token_ids[i * bs : (i + 1) * bs], extra)
                block_id = self.pool.lookup(block_hash)
                if block_id is None:
                    break
                seq.table.append(block_id)
                seq.hashes.append(block_hash)
                parent = block_hash
            self.pool.incref(seq.table)
            seq.num_tokens = len(seq.table) * bs
            self.prefix_query_tokens += len(token_ids)
            self.prefix_hit_tokens += seq.num_tokens
        self._seqs[seq_id] = seq
        return seq.num_tokens

    def append_slots(
        self, seq_id: SeqId, token_ids: Sequence[int], num_new_tokens: int
    ) -> list[tuple[int, int]] | None:
        """Reserve `num_new_tokens` more positions; `token_ids` (the sequence's known tokens) must
        cover them. Returns COW pairs (src, dst): the caller copies block src into dst before the
        forward writes. Returns None, changing nothing, if the pool cannot supply the blocks."""
        seq, bs = self._seq(seq_id), self.block_size
        if num_new_tokens < 0:
            raise ValueError(f"sequence {seq_id!r}: num_new_tokens={num_new_tokens} < 0")
        end = seq.num_tokens + num_new_tokens
        if end > len(token_ids):
            raise ValueError(f"sequence {seq_id!r}: reserving up to position {end} but only "
                             f"{len(token_ids)} token ids are known")
        if num_new_tokens == 0:
            return []
        # Existing blocks this write touches (at most the partial last one) that others share.
        touched = range(seq.num_tokens // bs, len(seq.table))
        shared = [i for i in touched if self.pool.blocks[seq.table[i]].ref_count > 1]
        num_new_blocks = -(-end // bs) - len(seq.table)
        try:
            new = self.pool.allocate(len(shared) + num_new_blocks)
        except NoFreeBlocksError:
            return None
        pairs = []
        for i, dst in zip(shared, new):
            pairs.append((seq.table[i], dst))
            self.pool.free([seq.table[i]])  # still held by the others
            seq.table[i] = dst
        seq.table += new[len(shared) :]
        seq.num_tokens = end
        return pairs

    def commit(self, seq_id: SeqId, token_ids: Sequence[int]) -> int:
        """After the forward wrote the reserved positions: register every newly full block in the
        prefix cache. `token_ids` must cover `num_tokens` (extra ones, such as a just-sampled
        token not yet in the cache, are ignored). Returns how many blocks were newly hashed."""
        seq, bs = self._seq(seq_id), self.block_size
        if len(token_ids) < seq.num_tokens:
            raise ValueError(f"sequence {seq_id!r}: {len(token_ids)} token ids for "
                             f"{seq.num_tokens} reserved positions")
        if not self.pool.enable_prefix_caching:
            return 0
        before = len(seq.hashes)
        for i in range(before, seq.num_tokens // bs):
            parent = seq.hashes[-1] if seq.hashes else None
            block_hash = hash_block(parent, token_ids[i * bs : (i + 1) * bs], seq.extra)
            self.pool.cache_full_block(seq.table[i], block_hash)
            seq.hashes.append(block_hash)
        return len(seq.hashes) - before

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """The child shares every block of the parent (n > 1 sampling); the first write into the
        shared partial last block, by either, copies it."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        self.pool.incref(parent.table)
        self._seqs[child_id] = _SeqBlocks(list(parent.table), parent.num_tokens,
                                          list(parent.hashes), parent.extra)

    def free(self, seq_id: SeqId) -> None:
        """Release the sequence's blocks (tail first, see `BlockPool.free`)."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"unknown sequence {seq_id!r} (never allocated, or already freed)")
        self.pool.free(seq.table)

    # ---- statistics ------------------------------------------------------------------------

    def _block_fill(self) -> dict[int, int]:
        """Tokens stored in each block held by a live sequence; a shared block counts once."""
        fill: dict[int, int] = {}
        for seq in self._seqs.values():
            for i, block_id in enumerate(seq.table):
                n = min(self.block_size, seq.num_tokens - i * self.block_size)
                fill[block_id] = max(fill.get(block_id, 0), n)
        return fill

    def slot_counts(self) -> tuple[int, int]:
        """(reserved, used) token slots of the distinct blocks live sequences hold, in one pass
        over the sequences (the engine adds both up every step)."""
        fill = self._block_fill()
        return len(fill) * self.block_size, sum(fill.values())

    def reserved_slots(self) -> int:
        return self.slot_counts()[0]

    def used_slots(self) -> int:
        return self.slot_counts()[1]

    def fragmentation(self) -> float:
        """Unused / reserved slots over the distinct blocks live sequences hold (0 when none)."""
        return self.stats().fragmentation

    def stats(self) -> BlockStats:
        reserved, used = self.slot_counts()
        return BlockStats(
            num_blocks=self.pool.num_blocks,
            used_blocks=self.pool.num_used(),
            free_blocks=self.pool.num_free(),
            cached_evictable=self.pool.num_cached_evictable(),
            prefix_query_tokens=self.prefix_query_tokens,
            prefix_hit_tokens=self.prefix_hit_tokens,
            reserved_slots=reserved,
            used_slots=used,
        )

    def _seq(self, seq_id: SeqId) -> _SeqBlocks:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id!r} (never allocated, or already freed)") from None
