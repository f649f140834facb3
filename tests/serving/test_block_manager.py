"""KV block bookkeeping: pool allocation and LRU eviction, prefix caching, copy-on-write, slot
mapping, fragmentation, and a randomized engine-shaped run that checks ref counts and the data a
stand-in KV memory would hold at every step."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter, deque
from dataclasses import dataclass

import pytest

from serve.block_manager import BlockManager, BlockPool, NoFreeBlocksError, hash_block

# ---- BlockPool ---------------------------------------------------------------------------------


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4, block_size=2)
    assert pool.allocate(3) == [0, 1, 2]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert (pool.num_free(), pool.num_used()) == (1, 3)  # the failed call took nothing
    assert pool.allocate(0) == []
    assert pool.allocate(1) == [3]


def test_free_returns_blocks_and_rejects_a_double_free():
    pool = BlockPool(4, block_size=2)
    ids = pool.allocate(2)
    pool.free(ids)
    assert (pool.num_free(), pool.num_used()) == (4, 0)
    with pytest.raises(ValueError, match="block 0 released 1 time.*double free"):
        pool.free([0])
    assert (pool.num_free(), pool.num_used()) == (4, 0)


def test_free_rejects_more_releases_than_references():
    pool = BlockPool(2, block_size=2)
    (b,) = pool.allocate(1)
    pool.incref([b])  # ref_count 2
    with pytest.raises(ValueError, match=f"block {b} released 3"):
        pool.free([b, b, b])
    assert pool.blocks[b].ref_count == 2  # validated before anything changed
    pool.free([b, b])
    assert pool.num_free() == 2


def test_free_releases_in_reverse_order():
    pool = BlockPool(4, block_size=2, enable_prefix_caching=False)
    pool.free(pool.allocate(4))
    assert pool.allocate(4) == [3, 2, 1, 0]


def test_cached_blocks_are_evicted_least_recently_freed_first_tail_before_head():
    pool = BlockPool(6, block_size=2)
    a, b = pool.allocate(3), pool.allocate(3)  # two "sequences", [0 1 2] and [3 4 5]
    for i in a + b:
        assert pool.cache_full_block(i, 100 + i)
    pool.free(a)  # freed first: evicted first, its tail (2) before its head (0)
    pool.free(b)
    assert (pool.num_free(), pool.num_cached_evictable()) == (6, 6)
    assert pool.allocate(4) == [2, 1, 0, 5]
    assert [pool.lookup(100 + i) for i in range(6)] == [None, None, None, 3, 4, None]
    assert pool.num_cached() == 2
    assert pool.blocks[5].block_hash is None  # an evicted block forgets its hash


def test_never_cached_blocks_are_used_before_evicting():
    pool = BlockPool(3, block_size=2)
    (c,) = pool.allocate(1)
    pool.cache_full_block(c, 7)
    pool.free([c])
    assert pool.allocate(2) == [1, 2]
    assert pool.lookup(7) == c


def test_an_evictable_block_still_hits_and_a_hit_takes_it_off_the_evictable_set():
    pool = BlockPool(2, block_size=2)
    a, b = pool.allocate(2)
    pool.cache_full_block(a, 11)
    pool.cache_full_block(b, 22)
    pool.free([a, b])
    assert pool.lookup(11) == a
    pool.incref([a])
    assert (pool.num_cached_evictable(), pool.num_used(), pool.num_free()) == (1, 1, 1)
    assert pool.allocate(1) == [b]  # only b was evictable
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    assert pool.lookup(11) == a and pool.lookup(22) is None
    assert (pool.queries, pool.hits) == (3, 2)


def test_incref_of_a_free_uncached_block_is_an_error():
    pool = BlockPool(2, block_size=2)
    with pytest.raises(ValueError, match="block 1 is free"):
        pool.incref([1])
    with pytest.raises(ValueError, match="out of range"):
        pool.incref([-1])


def test_caching_the_same_prefix_twice_keeps_the_first_block():
    pool = BlockPool(2, block_size=2)
    a, b = pool.allocate(2)
    assert pool.cache_full_block(a, 5) and not pool.cache_full_block(b, 5)
    assert pool.lookup(5) == a
    pool.free([a, b])
    assert (pool.num_cached_evictable(), pool.num_cached()) == (1, 1)


@pytest.mark.parametrize("args", [(0, 4), (4, 0), (-1, 4)])
def test_sizes_must_be_positive(args):
    with pytest.raises(ValueError, match="must be >= 1"):
        BlockManager(*args)


def test_a_negative_allocation_is_an_error():
    with pytest.raises(ValueError, match="cannot allocate -1"):
        BlockPool(4, 4).allocate(-1)


# ---- hashing ------------------------------------------------------------------------------------


def test_hash_chain():
    h0 = hash_block(None, [1, 2, 3, 4])
    assert h0 == hash_block(None, (1, 2, 3, 4)) and 0 <= h0 < 2**64
    assert hash_block(h0, [5, 6]) == hash_block(h0, [5, 6])
    assert hash_block(h0, [5, 6]) != hash_block(None, [5, 6])
    assert hash_block(h0, [5, 6]) != hash_block(h0, [5, 6], extra="lora-1")
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    # A different first block changes every later hash.
    a, b = [hash_block(None, [1, 2])], [hash_block(None, [9, 2])]
    for block in ([3, 4], [5, 6], [7, 8]):
        a.append(hash_block(a[-1], block))
        b.append(hash_block(b[-1], block))
    assert all(x != y for x, y in zip(a, b))


def test_hash_is_the_same_in_another_process():
    code = ("from serve.block_manager import hash_block\n"
            "print(hash_block(hash_block(None, [1, 2]), [3], extra=('salt', 7)))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
            for seed in ("1", "2")}
    assert outs == {str(hash_block(hash_block(None, [1, 2]), [3], extra=("salt", 7)))}


# ---- BlockManager --------------------------------------------------------------------------------


def run_prompt(bm: BlockManager, seq_id, tokens: list[int]) -> int:
    """Admit, reserve and 'compute' a whole prompt as the engine would; return the cached count."""
    cached = bm.allocate_prompt(seq_id, tokens)
    assert bm.append_slots(seq_id, tokens, len(tokens) - cached) == []
    bm.commit(seq_id, tokens)
    return cached


def test_prompts_sharing_two_full_blocks_share_physical_blocks():
    bm = BlockManager(16, block_size=4)
    a = list(range(10))
    assert run_prompt(bm, "a", a) == 0
    b = a[:8] + [50, 51, 52]
    assert bm.allocate_prompt("b", b) == 8
    assert bm.block_table("b") == bm.block_table("a")[:2]
    assert [bm.pool.blocks[i].ref_count for i in bm.block_table("a")] == [2, 2, 1]
    assert bm.append_slots("b", b, 3) == []
    assert bm.block_table("b")[2] not in bm.block_table("a")
    s = bm.stats()
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (21, 8)
    assert s.hit_rate == pytest.approx(8 / 21)
    assert (bm.pool.queries, bm.pool.hits) == (3, 2)  # a: 1 miss; b: 2 hits


def test_a_different_first_block_shares_nothing():
    bm = BlockManager(16, block_size=4)
    a = list(range(12))
    run_prompt(bm, "a", a)
    assert bm.allocate_prompt("c", [99] + a[1:] + [7]) == 0
    assert bm.block_table("c") == []


def test_the_last_prompt_token_is_never_cached():
    bm = BlockManager(16, block_size=4)
    a = list(range(8))
    run_prompt(bm, "a", a)
    assert bm.allocate_prompt("same", a) == 4  # 8 would leave nothing to compute
    assert bm.allocate_prompt("longer", a + [8]) == 8
    assert bm.allocate_prompt("short", a[:4]) == 0


def test_evictable_prefix_survives_its_sequence():
    bm = BlockManager(8, block_size=4)
    a = list(range(9))
    run_prompt(bm, "a", a)
    table = bm.block_table("a")
    bm.free("a")
    assert bm.pool.num_cached_evictable() == 2 and bm.pool.num_used() == 0
    assert bm.allocate_prompt("b", a) == 8
    assert bm.block_table("b") == table[:2]
    assert bm.pool.num_cached_evictable() == 0


def test_prefix_caching_off_shares_nothing():
    bm = BlockManager(16, block_size=4, enable_prefix_caching=False)
    a = list(range(10))
    assert run_prompt(bm, "a", a) == 0
    assert bm.commit("a", a) == 0
    assert run_prompt(bm, "b", a) == 0
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    assert bm.pool.num_cached() == 0 and bm.stats().prefix_query_tokens == 0


def test_fork_then_append_copies_the_shared_partial_block():
    bm = BlockManager(8, block_size=4)
    tokens = list(range(6))
    run_prompt(bm, "p", tokens)
    p0, p1 = bm.block_table("p")
    bm.fork("p", "c")
    assert bm.block_table("c") == [p0, p1]
    assert [bm.pool.blocks[i].ref_count for i in (p0, p1)] == [2, 2]
    pairs = bm.append_slots("c", tokens + [40], 1)
    assert len(pairs) == 1
    (src, dst), = pairs
    assert src == p1 and dst not in (p0, p1)
    assert bm.block_table("p") == [p0, p1]  # the parent is untouched
    assert bm.block_table("c") == [p0, dst]
    assert [bm.pool.blocks[i].ref_count for i in (p0, p1, dst)] == [2, 1, 1]
    assert bm.append_slots("p", tokens + [41], 1) == []  # p1 is private again: write in place
    assert bm.num_tokens("p") == bm.num_tokens("c") == 7
    assert bm.pool.num_used() == 3


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(8, block_size=4)
    tokens = list(range(8))
    run_prompt(bm, "p", tokens)
    bm.fork("p", "c")
    assert bm.append_slots("c", tokens + [1], 1) == []
    assert bm.block_table("c")[:2] == bm.block_table("p")
    assert len(bm.block_table("c")) == 3


def test_append_slots_returns_none_and_changes_nothing_when_short():
    bm = BlockManager(3, block_size=4)
    tokens = list(range(6))
    run_prompt(bm, "p", tokens)
    bm.fork("p", "c")
    bm.allocate_prompt("x", [1])
    assert bm.append_slots("x", [1], 1) == []  # pool now full: p/c share 2 blocks, x has 1
    before = (bm.block_table("c"), bm.num_tokens("c"), bm.pool.num_used())
    assert bm.append_slots("c", tokens + [7], 1) is None  # COW needs a block
    assert (bm.block_table("c"), bm.num_tokens("c"), bm.pool.num_used()) == before
    bm.free("x")
    assert bm.append_slots("c", tokens + [7], 1) == [(bm.block_table("p")[1], 2)]


def test_commit_registers_only_newly_full_written_blocks():
    bm = BlockManager(8, block_size=4)
    tokens = list(range(3))
    bm.allocate_prompt("s", tokens)
    bm.append_slots("s", tokens, 3)
    assert bm.commit("s", tokens) == 0
    tokens.append(3)  # a sampled token, not yet in the cache: commit ignores it
    assert bm.commit("s", tokens) == 0
    bm.append_slots("s", tokens, 1)
    assert bm.commit("s", tokens) == 1
    assert bm.commit("s", tokens) == 0
    with pytest.raises(ValueError, match="3 token ids for 4 reserved"):
        bm.commit("s", tokens[:3])


def test_slot_mapping():
    bm = BlockManager(4, block_size=4, enable_prefix_caching=False)
    for name, n in [("a", 1), ("b", 4), ("c", 1), ("d", 1)]:  # tables [0] [1] [2] [3]
        bm.allocate_prompt(name, [0] * n)
        bm.append_slots(name, [0] * n, n)
    bm.free("a")
    bm.free("c")
    bm.append_slots("b", [0] * 9, 5)
    assert bm.block_table("b") == [1, 0, 2]
    assert bm.slot_mapping("b", 3, 9) == [7, 0, 1, 2, 3, 8]
    assert bm.slot_mapping("b", 4, 4) == []
    with pytest.raises(ValueError, match="outside the 9 reserved"):
        bm.slot_mapping("b", 0, 10)


def test_fragmentation_by_hand():
    # block_size 4: a = 5 tokens (2 blocks: 4 + 1), b = 4 tokens (1 block), c = fork of a.
    # Shared blocks count once: reserved 3 blocks = 12 slots, used 4 + 1 + 4 = 9 -> 3/12 unused.
    bm = BlockManager(8, block_size=4)
    run_prompt(bm, "a", list(range(5)))
    run_prompt(bm, "b", list(range(10, 14)))
    bm.fork("a", "c")
    s = bm.stats()
    assert (s.reserved_slots, s.used_slots) == (12, 9)
    assert bm.fragmentation() == pytest.approx(0.25)
    # c writes its 6th token: copy-on-write gives it its own second block (2 of 4 slots used).
    bm.append_slots("c", list(range(5)) + [9], 1)
    assert (bm.reserved_slots(), bm.used_slots()) == (16, 11)
    assert bm.fragmentation() == pytest.approx(5 / 16)
    assert bm.stats().usage == pytest.approx(4 / 8)
    for name in "abc":
        bm.free(name)
    assert bm.fragmentation() == 0.0


def test_errors_name_the_sequence():
    bm = BlockManager(4, block_size=4)
    with pytest.raises(KeyError, match="'ghost'"):
        bm.block_table("ghost")
    bm.allocate_prompt(7, [1, 2])
    with pytest.raises(ValueError, match="sequence 7 already"):
        bm.allocate_prompt(7, [1, 2])
    with pytest.raises(ValueError, match="sequence 7 already"):
        bm.fork(7, 7)
    with pytest.raises(ValueError, match="num_new_tokens=-1"):
        bm.append_slots(7, [1, 2], -1)
    with pytest.raises(ValueError, match="up to position 3 but only 2"):
        bm.append_slots(7, [1, 2], 3)
    with pytest.raises(ValueError, match="empty prompt"):
        bm.allocate_prompt(8, [])
    bm.free(7)
    with pytest.raises(KeyError, match="already freed"):
        bm.free(7)
    assert not bm.has(7) and bm.pool.num_free() == 4


# ---- randomized engine-shaped run -----------------------------------------------------------------


@dataclass
class Request:
    tokens: list[int]
    target: int  # finish once this many tokens exist


def check_invariants(bm: BlockManager, live: dict[int, Request]) -> None:
    pool, bs = bm.pool, bm.block_size
    holders = Counter(b for sid in live for b in bm.block_table(sid))
    assert sum(b.ref_count for b in pool.blocks) == sum(len(bm.block_table(s)) for s in live)
    assert {b.block_id: b.ref_count for b in pool.blocks if b.ref_count} == dict(holders)
    assert pool.num_used() == len(holders)
    assert pool.num_used() + pool.num_free() == pool.num_blocks
    for sid in live:
        assert len(bm.block_table(sid)) == -(-bm.num_tokens(sid) // bs)


def fake_kv(tokens: list[int]) -> list[int]:
    """What a model would cache per position: it depends on the token AND everything before it,
    so a block with the right tokens after the wrong prefix reads back wrong."""
    values, prev = [], 0
    for t in tokens:
        prev = hash((prev, t))  # ints only: deterministic
        values.append(prev)
    return values


def read_back(bm: BlockManager, memory: dict[int, int], sid: int) -> list[int]:
    return [memory.get(s, -1) for s in bm.slot_mapping(sid, 0, bm.num_tokens(sid))]


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-caching"])
def test_random_requests_leak_nothing_and_keep_every_sequence_data(caching):
    """1,000 requests share random prefixes, grow in random chunks, fork, abort, and get preempted
    (recompute) when the pool runs dry. `memory` stands in for the KV tensors (slot -> `fake_kv`).
    Every newly allocated block is filled with garbage, COW pairs are copied, new tokens written,
    and every live sequence must read back exactly its tokens through its slots at every step."""
    rng = random.Random(1234)
    bs, num_blocks, vocab = 4, 40, 30
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=caching)
    memory: dict[int, int] = {}
    bases = [[rng.randrange(vocab) for _ in range(40)] for _ in range(3)]
    words = [[rng.randrange(vocab) for _ in range(bs)] for _ in range(3)]  # blocks that recur
    waiting: deque[tuple[int, Request]] = deque()
    running: dict[int, Request] = {}  # insertion order = admission order
    ids, arrived = iter(range(10**9)), 0
    seen = Counter()

    for _ in range(200_000):
        if arrived == 1000 and not waiting and not running:
            break
        if arrived < 1000 and rng.random() < 0.5:
            if rng.random() < 0.5:
                prompt = rng.choice(bases)[: rng.randint(0, 40)]
            else:  # the same block at different positions: only the hash chain tells them apart
                prompt = [t for _ in range(rng.randint(0, 8)) for t in rng.choice(words)]
            prompt = prompt + [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
            waiting.append((next(ids), Request(prompt, len(prompt) + rng.randint(1, 12))))
            arrived += 1
        if waiting and rng.random() < 0.7:
            sid, req = waiting.popleft()
            cached = bm.allocate_prompt(sid, req.tokens)
            assert cached % bs == 0 and cached <= (len(req.tokens) - 1) // bs * bs
            assert read_back(bm, memory, sid) == fake_kv(req.tokens)[:cached]  # hits: right data
            seen["hit tokens"] += cached
            running[sid] = req
        if running and rng.random() < 0.02:
            sid = rng.choice(list(running))
            bm.free(sid)
            del running[sid]
            seen["aborts"] += 1
        if running and rng.random() < 0.05:
            parent = rng.choice(list(running))
            child = next(ids)
            bm.fork(parent, child)
            running[child] = Request(list(running[parent].tokens), running[parent].target)
            seen["forks"] += 1
        check_invariants(bm, running)

        for sid in list(running):  # one engine step, oldest first
            if sid not in running:
                continue  # preempted earlier in this step
            req, done = running[sid], bm.num_tokens(sid)
            n = min(rng.randint(1, 6), len(req.tokens) - done)
            before = set(bm.block_table(sid))
            while (pairs := bm.append_slots(sid, req.tokens, n)) is None:
                victim = next(reversed(running))  # youngest first, as vLLM preempts
                bm.free(victim)
                waiting.appendleft((victim, running.pop(victim)))  # recompute from scratch later
                seen["preemptions"] += 1
                if victim == sid:
                    break
            if sid not in running:
                continue
            for b in set(bm.block_table(sid)) - before:  # fresh blocks hold stale data
                memory.update({b * bs + o: -2 for o in range(bs)})
            for src, dst in pairs:
                assert bm.pool.blocks[src].ref_count >= 1 and bm.pool.blocks[dst].ref_count == 1
                memory.update({dst * bs + o: memory.get(src * bs + o, -1) for o in range(bs)})
                seen["copies"] += 1
            for slot, kv in zip(bm.slot_mapping(sid, done, done + n), fake_kv(req.tokens)[done:]):
                memory[slot] = kv
            bm.commit(sid, req.tokens)
            if bm.num_tokens(sid) == len(req.tokens):
                if len(req.tokens) >= req.target:
                    bm.free(sid)
                    del running[sid]
                    seen["finished"] += 1
                else:
                    req.tokens.append(rng.randrange(vocab))  # "sample" the next token
            check_invariants(bm, running)
        for sid, req in running.items():  # nobody's write clobbered anyone else's data
            assert read_back(bm, memory, sid) == fake_kv(req.tokens)[: bm.num_tokens(sid)]
    else:
        pytest.fail("the run did not finish")

    assert bm.pool.num_used() == 0 and bm.pool.num_free() == num_blocks
    assert all(b.ref_count == 0 for b in bm.pool.blocks)
    assert bm.pool.num_cached_evictable() == bm.pool.num_cached()  # only the cache remains
    assert bm.stats().reserved_slots == 0
    # The run exercised every path it claims to test.
    assert seen["finished"] > 500 and seen["aborts"] > 10 and seen["forks"] > 10
    assert seen["preemptions"] > 10 and seen["copies"] > 10
    assert (seen["hit tokens"] > 1000) == caching and (bm.pool.num_cached() > 0) == caching
