"""The CUDA engine's KV pages: the books are the Rust core's `BlockManager` (the one the CPU engine's cache keeps
too: tables, free list, reference counts, shared prefixes); this module keeps the f16 pools' side of it: each
sequence's page table in device memory, which the attention kernels read, and the block copies the books ask for.

`seq_len_` is each sequence's committed length. The books may hold one position more for a sequence while a
chained greedy step is queued (CudaEngine.step); `_release_pages` gives such a reservation back."""

from __future__ import annotations

import numpy as np

from ninfer import _core
from ninfer.errors import ContextOverflowError, InvalidArgumentError


class KvPages:
    """CudaEngine's page bookkeeping (a mixin: the engine's state is CudaEngine's)."""

    def _alloc_page_tables(self) -> None:
        """The page tables in device memory, [n_seq_max][max_pages] page numbers (CudaEngine._alloc)."""
        cp = self.cp
        self.max_pages = -(-self.n_ctx // self.page_size)
        self.n_pages = self.max_pages * self.n_seq_max
        self.tables = cp.zeros((self.n_seq_max, self.max_pages), cp.int32)

    def _init_page_books(self) -> None:
        """Every sequence empty, every page free (CudaEngine.__init__)."""
        if self.kv_tiers is not None:
            return self._init_tier_books()  # (cuda_kv_tiers.py)
        self.blocks = _core.BlockManager(self.page_size, self.n_pages, self.n_ctx)
        self.seq_len_: dict[int, int] = {}
        self._table_rows: dict[int, list[int]] = {}  # what each device table row holds, as last written

    def seq_len(self, seq: int) -> int:
        return self.seq_len_.get(seq, 0)

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq_max:
            raise InvalidArgumentError(f"sequence id {seq} is out of range (n_seq_max = {self.n_seq_max})")

    def truncate(self, seq: int, n: int) -> None:
        """Keep the first n positions of seq; also gives back positions reserved for a launch that failed."""
        self._drain()
        shorter = n < self.seq_len(seq)
        if shorter:
            self.seq_len_[seq] = n
            if self.kv_tiers is not None:
                self._forget_shortlists(seq)
        self._release_pages(seq)
        if shorter and self.tail is not None:
            self.tail.truncate(seq, n)

    def remove(self, seq: int) -> None:
        self._drain()
        if self.kv_tiers is not None:
            return self._tier_remove(seq)
        self.blocks.remove(seq)
        self.seq_len_.pop(seq, None)
        self._table_rows.pop(seq, None)
        if self.tail is not None:
            self.tail.remove(seq)

    def fork(self, src: int, dst: int, n: int) -> None:
        """`dst` becomes the first n positions of `src` (whatever it held before is dropped): whole pages are
        shared, a partial last page is copied."""
        self._check_seq(src)
        self._check_seq(dst)
        if not 0 <= n <= self.seq_len(src):
            raise InvalidArgumentError(f"fork of {n} positions, but sequence {src} holds {self.seq_len(src)}")
        if self.kv_tiers is not None:
            self._drain()
            return self._tier_fork(src, dst, n)
        self.remove(dst)
        self._copy_pages(self.blocks.fork(src, dst, n))
        if n:
            self._copy_sink(src, dst)
        self.seq_len_[dst] = n
        self._sync_table(dst)
        if self.tail is not None:
            self.tail.fork(src, dst, n)

    def kv_usage(self) -> tuple[int, int]:
        """(pages in use, the pools' bytes): the books as they are, without waiting for a queued step."""
        if self.kv_tiers is not None:
            return sum(len(p) for p in self.t_pages.values()), self.kv_tiers.device_bytes
        pools = self._quant_pools() + self.k_offsets + self.k_sink if self.quant_kv else self.k_pools + self.v_pools
        return self.blocks.blocks_in_use(), sum(p.nbytes for p in pools)

    def _reserve(self, seq: int, n_new: int) -> int:
        """Pages for n_new more positions; returns the start position. Raises before changing anything."""
        if self.kv_tiers is not None:
            return self._tier_reserve(seq, n_new)
        self._check_seq(seq)
        start = self.seq_len(seq)
        end = start + n_new
        if end > self.n_ctx:
            raise ContextOverflowError(f"sequence {seq} would hold {end} tokens, but the context holds {self.n_ctx}")
        self.blocks.extend(seq, n_new)  # (ContextOverflowError when the pool has no free pages)
        self._sync_table(seq)
        return start

    def _release_pages(self, seq: int) -> None:
        """Give back the positions past seq's committed length (after a truncation, or reserved for a step that
        did not happen)."""
        if self.kv_tiers is not None:
            return self._tier_release(seq)
        if self.blocks.seq_len(seq) > self.seq_len(seq):
            self._copy_pages(self.blocks.truncate(seq, self.seq_len(seq)))
            self._sync_table(seq)

    def _sync_table(self, seq: int) -> None:
        """Write the entries of seq's device page table that the books changed (ordered on the stream before the
        launches that read them)."""
        table = self.blocks.table(seq)
        old = self._table_rows.get(seq, [])
        first = next((i for i, (a, b) in enumerate(zip(table, old)) if a != b), min(len(table), len(old)))
        if first < len(table):
            self.tables[seq, first:len(table)].set(np.asarray(table[first:], np.int32), stream=self.stream)
        self._table_rows[seq] = table

    def _copy_pages(self, copies: list[tuple[int, int, int]]) -> None:
        """Run the books' block copies: the first n positions of page src into page dst, K and V of every layer."""
        with self.stream:
            pools = self._quant_pools() if self.quant_kv else [*self.k_pools, *self.v_pools]
            for src, dst, n in copies:
                for pool in pools:
                    pool[dst, :, :n] = pool[src, :, :n]
                for offsets in self.k_offsets if self.quant_kv else []:
                    offsets[dst] = offsets[src]

    def _copy_sink(self, src: int, dst: int) -> None:
        """A quantized cache: what src's key at position 0 lost (cuda_kv_quant.py k_sink), for dst forked from it."""
        with self.stream:
            for sink in self.k_sink if self.quant_kv else []:
                sink[dst] = sink[src]
