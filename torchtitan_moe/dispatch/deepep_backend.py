"""The seam between the DeepEP dispatcher and DeepEP itself, and one DeepEP buffer per group.

    backend.dispatch(x [T, D] bf16, experts [T, K], probs [T, K] fp32, num_experts) -> Dispatched:
        x [R, D]             one row per (token, this rank), by source rank, then token
        experts [R, K]       local expert id of each slot, -1 where the slot is another rank's
        probs [R, K] fp32    the slots' probabilities, 0 where the slot is another rank's
        tokens_per_expert    [E_local] Python ints (DeepEP's host sync: the CPU waits for them)
    backend.dispatch(..., num_worst_tokens=W): no host sync; x [W, D], experts [W, K], probs [W, K],
        the rows past those received undefined (their experts -1), tokens_per_expert []
        handle               the layout, reused by the next two calls
    backend.dispatch_again(x [T, D], handle) -> [R, D]          same rows, no layout, no host sync
    backend.combine(x [R, D], handle, probs [R, K]?) -> ([T, D], [T, K]?)   plain sums over ranks
    backend.start_combine(x [R, D], handle) -> ([T, D], done)    the forward's combine, not waited for

`dispatch` and `start_combine` run on DeepEP's communication stream after the work queued so far
(`previous_event` = Buffer.capture(), `async_finish`, `allocate_on_comm_stream`) and return the
event of their end (`done`): the caller makes its stream wait (`done.current_stream_wait()`) when
it needs the results. The backward's calls (dispatch_again, combine) finish on the current stream.

`DeepEPV1` implements it on `deep_ep.Buffer`, DeepEP's v1 intranode API, at DEEPEP_COMMIT.
DeepEP 2.x's `ElasticBuffer` (dispatch with a cached `EPHandle`, combine) fits the same three
methods; a second class here is all it needs.

DeepEP's kernels take `num_sms` SMs, two per channel, and its handles hold per-channel
matrices sized by `num_sms / 2`: a handle must be combined and re-dispatched with the config
that made it. The `Handle` therefore carries its two `deep_ep.Config`s (whose fields Python
cannot read back: `DeepEPSettings` is our record of them).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist

from torchtitan_moe.dispatch.seam import Unavailable

# The last commit of DeepEP's v1 `Buffer` API on main (the next one, b306af0, introduces EPv2).
DEEPEP_COMMIT = "567632dd59810d77b3cc05553df953cc0f779799"
DEEPEP_REPO = "https://github.com/deepseek-ai/DeepEP"
INSTALL_HINT = f"build it with `bash scripts/install_deepep.sh` (DeepEP {DEEPEP_COMMIT[:7]}, see docs/dispatchers.md)"

EP_SIZES = (2, 4, 8)  # DeepEP's intranode kernels are compiled for these rank counts
DEFAULT_NUM_SMS = 24
# DeepEP's recommended NVLink chunk sizes (tokens) at DEEPEP_COMMIT, from Buffer.get_dispatch_config
# and Buffer.get_combine_config: {EP: (dispatch, combine)}, each with a 256-token ring per channel.
DEFAULT_CHUNKS = {2: (24, 10), 4: (6, 9), 8: (6, 4)}
# Unused intranode; must pass Config's checks (DeepEP's own intranode table uses these).
_RDMA_CHUNK, _RDMA_BUFFER = 6, 128
# Kernel limits at DEEPEP_COMMIT: top-k per token, local experts (notify_dispatch's 128 threads),
# and a dispatch row's bytes (half of it plus an 8-byte barrier fit 8 KiB of shared memory).
MAX_TOP_K, MAX_LOCAL_EXPERTS, MAX_ROW_BYTES = 32, 128, 16368


class DeepEPUnavailable(Unavailable):
    """DeepEP cannot run here; the message is one line saying why and what to do."""


@dataclass(frozen=True)
class DeepEPSettings:
    num_sms: int  # SMs of the dispatch and combine kernels (even: one channel is 2 SMs)
    dispatch_chunk: int  # tokens a sender pushes per NVLink chunk, dispatch
    combine_chunk: int  # the same for combine
    buffer_tokens: int = 256  # ring-buffer tokens per channel and peer

    def problem(self) -> str | None:
        """Why DeepEP would refuse these settings (deep_ep.Config's checks), or None."""
        if self.num_sms < 2 or self.num_sms % 2:
            return f"num_sms = {self.num_sms}: must be an even number >= 2"
        for name in ("dispatch_chunk", "combine_chunk"):
            chunk = getattr(self, name)
            if not 0 < chunk < self.buffer_tokens:
                return f"{name} = {chunk}: must be in 1..buffer_tokens - 1 ({self.buffer_tokens - 1})"
        return None

    def describe(self) -> str:
        return (f"{self.num_sms} SMs, chunks {self.dispatch_chunk} (dispatch) / {self.combine_chunk} (combine) "
                f"of {self.buffer_tokens}")


def default_settings(ep: int, num_sms: int = DEFAULT_NUM_SMS) -> DeepEPSettings:
    dispatch, combine = DEFAULT_CHUNKS[ep]
    return DeepEPSettings(num_sms, dispatch, combine)


class Handle(NamedTuple):
    raw: tuple  # DeepEP's handle
    dispatch_config: Any  # deep_ep.Config of the dispatch that made it
    combine_config: Any


class Dispatched(NamedTuple):
    x: torch.Tensor  # [R, D]
    experts: torch.Tensor  # [R, K] int64 local expert ids, -1 elsewhere
    probs: torch.Tensor  # [R, K] fp32, 0 elsewhere
    tokens_per_expert: list[int]  # [E_local]; [] under num_worst_tokens
    handle: Handle
    done: Any = None  # the kernels' end (deep_ep.EventOverlap): `done.current_stream_wait()` before reading


class DeepEPBackend(Protocol):
    settings: DeepEPSettings
    num_ranks: int

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, num_experts: int,
                 num_worst_tokens: int = 0) -> Dispatched: ...

    def dispatch_again(self, x: torch.Tensor, handle: Handle) -> torch.Tensor: ...

    def combine(self, x: torch.Tensor, handle: Handle,
                probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def start_combine(self, x: torch.Tensor, handle: Handle) -> tuple[torch.Tensor, Any]: ...


# ---------------------------------------------------------------------------------------
# Can this process run DeepEP? One line per reason, before step 1.
# ---------------------------------------------------------------------------------------


def import_deep_ep():
    try:
        import deep_ep
    except ImportError as e:
        raise DeepEPUnavailable(f"the deep_ep package cannot be imported ({e}); {INSTALL_HINT}") from None
    if not hasattr(getattr(deep_ep, "Buffer", None), "get_dispatch_layout"):
        raise DeepEPUnavailable(f"deep_ep at {os.path.dirname(deep_ep.__file__ or '?')} lacks the v1 Buffer API "
                                f"(Buffer.get_dispatch_layout); {INSTALL_HINT}")
    return deep_ep


def shape_problem(hidden: int, top_k: int, local_experts: int) -> str | None:
    """Why DeepEP's intranode kernels cannot take these shapes (bf16 rows), or None."""
    if hidden % 16 or 2 * hidden > MAX_ROW_BYTES:
        return f"hidden size {hidden}: DeepEP needs a multiple of 16, at most {MAX_ROW_BYTES // 2} (bf16)"
    if top_k > MAX_TOP_K:
        return f"top_k = {top_k}: DeepEP takes at most {MAX_TOP_K}"
    if local_experts > MAX_LOCAL_EXPERTS:
        return f"{local_experts} experts per EP rank: DeepEP takes at most {MAX_LOCAL_EXPERTS}"
    return None


def check_group(group: dist.ProcessGroup) -> None:
    """The EP group's ranks must share one node whose GPUs reach each other (NVLink/P2P); its size
    (EP_SIZES) is the registry's rule (dispatch/registry.py), asked before this.

    Collective over `group`: every rank gathers every rank's host and GPU, so all raise alike."""
    size = dist.get_world_size(group)
    cuda = torch.cuda.is_available()
    mine = (socket.gethostname(), torch.cuda.current_device() if cuda else -1)
    everyone: list = [None] * size
    dist.all_gather_object(everyone, mine, group=group)
    hosts = sorted({host for host, _ in everyone})
    if len(hosts) > 1:
        raise DeepEPUnavailable(
            f"the EP group spans nodes {', '.join(hosts)} (LOCAL_WORLD_SIZE = {os.environ.get('LOCAL_WORLD_SIZE', '?')}, "
            f"EP = {size}): DeepEP's intranode kernels need every EP rank on one node; use an EP degree that divides "
            f"the GPUs per node, or the all_to_all dispatcher")
    if cuda:
        for _, peer in everyone:
            if peer != mine[1] and not torch.cuda.can_device_access_peer(mine[1], peer):
                raise DeepEPUnavailable(
                    f"GPU {mine[1]} cannot access GPU {peer} (no P2P/NVLink between them): DeepEP needs peer access "
                    f"between all GPUs of an EP group; use the all_to_all dispatcher")


# ---------------------------------------------------------------------------------------
# One deep_ep.Buffer per process group, shared by every layer (and every DeepEPV1 on it).
# ---------------------------------------------------------------------------------------

_buffers: dict = {}  # process group -> deep_ep.Buffer


def buffer_for(group: dist.ProcessGroup, num_bytes: int, deep_ep) -> Any:
    """The group's buffer, (re)made with at least `num_bytes` of NVLink buffer. Collective when made."""
    buffer = _buffers.get(group)
    if buffer is not None and buffer.num_nvl_bytes >= num_bytes:
        return buffer
    release_buffers(group)
    # explicitly_destroy: DeepEP's destructor would otherwise run a cross-rank barrier whenever
    # Python collects the object; release_buffers() frees it collectively instead.
    buffer = deep_ep.Buffer(group, num_bytes, 0, low_latency_mode=False, explicitly_destroy=True)
    _buffers[group] = buffer
    return buffer


def release_buffers(group: dist.ProcessGroup | None = None) -> None:
    """Free the DeepEP buffer of `group` (of every group if None). Collective: all its ranks call it."""
    for g in [group] if group is not None else list(_buffers):
        buffer = _buffers.pop(g, None)
        if buffer is not None:
            buffer.destroy()


# ---------------------------------------------------------------------------------------
# DeepEP v1: deep_ep.Buffer's intranode dispatch and combine.
# ---------------------------------------------------------------------------------------


class DeepEPV1:
    """The seam on deep_ep.Buffer (DeepEP v1, intranode, NVLink). Blocking calls: DeepEP runs on its
    own stream and the current stream waits for it, so tensors are freed and reused safely.

    The NVLink buffer holds a ring of `buffer_tokens` rows per channel and peer, so its size
    follows num_sms, the ring, the hidden size and the ranks, not the tokens per rank
    (DeepEP's Config.get_nvl_buffer_size_hint, which allows for top-k up to 128)."""

    def __init__(self, group: dist.ProcessGroup, settings: DeepEPSettings, hidden: int):
        self.deep_ep = import_deep_ep()
        problem = settings.problem() or shape_problem(hidden, 1, 1)
        if problem:
            raise ValueError(f"DeepEP: {problem}")
        self.group, self.settings, self.hidden = group, settings, hidden
        self.num_ranks = dist.get_world_size(group)
        if self.num_ranks not in EP_SIZES:
            raise ValueError(f"DeepEP: EP group of {self.num_ranks} ranks; its intranode kernels take 2, 4 or 8")
        config = self.deep_ep.Config
        s = settings
        self.dispatch_config = config(s.num_sms, s.dispatch_chunk, s.buffer_tokens, _RDMA_CHUNK, _RDMA_BUFFER)
        self.combine_config = config(s.num_sms, s.combine_chunk, s.buffer_tokens, _RDMA_CHUNK, _RDMA_BUFFER)
        self.num_bytes = max(c.get_nvl_buffer_size_hint(2 * hidden, self.num_ranks)
                             for c in (self.dispatch_config, self.combine_config))
        buffer_for(group, self.num_bytes, self.deep_ep)  # made now (collective), not in the first forward

    @property
    def buffer(self):
        # Looked up per call: a later DeepEPV1 on the group may have needed a larger buffer.
        return buffer_for(self.group, self.num_bytes, self.deep_ep)

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, num_experts: int,
                 num_worst_tokens: int = 0) -> Dispatched:
        buffer, topk = self.buffer, experts.to(self.deep_ep.topk_idx_t).contiguous()
        on_comm = dict(async_finish=True, allocate_on_comm_stream=True)
        per_rank, _, per_expert, in_rank, laid_out = buffer.get_dispatch_layout(
            topk, num_experts, previous_event=buffer.capture(), **on_comm)
        recv_x, recv_experts, recv_probs, counts, raw, done = buffer.dispatch(
            x.contiguous(), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk, topk_weights=probs.float().contiguous(), num_worst_tokens=num_worst_tokens,
            config=self.dispatch_config, previous_event=laid_out, **on_comm)
        return Dispatched(recv_x, recv_experts, recv_probs, counts,
                          Handle(raw, self.dispatch_config, self.combine_config), done)

    def dispatch_again(self, x: torch.Tensor, handle: Handle) -> torch.Tensor:
        recv_x, *_ = self.buffer.dispatch(x.contiguous(), handle=handle.raw, config=handle.dispatch_config)
        return recv_x

    def combine(self, x: torch.Tensor, handle: Handle,
                probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        weights = None if probs is None else probs.float().contiguous()
        out, out_probs, _ = self.buffer.combine(x.contiguous(), handle.raw, topk_weights=weights,
                                                config=handle.combine_config)
        return out, out_probs

    def start_combine(self, x: torch.Tensor, handle: Handle) -> tuple[torch.Tensor, Any]:
        buffer = self.buffer
        out, _, done = buffer.combine(x.contiguous(), handle.raw, config=handle.combine_config,
                                      previous_event=buffer.capture(), async_finish=True, allocate_on_comm_stream=True)
        return out, done
