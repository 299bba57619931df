"""Host-side page allocator for the paged KV cache: free pages, refcounts, COW, prefix cache.

Pure Python (no jax): the device only ever sees the block tables this module hands out.

Every page except the dummy page 0 is in exactly one of three states:

* free: refcount 0, no prefix hash; in ``_free`` (FIFO);
* cached-free: refcount 0 but its KV is a hashed, reusable prefix page; in ``_cached`` (an LRU,
  oldest first). A prefix hit revives it; a fresh allocation evicts it when ``_free`` is empty;
* referenced: refcount > 0, equal to the number of block tables that hold it.

Prefix cache. A FULL page whose KV has been written (``commit``) is keyed by the chained hash
``page_hash(prev_hash, page_tokens)``: sha256 over the parent's digest and the page's token ids,
so a key names the page's tokens and everything before them, and a crafted prompt cannot collide
with another user's prefix (Python's ``hash`` is neither collision-resistant nor stable across
processes). The chain starts from ``root_hash(cache_salt)``: requests with different salts never
share pages, which separates tenants of one server. ``allocate`` reuses the longest run of
consecutive hits from the start of the prompt, but never the page that holds the last prompt
token: that token must be computed so logits exist.

Copy-on-write. ``fork`` shares pages; the first write into a page with refcount > 1 (``append``)
moves the writer onto a fresh page and reports ``(src, dst)`` for the device to copy.

Reservation. ``reservation="paged"`` (the default) gives a sequence pages as it grows.
``reservation="contiguous"`` is the pre-PagedAttention baseline for ablations: every sequence
reserves ``ceil(max_model_len / page_size)`` pages when it is admitted and keeps them until it
ends, as a contiguous max-length KV buffer per request would (HF ``generate``, FasterTransformer).
Everything else (prefix hits, copy-on-write, refcounts) works the same on the reserved tables.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Hashable, Optional, Sequence

DUMMY_PAGE = 0  # reserved: padding writes land here; never allocated, never freed

SeqId = Hashable


def root_hash(cache_salt: Optional[str] = None) -> bytes:
    """The digest a sequence's hash chain starts from; a salt gives a tenant its own chain."""
    salt = b"" if cache_salt is None else b"salt:" + str(cache_salt).encode("utf-8")
    return hashlib.sha256(b"llmserve-prefix-v1\0" + salt).digest()


def page_hash(prev: bytes, tokens: Sequence[int]) -> bytes:
    """sha256 over the parent page's digest and this page's token ids (little-endian u32)."""
    h = hashlib.sha256(prev)
    h.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
    return h.digest()


class NoFreePages(RuntimeError):
    """Not enough free (or evictable) pages; the block manager's state is unchanged."""


@dataclasses.dataclass
class BlockStats:
    """Exact counters. Per ``allocate`` (caching on): hits + misses == full prompt pages."""

    prefix_hits: int = 0  # pages reused from the prefix cache
    prefix_misses: int = 0  # full prompt pages that had to be computed
    evictions: int = 0  # cached-free pages reclaimed for fresh use
    cow_copies: int = 0  # (src, dst) copies handed to the device


class BlockManager:
    """Allocates KV pages to sequences; see the module docstring for the page states."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 reservation: str = "paged", max_model_len: int | None = None):
        if num_pages < 2 or page_size < 1:
            raise ValueError(f"need num_pages >= 2, page_size >= 1; got {num_pages=} {page_size=}")
        if reservation not in ("paged", "contiguous"):
            raise ValueError(f"reservation must be 'paged' or 'contiguous', got {reservation!r}")
        if reservation == "contiguous" and (max_model_len is None or max_model_len < 1):
            raise ValueError("reservation='contiguous' needs max_model_len >= 1")
        self.reservation = reservation
        # Pages every sequence holds from admission to its end (0: grow page by page).
        self.reserve_pages = (-(-max_model_len // page_size) if reservation == "contiguous"
                              else 0)
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = BlockStats()
        self._refcount = [0] * num_pages
        self._free: collections.deque[int] = collections.deque(range(1, num_pages))
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._hash_to_page: dict[bytes, int] = {}
        self._page_key: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # page -> (hash, tokens)
        self._tables: dict[SeqId, list[int]] = {}
        self._lengths: dict[SeqId, int] = {}
        self._hashes: dict[SeqId, list[bytes]] = {}  # chained hashes, committed full pages
        self._roots: dict[SeqId, bytes] = {}  # where each sequence's chain starts (its salt)

    # ---------------------------------------------------------------- queries

    @property
    def num_free_pages(self) -> int:
        """Pages a new allocation can take: free plus cached-but-unreferenced (evictable)."""
        return len(self._free) + len(self._cached)

    def num_pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)

    def pages_held(self, num_tokens: int) -> int:
        """Pages a sequence of ``num_tokens`` tokens holds (its whole reservation if contiguous)."""
        return max(self.num_pages_for(num_tokens), self.reserve_pages)

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The sequence's pages in token order (a copy)."""
        return list(self._tables[seq_id])

    def num_tokens(self, seq_id: SeqId) -> int:
        """Token slots reserved for the sequence."""
        return self._lengths[seq_id]

    def has_seq(self, seq_id: SeqId) -> bool:
        """Whether the sequence holds pages."""
        return seq_id in self._tables

    def all_free(self) -> bool:
        """True when no page is referenced (every page but 0 is free or cached-free)."""
        return self.num_free_pages == self.num_pages - 1

    # ---------------------------------------------------------------- allocate

    def can_allocate(self, token_ids: Sequence[int], cache_salt: Optional[str] = None) -> bool:
        """Whether ``allocate`` would succeed for this prompt."""
        hit_pages, _ = self._match_prefix(token_ids, root_hash(cache_salt))
        return self._pages_needed(token_ids, hit_pages) <= self.num_free_pages

    def allocate(self, seq_id: SeqId, token_ids: Sequence[int],
                 cache_salt: Optional[str] = None) -> int:
        """Reserve pages for a new sequence's prompt; return num_cached_tokens (page multiple).

        Pages of the longest cached prefix are shared instead of allocated; their KV is valid,
        so the caller computes only tokens ``[num_cached_tokens, len(token_ids))``.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already allocated")
        root = root_hash(cache_salt)
        hit_pages, hit_hashes = self._match_prefix(token_ids, root)
        needed = self._pages_needed(token_ids, hit_pages)
        if needed > self.num_free_pages:
            raise NoFreePages(f"prompt of {len(token_ids)} tokens needs {needed} pages, "
                              f"{self.num_free_pages} free")
        for page in hit_pages:  # revive first, so taking fresh pages cannot evict a hit
            self._incref(page)
        fresh = [self._take() for _ in range(self.pages_held(len(token_ids)) - len(hit_pages))]
        self._tables[seq_id] = hit_pages + fresh
        self._lengths[seq_id] = len(token_ids)
        self._hashes[seq_id] = hit_hashes
        self._roots[seq_id] = root
        if self.enable_prefix_caching:
            self.stats.prefix_hits += len(hit_pages)
            self.stats.prefix_misses += len(token_ids) // self.page_size - len(hit_pages)
        return len(hit_pages) * self.page_size

    def _match_prefix(self, token_ids: Sequence[int],
                      root: bytes) -> tuple[list[int], list[bytes]]:
        """Pages and chained hashes of the longest cached prefix (pure: no state change)."""
        pages: list[int] = []
        hashes: list[bytes] = []
        if not self.enable_prefix_caching:
            return pages, hashes
        prev = root
        for i in range((len(token_ids) - 1) // self.page_size):  # never the last token's page
            tokens = tuple(token_ids[i * self.page_size:(i + 1) * self.page_size])
            prev = page_hash(prev, tokens)
            page = self._hash_to_page.get(prev)
            if page is None or self._page_key[page] != (prev, tokens):  # miss (or collision)
                break
            pages.append(page)
            hashes.append(prev)
        return pages, hashes

    def _pages_needed(self, token_ids: Sequence[int], hit_pages: list[int]) -> int:
        """Free-or-cached pages consumed: fresh pages plus hits that must leave the LRU."""
        fresh = self.pages_held(len(token_ids)) - len(hit_pages)
        return fresh + sum(self._refcount[p] == 0 for p in hit_pages)

    # ---------------------------------------------------------------- grow / shrink

    def can_append(self, seq_id: SeqId, num_new_tokens: int = 1) -> bool:
        """Whether ``append`` would succeed."""
        return self._append_cost(seq_id, num_new_tokens)[0] <= self.num_free_pages

    def append(self, seq_id: SeqId, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Grow the sequence by ``num_new_tokens`` slots; return copy-on-write ``(src, dst)`` pairs.

        If the page the first new token lands in is shared, the sequence moves to a fresh copy
        (at most one pair). A cached page about to be overwritten loses its prefix hash.
        """
        needed, cow = self._append_cost(seq_id, num_new_tokens)
        if needed > self.num_free_pages:
            raise NoFreePages(f"append of {num_new_tokens} to {seq_id!r} needs {needed} pages, "
                              f"{self.num_free_pages} free")
        table = self._tables[seq_id]
        length = self._lengths[seq_id]
        copies = []
        if cow:
            i = length // self.page_size
            src, dst = table[i], self._take()
            self._release(src)  # still referenced by the other holders
            table[i] = dst
            copies.append((src, dst))
            self.stats.cow_copies += 1
        elif num_new_tokens > 0 and length % self.page_size:
            self._unhash(table[length // self.page_size])  # sole owner overwrites its tail
        new_length = length + num_new_tokens
        table.extend(self._take() for _ in range(self.pages_held(new_length) - len(table)))
        self._lengths[seq_id] = new_length
        return copies

    def _append_cost(self, seq_id: SeqId, num_new_tokens: int) -> tuple[int, bool]:
        """(pages needed, whether the partly filled tail page must be copied first)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        length = self._lengths[seq_id]
        grow = max(0, self.pages_held(length + num_new_tokens) - len(self._tables[seq_id]))
        cow = (num_new_tokens > 0 and length % self.page_size != 0
               and self._refcount[self._tables[seq_id][length // self.page_size]] > 1)
        return grow + cow, cow

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Shrink the sequence to ``num_tokens`` slots (speculative rollback); free pages beyond.

        Contiguous reservation keeps every reserved page, but a shared page past the new end is
        swapped for a private fresh one (the sequence will write there); raises NoFreePages,
        with nothing changed, when no page is free for that swap.
        """
        length = self._lengths[seq_id]
        if not 0 <= num_tokens <= length:
            raise ValueError(f"truncate {seq_id!r} to {num_tokens}, length is {length}")
        table = self._tables[seq_id]
        keep = self.pages_held(num_tokens)
        shared = [i for i in range(self.num_pages_for(num_tokens), keep)
                  if self._refcount[table[i]] > 1]
        if len(shared) > self.num_free_pages:
            raise NoFreePages(f"truncate of {seq_id!r} needs {len(shared)} private pages")
        for i in shared:
            self._release(table[i])
            table[i] = self._take()
        for page in reversed(table[keep:]):
            self._release(page)
        del table[keep:]
        del self._hashes[seq_id][num_tokens // self.page_size:]
        self._lengths[seq_id] = num_tokens

    # ---------------------------------------------------------------- prefix cache

    def commit(self, seq_id: SeqId, token_ids: Sequence[int], num_computed: int) -> None:
        """Register prefix hashes for the sequence's pages that are now full and computed.

        ``token_ids`` is the sequence's full token list so far; the device has written KV for
        its first ``num_computed`` tokens. A page whose content is already cached elsewhere is
        not registered twice (the first copy stays the cache entry).
        """
        if not self.enable_prefix_caching:
            return
        if not num_computed <= min(len(token_ids), self._lengths[seq_id]):
            raise ValueError(f"{num_computed=} exceeds tokens ({len(token_ids)}) or length "
                             f"({self._lengths[seq_id]}) of {seq_id!r}")
        hashes, table, size = self._hashes[seq_id], self._tables[seq_id], self.page_size
        prev = hashes[-1] if hashes else self._roots[seq_id]
        for i in range(len(hashes), num_computed // size):
            tokens = tuple(token_ids[i * size:(i + 1) * size])
            prev = page_hash(prev, tokens)
            hashes.append(prev)
            page = table[i]
            if prev not in self._hash_to_page and page not in self._page_key:
                self._hash_to_page[prev] = page
                self._page_key[page] = (prev, tokens)

    # ---------------------------------------------------------------- fork / free

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Give ``child_id`` the parent's pages (shared, refcount++) and length (n > 1 sampling)."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already allocated")
        # Contiguous: share the written pages, reserve the rest privately (never shared unwritten).
        table = self._tables[parent_id][: self.num_pages_for(self._lengths[parent_id])]
        private = len(self._tables[parent_id]) - len(table)
        if private > self.num_free_pages:
            raise NoFreePages(f"fork of {parent_id!r} needs {private} reserved pages")
        for page in table:
            self._incref(page)
        self._tables[child_id] = list(table) + [self._take() for _ in range(private)]
        self._lengths[child_id] = self._lengths[parent_id]
        self._hashes[child_id] = list(self._hashes[parent_id])
        self._roots[child_id] = self._roots[parent_id]

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence's pages, tail first (so its prefix outlives its tail in the LRU)."""
        for page in reversed(self._tables.pop(seq_id)):
            self._release(page)
        del self._lengths[seq_id]
        del self._hashes[seq_id]
        del self._roots[seq_id]

    # ---------------------------------------------------------------- page primitives

    def drop_prefix_cache(self) -> None:
        """Forgets every cached-free page (their K/V is gone, e.g. after the device state was
        rebuilt); referenced pages keep their hashes until released."""
        while self._cached:
            page, _ = self._cached.popitem(last=False)
            self._unhash(page)
            self._free.append(page)

    def _take(self) -> int:
        """A fresh page (refcount 1): a free one, else evict the least recently used cached one."""
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._cached.popitem(last=False)
            self._unhash(page)
            self.stats.evictions += 1
        self._refcount[page] = 1
        return page

    def _incref(self, page: int) -> None:
        """Add a holder; a cached-free page leaves the LRU (revived)."""
        if self._refcount[page] == 0:
            del self._cached[page]
        self._refcount[page] += 1

    def _release(self, page: int) -> None:
        """Drop a holder; at zero the page becomes cached-free if hashed, else free."""
        self._refcount[page] -= 1
        assert self._refcount[page] >= 0, f"page {page} refcount went negative"
        if self._refcount[page] == 0:
            if page in self._page_key:
                self._cached[page] = None
            else:
                self._free.append(page)

    def _unhash(self, page: int) -> None:
        """Forget the page's prefix-cache entry, if any."""
        key = self._page_key.pop(page, None)
        if key is not None:
            del self._hash_to_page[key[0]]

    # ---------------------------------------------------------------- checks

    def check_invariants(self) -> None:
        """Assert the page states partition pages 1..P-1 and every map agrees with the others."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "duplicate page in the free list"
        counts = collections.Counter(p for table in self._tables.values() for p in table)
        referenced = set(counts)
        assert DUMMY_PAGE not in free | cached | referenced | set(self._page_key), "page 0 in use"
        assert self._refcount[DUMMY_PAGE] == 0
        assert not (free & cached or free & referenced or cached & referenced), "page in 2 states"
        assert free | cached | referenced == set(range(1, self.num_pages)), "page lost"
        for page in range(self.num_pages):
            assert self._refcount[page] == counts.get(page, 0), f"page {page} refcount wrong"
        assert {h: p for p, (h, _) in self._page_key.items()} == self._hash_to_page
        assert len(self._hash_to_page) == len(self._page_key), "two pages share a hash"
        assert cached <= set(self._page_key), "cached-free page without a hash"
        assert not free & set(self._page_key), "free page with a hash"
        assert (self._tables.keys() == self._lengths.keys() == self._hashes.keys()
                == self._roots.keys())
        for seq_id, table in self._tables.items():
            assert len(table) == self.pages_held(self._lengths[seq_id]), f"{seq_id!r} table"
            assert len(self._hashes[seq_id]) <= self._lengths[seq_id] // self.page_size
            for page, h in zip(table, self._hashes[seq_id]):  # a cache key names the page's KV
                assert self._page_key.get(page, (h,))[0] == h, f"page {page} keyed as other KV"
