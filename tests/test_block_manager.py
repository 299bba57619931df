"""Tests for the host-side page allocator: exact prefix-cache counts, COW, LRU, invariants."""

import copy

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from llmserve.block_manager import DUMMY_PAGE, BlockManager, BlockStats, NoFreePages

L = 4  # page size used by the hand-written tests
TOKENS = st.integers(0, 1)  # a tiny vocabulary: equal pages (hits, clashes) are common


def snapshot(bm):
    """Everything the manager holds, to prove a failed call changed nothing."""
    return copy.deepcopy(vars(bm))


def allocate_committed(bm, seq_id, tokens):
    """Allocate and pretend the device computed the whole prompt."""
    cached = bm.allocate(seq_id, tokens)
    bm.commit(seq_id, tokens, len(tokens))
    return cached


# ---------------------------------------------------------------- basics


def test_page_zero_never_handed_out():
    bm = BlockManager(num_pages=9, page_size=L)
    assert bm.num_free_pages == 8
    pages = []
    for i in range(8):
        bm.allocate(i, [i] * 3)
        pages += bm.block_table(i)
    assert sorted(pages) == list(range(1, 9))
    assert not bm.can_allocate([0])
    with pytest.raises(NoFreePages):
        bm.allocate(99, [0])
    bm.check_invariants()
    for i in range(8):
        bm.free(i)
    assert bm.all_free() and bm.num_free_pages == 8
    bm.check_invariants()


def test_num_pages_for():
    bm = BlockManager(num_pages=4, page_size=L)
    assert [bm.num_pages_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


# ---------------------------------------------------------------- prefix cache: exact counts


def test_shared_prompt_of_three_and_a_half_pages_hits_three():
    bm = BlockManager(num_pages=32, page_size=L)
    system = list(range(100, 114))  # 14 tokens = 3.5 pages
    assert allocate_committed(bm, "a", system) == 0
    assert bm.stats == BlockStats(prefix_hits=0, prefix_misses=3)
    assert bm.allocate("b", system + [1, 2, 3]) == 12  # 17 tokens: 4 full pages, 3 hit
    assert bm.stats == BlockStats(prefix_hits=3, prefix_misses=3 + 1)
    assert bm.block_table("b")[:3] == bm.block_table("a")[:3]
    assert bm.block_table("b")[3] != bm.block_table("a")[3]  # a's half page was never hashed
    assert bm.allocate("c", system) == 12  # the identical prompt: same 3 pages
    assert bm.stats.prefix_hits == 6
    bm.check_invariants()


def test_shared_prompt_of_exactly_four_pages_hits_three_not_four():
    bm = BlockManager(num_pages=32, page_size=L)
    prompt = list(range(16))
    allocate_committed(bm, "a", prompt)
    assert bm.stats == BlockStats(prefix_hits=0, prefix_misses=4)
    # The page holding the last prompt token must be computed, so logits exist.
    assert bm.allocate("b", prompt) == 12
    assert bm.stats == BlockStats(prefix_hits=3, prefix_misses=4 + 1)
    assert bm.block_table("b")[:3] == bm.block_table("a")[:3]
    assert bm.block_table("b")[3] != bm.block_table("a")[3]
    # One token more and the fourth page is reusable too.
    assert bm.allocate("c", prompt + [7]) == 16
    assert bm.block_table("c")[:4] == bm.block_table("a")
    bm.check_invariants()


def test_only_consecutive_prefix_hits_count():
    bm = BlockManager(num_pages=32, page_size=L)
    a = list(range(12))
    allocate_committed(bm, "a", a + [99])
    b = [50, 51, 52, 53] + a[4:] + [99]  # page 0 differs, pages 1-2 equal as tokens
    assert bm.allocate("b", b) == 0  # chained hash: page 1's key includes page 0
    assert bm.stats.prefix_hits == 0


def test_hits_only_after_commit():
    bm = BlockManager(num_pages=32, page_size=L)
    prompt = list(range(13))
    bm.allocate("a", prompt)
    assert bm.allocate("b", prompt) == 0  # a's KV not written yet: nothing to reuse
    bm.commit("a", prompt, 8)  # device has written 2 pages
    assert bm.allocate("c", prompt) == 8
    bm.commit("a", prompt, 13)
    assert bm.allocate("d", prompt) == 12
    assert bm.stats.prefix_hits == 2 + 3
    bm.check_invariants()


def test_commit_of_decoded_tokens_is_reusable():
    bm = BlockManager(num_pages=32, page_size=L)
    tokens = list(range(6))
    bm.allocate("a", tokens)
    bm.commit("a", tokens, 6)
    for t in (6, 7, 8):  # decode: one slot, then its KV is written
        bm.append("a")
        tokens.append(t)
        bm.commit("a", tokens, len(tokens))
    assert bm.allocate("b", tokens + [0]) == 8


def test_duplicate_content_is_registered_once():
    bm = BlockManager(num_pages=32, page_size=L)
    prompt = list(range(9))
    bm.allocate("a", prompt)
    bm.allocate("b", prompt)  # computed twice concurrently
    bm.commit("a", prompt, 9)
    bm.commit("b", prompt, 9)
    assert bm.allocate("c", prompt) == 8
    assert bm.block_table("c")[:2] == bm.block_table("a")[:2]
    bm.free("a")
    bm.free("b")  # b's duplicate pages are unhashed: straight to the free list
    bm.check_invariants()
    bm.free("c")
    assert bm.all_free()
    bm.check_invariants()


def test_prefix_caching_disabled_never_hits_or_counts():
    bm = BlockManager(num_pages=32, page_size=L, enable_prefix_caching=False)
    prompt = list(range(17))
    allocate_committed(bm, "a", prompt)
    assert allocate_committed(bm, "b", prompt) == 0
    assert bm.stats == BlockStats()
    bm.free("a")
    bm.free("b")
    assert bm.all_free()
    bm.check_invariants()


# ---------------------------------------------------------------- fork and copy-on-write


def test_cow_after_fork_one_copy_per_diverging_child():
    bm = BlockManager(num_pages=32, page_size=L)
    bm.allocate("p", list(range(6)))  # pages [x, y]; y holds 2 of 4 tokens
    x, y = bm.block_table("p")
    bm.fork("p", "c1")
    bm.fork("p", "c2")
    assert bm.block_table("c1") == bm.block_table("c2") == [x, y]
    free_before = bm.num_free_pages

    (src, dst1), = bm.append("c1")
    assert src == y and dst1 not in (x, y) and bm.block_table("c1") == [x, dst1]
    (src, dst2), = bm.append("c2")
    assert src == y and dst2 not in (x, y, dst1) and bm.block_table("c2") == [x, dst2]
    assert bm.append("p") == []  # the last holder of y writes in place
    assert bm.block_table("p") == [x, y]
    assert bm.stats.cow_copies == 2
    assert bm.num_free_pages == free_before - 2
    assert bm.append("c1") == []  # c1 owns dst1 now
    bm.check_invariants()
    for s in ("p", "c1", "c2"):
        bm.free(s)
    assert bm.all_free()


def test_fork_at_page_boundary_needs_no_copy():
    bm = BlockManager(num_pages=32, page_size=L)
    bm.allocate("p", list(range(8)))
    bm.fork("p", "c")
    assert bm.append("c", 3) == [] and bm.append("p") == []
    assert bm.block_table("c")[:2] == bm.block_table("p")[:2]
    assert bm.block_table("c")[2] != bm.block_table("p")[2]
    assert bm.stats.cow_copies == 0
    bm.check_invariants()


def test_cow_with_speculative_append_crossing_a_page():
    bm = BlockManager(num_pages=32, page_size=L)
    bm.allocate("p", list(range(7)))
    bm.fork("p", "c")
    copies = bm.append("c", 5)  # K+1 = 5 slots: 7..11, copy of page 1, plus page 2
    assert copies == [(bm.block_table("p")[1], bm.block_table("c")[1])]
    assert len(bm.block_table("c")) == 3 and bm.num_tokens("c") == 12
    bm.check_invariants()


# ---------------------------------------------------------------- truncate


def test_truncate_releases_pages_wholly_beyond():
    bm = BlockManager(num_pages=32, page_size=L)
    bm.allocate("a", list(range(10)))  # 3 pages
    free0 = bm.num_free_pages
    bm.append("a", 5)  # 15 tokens, 4 pages
    assert bm.num_free_pages == free0 - 1
    bm.truncate("a", 9)  # 3 pages
    assert bm.num_tokens("a") == 9 and len(bm.block_table("a")) == 3
    assert bm.num_free_pages == free0
    bm.truncate("a", 8)  # 2 pages
    assert len(bm.block_table("a")) == 2 and bm.num_free_pages == free0 + 1
    with pytest.raises(ValueError):
        bm.truncate("a", 9)
    bm.check_invariants()


def test_truncate_into_cached_page_then_overwrite_drops_its_hash():
    bm = BlockManager(num_pages=32, page_size=L)
    prompt = list(range(9))
    allocate_committed(bm, "a", prompt)
    page = bm.block_table("a")[1]
    bm.truncate("a", 6)  # rollback into the hashed page 1
    assert bm.allocate("b", prompt) == 8  # not yet overwritten: still a valid hit
    assert bm.append("a") == [(page, bm.block_table("a")[1])]  # shared -> copy
    bm.free("b")
    bm.truncate("a", 5)
    bm.commit("a", prompt, 5)
    bm.free("a")
    bm.allocate("c", prompt)
    tbl = bm.block_table("c")
    bm.truncate("c", 6)  # c is now the sole holder of the cached page
    assert bm.append("c") == []  # written in place: the page must stop being a cache entry
    assert bm.allocate("d", prompt) == 4
    assert bm.block_table("d")[0] == tbl[0]
    bm.check_invariants()


# ---------------------------------------------------------------- eviction


def test_lru_eviction_order_tail_first_oldest_first():
    bm = BlockManager(num_pages=5, page_size=L)  # 4 usable pages
    a, b = list(range(8)), list(range(100, 108))
    allocate_committed(bm, "a", a)
    allocate_committed(bm, "b", b)
    ta, tb = bm.block_table("a"), bm.block_table("b")
    bm.free("a")
    bm.free("b")
    assert bm.num_free_pages == 4 and bm.all_free()
    evicted = []
    for i in range(3):
        bm.allocate(f"x{i}", [200 + i])
        evicted += bm.block_table(f"x{i}")
    assert evicted == [ta[1], ta[0], tb[1]]
    assert bm.stats.evictions == 3
    bm.free("x0")
    bm.free("x1")
    assert bm.allocate("b2", b + [1]) == 4  # b's head is still cached; its tail was evicted
    assert bm.block_table("b2")[0] == tb[0]
    bm.free("b2")
    bm.free("x2")
    assert bm.allocate("a2", a + [1]) == 0  # all of a was evicted
    bm.check_invariants()


def test_hit_revives_cached_page_and_is_not_evicted_for_the_same_request():
    bm = BlockManager(num_pages=3, page_size=L)  # 2 usable pages
    prompt = list(range(8))
    allocate_committed(bm, "a", prompt)
    ta = bm.block_table("a")
    bm.free("a")  # both pages cached-free
    assert bm.can_allocate(prompt)
    assert bm.allocate("b", prompt) == 4  # page 0 revived, page 1 evicted and rewritten
    assert bm.block_table("b") == [ta[0], ta[1]]
    assert bm.stats.evictions == 1 and bm.stats.prefix_hits == 1
    bm.check_invariants()
    bm.free("b")
    assert bm.all_free()
    bm.check_invariants()


def test_revived_page_is_not_double_listed():
    bm = BlockManager(num_pages=5, page_size=L)
    prompt = list(range(5))
    allocate_committed(bm, "a", prompt)
    head = bm.block_table("a")[0]
    bm.free("a")
    bm.allocate("b", prompt)  # revive head
    bm.allocate("c", [1])
    bm.allocate("d", [2])  # exhausts: must not hand out the revived head
    assert head not in bm.block_table("c") + bm.block_table("d")
    assert bm.num_free_pages == 0
    bm.check_invariants()


# ---------------------------------------------------------------- failure leaves state unchanged


def test_no_free_pages_leaves_state_unchanged():
    bm = BlockManager(num_pages=5, page_size=L)
    allocate_committed(bm, "a", list(range(6)))  # 2 pages, one hashed
    bm.fork("a", "b")
    bm.allocate("c", [7, 7, 7, 7, 7])  # 2 pages: 0 left
    before = snapshot(bm)
    for call in (
        lambda: bm.allocate("d", [1]),
        lambda: bm.append("a"),  # needs a COW copy
        lambda: bm.append("c", 4),  # crosses into a new page
    ):
        with pytest.raises(NoFreePages):
            call()
        assert snapshot(bm) == before
    assert not bm.can_append("a") and not bm.can_append("c", 4)
    assert bm.can_append("c", 3) and bm.append("c", 3) == []
    bm.check_invariants()


def test_too_long_prompt_raises():
    bm = BlockManager(num_pages=3, page_size=L)
    before = snapshot(bm)
    with pytest.raises(NoFreePages):
        bm.allocate("a", list(range(9)))
    assert snapshot(bm) == before


# ---------------------------------------------------------------- random op sequences


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/append/commit/truncate/fork/free against a simulated device.

    ``kv[page][slot]`` is the token whose KV the simulated device last wrote there. After every
    step, each sequence's computed positions must read back its own tokens: that catches a page
    shared without COW, a prefix hit on stale or unwritten KV, and a page handed out twice.
    """

    @initialize(num_pages=st.integers(2, 16), page_size=st.sampled_from([1, 2, 4]),
                caching=st.sampled_from([True, True, True, False]))
    def setup(self, num_pages, page_size, caching):
        self.bm = BlockManager(num_pages, page_size, enable_prefix_caching=caching)
        self.L = page_size
        self.kv = {p: [None] * page_size for p in range(num_pages)}
        self.tokens = {}  # seq -> its token list (length == reserved slots)
        self.computed = {}  # seq -> positions whose KV is written
        self.next_id = 0
        self.prompts = set()  # token lists seen, to re-send

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def _pick(self, data):
        """A live sequence, or None. (Not a precondition: those make hypothesis discard runs.)"""
        return data.draw(st.sampled_from(sorted(self.tokens))) if self.tokens else None

    def _append(self, seq, new_tokens):
        """bm.append plus the device's COW copies; False (state unchanged) if out of pages."""
        n = len(new_tokens)
        if not self.bm.can_append(seq, n):
            before = snapshot(self.bm)
            with pytest.raises(NoFreePages):
                self.bm.append(seq, n)
            assert snapshot(self.bm) == before
            return False
        old_table = self.bm.block_table(seq)
        copies = self.bm.append(seq, n)
        assert len(copies) <= 1
        for src, dst in copies:
            i = self.bm.block_table(seq).index(dst)
            assert old_table[i] == src and src != dst
            self.kv[dst] = list(self.kv[src])  # the device copy
        self.tokens[seq] += new_tokens
        return True

    def _compute(self, seq, stop):
        """The device writes KV up to ``stop``; then the host commits it."""
        table = self.bm.block_table(seq)
        for pos in range(self.computed[seq], stop):
            page = table[pos // self.L]
            assert page != DUMMY_PAGE
            self.kv[page][pos % self.L] = self.tokens[seq][pos]
        self.computed[seq] = max(self.computed[seq], stop)
        self.bm.commit(seq, self.tokens[seq], stop)
        self.prompts.add(tuple(self.tokens[seq]))

    def _truncate(self, seq, n):
        free = self.bm.num_free_pages
        released = len(self.bm.block_table(seq)) - self.bm.num_pages_for(n)
        self.bm.truncate(seq, n)
        del self.tokens[seq][n:]
        self.computed[seq] = min(self.computed[seq], n)
        assert 0 <= self.bm.num_free_pages - free <= released

    @rule(data=st.data())
    def allocate(self, data):
        # Often re-send (a prefix or extension of) an earlier sequence, so prefix hits are common.
        seen = sorted(self.prompts)
        resend = seen and data.draw(st.sampled_from([True, True, True, False]))
        base = list(data.draw(st.sampled_from(seen))) if resend else []
        base = base[:data.draw(st.integers(0, len(base)))] if data.draw(st.booleans()) else base
        tokens = base + data.draw(st.lists(TOKENS, max_size=6))
        self.prompts.add(tuple(tokens))
        seq = self._new_id()
        if not self.bm.can_allocate(tokens):
            before = snapshot(self.bm)
            with pytest.raises(NoFreePages):
                self.bm.allocate(seq, tokens)
            assert snapshot(self.bm) == before
            return
        hits = self.bm.stats.prefix_hits
        cached = self.bm.allocate(seq, tokens)
        self.tokens[seq], self.computed[seq] = list(tokens), cached
        assert cached % self.L == 0 and 0 <= cached <= max(len(tokens) - 1, 0)
        assert self.bm.stats.prefix_hits - hits == cached // self.L
        if data.draw(st.booleans()):  # prefill now
            self._compute(seq, len(tokens))

    @rule(data=st.data(), n=st.integers(0, 5))
    def append(self, data, n):
        seq = self._pick(data)
        if seq is not None:
            self._append(seq, data.draw(st.lists(TOKENS, min_size=n, max_size=n)))

    @rule(data=st.data())
    def compute_and_commit(self, data):
        seq = self._pick(data)
        if seq is None:
            return
        self._compute(seq, data.draw(st.integers(self.computed[seq], len(self.tokens[seq]))))

    @rule(data=st.data())
    def truncate(self, data):
        seq = self._pick(data)
        if seq is None:
            return
        self._truncate(seq, data.draw(st.integers(0, len(self.tokens[seq]))))

    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data)
        if parent is None:
            return
        child = self._new_id()
        self.bm.fork(parent, child)
        assert self.bm.block_table(child) == self.bm.block_table(parent)
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]

    @rule(data=st.data())
    def sample_n(self, data):
        """n > 1 sampling: fork a computed sequence; each branch decodes a different token."""
        parent = self._pick(data)
        if parent is None:
            return
        self._compute(parent, len(self.tokens[parent]))
        child = self._new_id()
        self.bm.fork(parent, child)
        self.tokens[child], self.computed[child] = list(self.tokens[parent]), self.computed[parent]
        for seq, token in ((child, 1), (parent, 0)):
            if self._append(seq, [token]):
                self._compute(seq, len(self.tokens[seq]))

    @rule(data=st.data(), k=st.integers(1, 4))
    def speculate(self, data, k):
        """Verify k drafts (KV written for all k+1), roll back the rejected, decode the fix."""
        seq = self._pick(data)
        if seq is None:
            return
        start = len(self.tokens[seq])
        self._compute(seq, start)
        drafts = data.draw(st.lists(TOKENS, min_size=k + 1, max_size=k + 1))
        if not self._append(seq, drafts):
            return
        self._compute(seq, start + k + 1)
        accepted = data.draw(st.integers(0, k))
        self._truncate(seq, start + accepted)
        if self._append(seq, [1 - drafts[accepted]]):  # differs from the rejected draft's KV
            self._compute(seq, start + accepted + 1)

    @rule(data=st.data())
    def free(self, data):
        seq = self._pick(data)
        if seq is None:
            return
        if data.draw(st.booleans()):  # finished: its KV is all written
            self._compute(seq, len(self.tokens[seq]))
        self.bm.free(seq)
        del self.tokens[seq], self.computed[seq]

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        for seq, tokens in self.tokens.items():
            assert self.bm.num_tokens(seq) == len(tokens)
            table = self.bm.block_table(seq)
            view = [self.kv[table[p // self.L]][p % self.L] for p in range(self.computed[seq])]
            assert view == tokens[:self.computed[seq]], f"seq {seq} reads foreign KV"
        if not self.bm.enable_prefix_caching:
            assert self.bm.stats == BlockStats(cow_copies=self.bm.stats.cow_copies)

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.tokens):
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.all_free()
        assert self.bm.num_free_pages == self.bm.num_pages - 1


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


# ---------------------------------------------------------------- contiguous reservation


def test_contiguous_reserves_max_len_at_admission_and_never_grows():
    bm = BlockManager(num_pages=9, page_size=L, reservation="contiguous", max_model_len=10)
    assert bm.allocate("a", [1, 2]) == 0
    assert len(bm.block_table("a")) == 3  # ceil(10 / 4), not ceil(2 / 4)
    free = bm.num_free_pages
    for _ in range(8):  # up to max_model_len: no page taken, no copy
        assert bm.append("a") == []
    assert bm.num_free_pages == free and bm.num_tokens("a") == 10
    bm.truncate("a", 3)  # a rollback keeps the reservation
    assert len(bm.block_table("a")) == 3
    bm.check_invariants()
    bm.free("a")
    assert bm.all_free()


def test_contiguous_fits_fewer_sequences_than_paged():
    def admitted(reservation):
        bm = BlockManager(num_pages=17, page_size=L, reservation=reservation, max_model_len=32)
        n = 0
        while bm.can_allocate([5] * 6):
            bm.allocate(n, [5] * 6)
            n += 1
        bm.check_invariants()
        return n

    assert admitted("paged") == 8  # 2 pages each
    assert admitted("contiguous") == 2  # 8 pages each


def test_contiguous_fork_shares_written_pages_and_reserves_the_rest():
    bm = BlockManager(num_pages=12, page_size=L, reservation="contiguous", max_model_len=16)
    allocate_committed(bm, "p", list(range(6)))  # 4 reserved pages, 2 written
    bm.fork("p", "c")
    parent, child = bm.block_table("p"), bm.block_table("c")
    assert child[:2] == parent[:2] and not set(child[2:]) & set(parent)
    bm.truncate("c", 5)
    assert bm.append("c") == [(parent[1], bm.block_table("c")[1])]  # COW of the shared tail
    bm.check_invariants()
    for s in ("p", "c"):
        bm.free(s)
    assert bm.all_free()


def test_contiguous_truncate_swaps_a_shared_page_for_a_private_one():
    bm = BlockManager(num_pages=12, page_size=L, reservation="contiguous", max_model_len=16)
    allocate_committed(bm, "p", list(range(5)))  # pages 0, 1 written (1 holds one token)
    bm.fork("p", "c")
    shared = bm.block_table("c")[1]
    bm.truncate("c", 4)  # page 1 is past the new end and shared: the child gets its own
    assert bm.block_table("c")[1] != shared and bm.block_table("p")[1] == shared
    bm.check_invariants()


def test_contiguous_needs_max_model_len_and_a_known_mode():
    with pytest.raises(ValueError, match="max_model_len"):
        BlockManager(4, L, reservation="contiguous")
    with pytest.raises(ValueError, match="reservation"):
        BlockManager(4, L, reservation="ring")
