"""flashinfer's paged-KV metadata on the host and the persistent device buffers its CUDA-graph wrappers read.

The metadata: HostPlan, host_plan; the buffers, which decode and CUDA-graph prefill wrappers and their graphs read:
_PlanBuffers. The data half of the flashinfer backend (_attn_flashinfer)."""

from __future__ import annotations

import functools

import attrs
import numpy as np  # a flashinfer dependency
import torch

from fgraph.extend import DoneEvent, FgraphError, config


# ------------------------------------------------------------------------------------------- host metadata
@attrs.frozen
class HostPlan:
    """flashinfer's paged-KV description of one padded batch, on the host (numpy int32, contiguous).

    qo_indptr [B+1] (= query_start_loc; None for decode), indptr [B+1] page offsets, indices [indptr[-1]] page ids,
    last [B] entries in each last page (in 1..page_size: flashinfer reads 0 as a full page),
    lens [B] KV lengths (= seq_lens: what flashinfer's tensor-core decode plan calls kv_lens),
    key: (page counts, pages in use or None when not computed) as bytes: equal keys, equal indptr and indices.
    """

    qo_indptr: np.ndarray | None
    indptr: np.ndarray
    indices: np.ndarray
    last: np.ndarray
    lens: np.ndarray
    key: tuple = ()

    def t(self, name: str) -> torch.Tensor:
        """A field as a CPU int32 tensor (shares memory), for flashinfer's own plan()."""
        return torch.from_numpy(getattr(self, name))


def _np(t: torch.Tensor):
    return t.numpy() if t.device.type == "cpu" and t.dtype == torch.int32 else t.cpu().to(torch.int32).numpy()


def host_plan(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    with_qo: bool = True,
    prev: HostPlan | None = None,
) -> HostPlan:
    """flashinfer's paged-KV metadata for a call, built on the host.

    Vectorized (no loop per sequence; numpy, far cheaper than torch CPU ops at these sizes; about a dozen numpy
    calls: docs/performance.md). Device inputs are copied to the host first (a sync: only for calls outside
    fgraph.jit). with_qo=False (decode: its query offsets are a constant range) leaves qo_indptr None.

    `prev`, the last plan of the same signature: when the page counts and the pages in use are the same as its
    (a decode step within the sequences' last pages, page_size - 1 steps in page_size), its indptr and page ids
    are reused (the same arrays: `upload` then sends only the last-page lengths), in fewer numpy calls.
    The pages in use are compared only after equal page counts, and kept for the next step's check when small:
    a large batch where some sequence enters a new page every step pays nothing for the check."""
    sl, bt = _np(seq_lens), _np(block_table)
    npg = (sl + (page_size - 1)) // page_size  # [B] pages in use
    last = sl - (npg - 1) * page_size
    used = bt[:, : max(int(npg.max(initial=0)), 1)]
    # (copies: the caller's host tensors are fgraph's input mirror, rewritten by the next call)
    qo = _np(query_start_loc).copy() if with_qo else None
    counts, pages = npg.tobytes(), None
    if prev is not None and prev.key and prev.key[0] == counts:  # the pages in use are compared (a copy of
        pages = used.tobytes()  # the used block table) only when this may pay
        if pages == prev.key[1]:
            return HostPlan(qo, prev.indptr, prev.indices, last, sl.copy(), (counts, pages))
    indptr = np.zeros(sl.shape[0] + 1, dtype=np.int32)
    np.cumsum(npg, out=indptr[1:])
    indices = used[_arange(used.shape[1])[None, :] < npg[:, None]]  # row-major = per sequence
    if pages is None and used.size <= 1 << 14:  # small (<= 64 KiB): keep it now, so the next step can reuse
        pages = used.tobytes()
    return HostPlan(qo, indptr, indices, last, sl.copy(), (counts, pages))


@functools.cache
def _arange(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int32)


# ----------------------------------------------------------------------------------------- device buffers
class _PlanBuffers:
    """The persistent device metadata that CUDA-graph wrappers (and their graphs) read.

    One int32 array [indptr (batch+1) | last (batch) | qo_indptr (batch+1) | indices]; wrappers of smaller buckets
    use the heads of its parts, decode wrappers all but qo_indptr. `owner`: the plan generation whose metadata it
    holds (uploaded once per generation, whatever the number of wrappers). A plan fills it with one non-blocking
    copy from a pinned mirror (two, alternating, written through numpy views, far cheaper than a torch copy_ a
    part); flashinfer's own plan() copies page ids from pageable memory with a blocking copy, which synchronizes
    the stream every step."""

    def __init__(self, batch: int, num_indices: int, device):
        n = 3 * batch + 2 + num_indices
        self.flat = torch.zeros(n, dtype=torch.int32, device=device)
        self.indptr, self.last, self.qo, self.indices = (
            self.flat[: batch + 1],
            self.flat[batch + 1 : 2 * batch + 1],
            self.flat[2 * batch + 1 : 3 * batch + 2],
            self.flat[3 * batch + 2 :],
        )
        self.batch, self.owner = batch, None
        self.layout = None  # the (indptr, indices) arrays whose contents the device buffers hold now
        # uploads of all metadata / of the last-page lengths only; graph_*: the same, staged for a graph to copy
        self.uploads = {"full": 0, "lengths": 0, "graph_full": 0, "graph_lengths": 0}
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.stage = [torch.zeros(n, dtype=torch.int32, device="cpu", pin_memory=True) for _ in range(2)]
            self.stage_np = [st.numpy() for st in self.stage]
            # two events made once (creating one per step costs a cudaEventCreate on its first record)
            self.copied, self.events, self.turn = [False, False], [torch.cuda.Event(), torch.cuda.Event()], 0
        # The graph stage (fgraph.config.inputs_in_graph): FULL graphs copy it in themselves, at their first
        # layer, then record g_event (an event node in the graph); the hook only writes it (stage_for_graph).
        self.gstage = self.gstage_np = self.g_event = None
        self.g_layout, self.g_owner, self.copied_for = None, None, None
        if config.inputs_in_graph:
            self.make_graph_stage()  # now: buffers are made by eager runs (warm-up), never inside a capture

    def make_graph_stage(self) -> None:
        if self.gstage is None:
            self.gstage = torch.zeros(self.flat.numel(), dtype=torch.int32, device="cpu", pin_memory=self.cuda)
            self.gstage_np = self.gstage.numpy()
            self.g_event = torch.cuda.Event(external=True) if self.cuda else DoneEvent()
            self.g_event.record()  # created outside any capture (torch creates events on first record)

    def upload(self, host: HostPlan, gen: int) -> None:
        """Send indptr, last-page lengths and page ids to the device, stream-ordered, with no host sync.

        A no-op when this generation is already here, only the last-page lengths when its indptr and page ids
        are (host_plan's `prev` reuse: the same arrays)."""
        if self.owner == gen:
            return
        self._check_fits(host)
        same = self._holds(self.layout, host)
        if not self.cuda:
            self._fill(self.flat.numpy(), host, same)
        else:
            i, self.turn = self.turn, self.turn ^ 1
            if self.copied[i]:
                self.events[i].synchronize()  # the copy made from this mirror two plans ago must be done reading it
            end = self._fill(self.stage_np[i], host, same)
            if same:  # the last-page lengths, and the query offsets after them
                lo, hi = self._lengths(host)
                self.flat[lo:hi].copy_(self.stage[i][lo:hi], non_blocking=True)
            else:
                self.flat[:end].copy_(self.stage[i][:end], non_blocking=True)
            self.events[i].record()
            self.copied[i] = True
        self.owner, self.layout = gen, (host.indptr, host.indices)
        self.uploads["lengths" if same else "full"] += 1

    def stage_for_graph(self, host: HostPlan, gen: int, capturing: bool = False) -> None:
        """upload's work for a graph that copies the stage in itself (copy_in).

        The same writes into the graph stage, no copy and no event record. The device buffers hold this
        generation once that graph's copy runs, which the very next replay does (`owner` says so already)."""
        if self.g_owner == gen:
            return
        self._check_fits(host)
        self.make_graph_stage()  # (made with the buffers unless the switch was turned on after them)
        same = self._holds(self.g_layout, host)
        if not capturing:  # (a capture follows a device sync: no copy of the stage is in flight)
            self.g_event.synchronize()  # the last graph's copy of the stage must be done reading it
        self._fill(self.gstage_np, host, same)
        self.g_layout = self.layout = (host.indptr, host.indices)
        self.g_owner = self.owner = gen
        self.uploads["graph_lengths" if same else "graph_full"] += 1

    @staticmethod
    def _holds(layout, host: HostPlan) -> bool:
        """Whether a buffer holding `layout` (indptr and page-id arrays) already holds host's.

        host_plan reuses them."""
        return layout is not None and layout[0] is host.indptr and layout[1] is host.indices

    def _check_fits(self, host: HostPlan) -> None:
        nnz = host.indices.shape[0]
        if nnz > self.indices.numel():
            raise FgraphError(
                f"attention(backend='flashinfer'): {nnz} pages in use, the plan buffers hold {self.indices.numel()}",
                "keep block tables within max_pages",
            )

    def _lengths(self, host: HostPlan) -> tuple[int, int]:
        """The span of `flat` that changes when only the lengths do: the last-page lengths, then the query offsets
        (mixed steps; decode has none)."""
        B, o = host.last.shape[0], self.batch
        return o + 1, (2 * o + 2 + B if host.qo_indptr is not None else o + 1 + B)

    def _fill(self, st: np.ndarray, host: HostPlan, same: bool) -> int:
        """Write host's metadata into `st`, laid out like `flat`.

        The last-page lengths and query offsets, and unless `same` (st holds its indptr and page ids already) those
        too. Returns the end of the page ids."""
        B, nnz, o = host.last.shape[0], host.indices.shape[0], self.batch
        st[o + 1 : o + 1 + B] = host.last
        if host.qo_indptr is not None:
            st[2 * o + 1 : 2 * o + 2 + B] = host.qo_indptr
        if not same:
            st[: B + 1] = host.indptr
            st[3 * o + 2 : 3 * o + 2 + nnz] = host.indices
        return 3 * o + 2 + nnz

    def copy_in(self, n_indices: int) -> None:
        """The graph's own copy of the stage.

        Captured at a graph's first attention layer (on the CPU the stand-in graph reruns it): indptr, last-page
        lengths, query offsets and n_indices page ids (the bucket's block table), then the event the next staging
        waits for."""
        end = 3 * self.batch + 2 + min(n_indices, self.indices.numel())
        self.flat[:end].copy_(self.gstage[:end], non_blocking=True)
        self.g_event.record()
