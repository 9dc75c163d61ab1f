"""The free list of paged-KV blocks (pages) the engine reserves for each running request."""

from __future__ import annotations

import collections


class BlockAllocator:
    """Free list of KV pages. Page 0 is the attention op's scratch page (padding rows), never handed out.
    alloc takes from the front, release returns to the back; unalloc and unrelease take back the latest of either
    exactly (the engine undoes a failed step's changes in reverse), so the list is as it was, order included."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self.free = collections.deque(range(1, num_pages))

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        return [self.free.popleft() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self.free.extend(pages)

    def unalloc(self, pages: list[int]) -> None:
        self.free.extendleft(reversed(pages))

    def unrelease(self, n: int) -> None:
        for _ in range(n):
            self.free.pop()
