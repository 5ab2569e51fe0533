"""The CUDA engine's KV page books: which pages of the f16 pools each sequence holds (a page table per sequence in
device memory, which the attention kernels read), the free list, and each sequence's length. Kept apart from the
engine's launches so that the books can move to one owner (ninfer._core.BlockManager) without touching them."""

from __future__ import annotations

from ninfer.errors import ContextOverflowError, InvalidArgumentError


class KvPages:
    """CudaEngine's page bookkeeping (a mixin: the engine's state is CudaEngine's)."""

    def _alloc_page_tables(self) -> None:
        """The page tables in device memory, [n_seq_max][max_pages] page numbers (CudaEngine._alloc)."""
        cp = self.cp
        self.n_pages = -(-self.n_ctx // self.page_size) * self.n_seq_max
        self.max_pages = -(-self.n_ctx // self.page_size)
        self.tables = cp.zeros((self.n_seq_max, self.max_pages), cp.int32)

    def _init_page_books(self) -> None:
        """Every sequence empty, every page free (CudaEngine.__init__)."""
        self.seq_len_: dict[int, int] = {}
        self.pages: dict[int, list[int]] = {}
        self.free_pages = list(range(self.n_pages - 1, -1, -1))

    def seq_len(self, seq: int) -> int:
        return self.seq_len_.get(seq, 0)

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq_max:
            raise InvalidArgumentError(f"sequence id {seq} is out of range (n_seq_max = {self.n_seq_max})")

    def truncate(self, seq: int, n: int) -> None:
        self._drain()
        if n >= self.seq_len(seq):
            return
        self.seq_len_[seq] = n
        self._release_pages(seq)
        if self.tail is not None:
            self.tail.truncate(seq, n)

    def remove(self, seq: int) -> None:
        self.truncate(seq, 0)
        self.seq_len_.pop(seq, None)
        if self.tail is not None:
            self.tail.remove(seq)

    def kv_usage(self) -> tuple[int, int]:
        self._drain()
        used = sum(len(p) for p in self.pages.values())
        return used, sum(p.nbytes for p in self.k_pools + self.v_pools)

    def _reserve(self, seq: int, n_new: int) -> int:
        """Pages for n_new more positions; returns the start position. Raises before changing anything."""
        self._check_seq(seq)
        start = self.seq_len(seq)
        end = start + n_new
        if end > self.n_ctx:
            raise ContextOverflowError(f"sequence {seq} would hold {end} tokens, but the context holds {self.n_ctx}")
        pages = self.pages.setdefault(seq, [])
        need = -(-end // self.page_size) - len(pages)
        if need > len(self.free_pages):
            raise ContextOverflowError(f"the KV cache has no free pages for {n_new} more tokens of sequence {seq}")
        for _ in range(need):
            page = self.free_pages.pop()
            with self.stream:  # ordered before the launches that read the table
                self.tables[seq, len(pages)] = page
            pages.append(page)
        return start

    def _release_pages(self, seq: int) -> None:
        """Give back the pages past seq's length (after a truncation, or reserved for a step that did not
        happen)."""
        pages = self.pages.get(seq, [])
        keep = -(-self.seq_len(seq) // self.page_size)
        self.free_pages.extend(reversed(pages[keep:]))
        self.pages[seq] = pages[:keep]
