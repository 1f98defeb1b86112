"""A fake `deep_ep`: DeepEP v1's intranode Buffer API (commit 567632d) in plain torch.distributed.

For CPU tests (gloo), in process or, with tests/fakes on PYTHONPATH, in training runs. It keeps
the real library's semantics where the dispatcher depends on them (deep_ep/buffer.py,
csrc/deep_ep.cpp, csrc/kernels/intranode.cu at that commit):
  - received rows ordered by source rank, then token; local expert ids, -1 (weight 0) for slots
    of other ranks; per-local-expert counts as a Python list (the host sync of the real one);
  - combine sums over ranks in fp32 in rank order and rounds to the input dtype, bf16 only
    (SWITCH_TYPES); topk_weights are summed the same way;
  - cached dispatch with a handle (no top-k); handles hold [ranks, num_sms / 2] channel
    matrices and a call with a config of another num_sms fails as the real asserts do;
  - Config's checks, the NVLink buffer-size checks, 2/4/8 ranks, int64 top-k, a collective
    constructor, explicit destroy; Config's fields are not readable (pybind exposes none).
  - events: `Buffer.capture()`, `previous_event`, `async_finish` (an EventOverlap with an event, else
    none: `current_stream_wait` on it fails as the real assert does) and `allocate_on_comm_stream`
    (only with a previous event and async_finish, as csrc/deep_ep.cpp asserts); the work itself
    is done by the time the call returns (the CPU has one stream).
  - num_worst_tokens (no host sync): W received rows, those past the real ones undefined (NaN rows
    and weights here, so that a read of one shows), their top-k ids -1, no per-expert counts; a
    cached dispatch with such a handle returns W rows too. More real rows than W is an error here
    (the real kernels would write past their buffers).
Not faked: FP8, internode, low-latency mode, bias.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

topk_idx_t = torch.int64
_NUM_MAX_TOPK, _NUM_MAX_SCALES = 128, 128


class Config:
    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256):
        send, recv = num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens
        rdma_send, rdma_recv = num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens
        assert num_sms >= 0
        assert send > 0 and recv > 0
        assert send < recv
        assert rdma_send > 0 and rdma_recv > 0
        rdma_recv = -(-rdma_recv // rdma_send) * rdma_send
        assert rdma_send < rdma_recv and rdma_send <= rdma_recv // 2
        self._fields = (num_sms, send, recv)  # private: the real Config shows Python no fields

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        num_sms, _, recv = self._fields
        assert num_ranks < 8 or num_ranks % 8 == 0
        channels, nvl_ranks, rdma_ranks = num_sms // 2, min(num_ranks, 8), max(num_ranks // 8, 1)
        per_token = hidden_bytes + _NUM_MAX_TOPK * 8 + _NUM_MAX_TOPK * 4 + _NUM_MAX_SCALES * 4
        num_bytes = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4 + channels * nvl_ranks * recv * per_token
        return (num_bytes + 127) // 128 * 128


class EventHandle:
    """A recorded point of a stream (csrc/event.hpp); the CPU's one stream is always past it."""

    def current_stream_wait(self) -> None:
        pass


class EventOverlap:
    def __init__(self, event=None, extra_tensors=None):
        self.event, self.extra_tensors = event, extra_tensors

    def current_stream_wait(self) -> None:
        assert self.event is not None
        self.event.current_stream_wait()


def _on_comm_stream(previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> EventOverlap:
    """The stream handling of every intranode call: checks as deep_ep.cpp, the event it returns."""
    event = getattr(previous_event, "event", None)  # as buffer.py passes it on
    assert event is None or isinstance(event, EventHandle)
    if allocate_on_comm_stream:
        assert event is not None and async_finish, "allocate_on_comm_stream needs previous_event and async"
    return EventOverlap(EventHandle() if async_finish else None)


def _channel_of(num_tokens: int, num_channels: int) -> torch.Tensor:
    """[T] channel of each token: channels take ceil(T / C) consecutive tokens (get_channel_task_range)."""
    per = -(-num_tokens // num_channels) if num_tokens else 1
    return torch.arange(num_tokens) // per


def _undefined_tail(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with NaN rows appended up to `rows` (memory the real kernels never write)."""
    return torch.cat([x, x.new_full((rows - x.shape[0], *x.shape[1:]), float("nan"))])


class Buffer:
    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None):
        assert group is not None, "fake deep_ep: needs a process group"
        assert num_rdma_bytes == 0 and not low_latency_mode, "fake deep_ep: intranode only"
        assert num_nvl_bytes % 128 == 0
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        assert self.group_size < 8 or self.group_size % 8 == 0
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.explicitly_destroy = low_latency_mode, explicitly_destroy
        ids: list = [None] * self.group_size  # collective, like the real IPC-handle exchange
        dist.all_gather_object(ids, self.rank, group)
        self.runtime = "available"

    def destroy(self) -> None:
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        assert self.runtime is not None
        dist.barrier(group=self.group)
        self.runtime = None

    @staticmethod
    def is_sm90_compiled() -> bool:
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap(EventHandle())

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        chunk = {2: 24, 4: 6, 8: 6}
        assert num_ranks in chunk, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, chunk[num_ranks], 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        chunk = {2: 10, 4: 9, 8: 4}
        assert num_ranks in chunk, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, chunk[num_ranks], 256, 6, 128)

    # -- helpers ------------------------------------------------------------------------------

    def _channels(self, config: Config) -> int:
        assert self.runtime is not None, "buffer destroyed"
        assert self.group_size in (2, 4, 8), "Unsupported ranks"
        assert config._fields[0] % 2 == 0
        return config._fields[0] // 2

    def _all_to_all(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send parts[r] to rank r; returns what each rank sent here. Rows may differ per rank."""
        counts = torch.tensor([p.shape[0] for p in parts], dtype=torch.int64)
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send = torch.cat(parts)
        wire = send.view(torch.uint8) if send.dtype == torch.bool else send
        out = wire.new_empty((int(recv_counts.sum()), *send.shape[1:]))
        dist.all_to_all_single(out, wire.contiguous(), recv_counts.tolist(), counts.tolist(), group=self.group)
        out = out.view(torch.bool) if send.dtype == torch.bool else out
        return list(out.split(recv_counts.tolist()))

    def _check_rows(self, x: torch.Tensor) -> None:
        assert x.dim() == 2 and x.is_contiguous()
        row_bytes = x.size(1) * x.element_size()
        assert row_bytes % 16 == 0
        assert (row_bytes // 16) % 2 == 0 and row_bytes // 2 + 8 <= 8192, "dispatch TMA: trap"

    # -- the API ---------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == topk_idx_t
        assert num_experts > 0
        per_rank = num_experts // self.group_size
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // per_rank, -1)
        is_token_in_rank = torch.stack([(dest == r).any(dim=1) for r in range(self.group_size)], dim=1)
        num_tokens_per_rank = is_token_in_rank.sum(dim=0).int()
        num_tokens_per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).int()
        event = _on_comm_stream(previous_event, async_finish, allocate_on_comm_stream)
        return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank.contiguous(), event

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0,
                 config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        config = self.get_dispatch_config(self.group_size) if config is None else config
        assert not isinstance(x, tuple), "fake deep_ep: no FP8"
        event = _on_comm_stream(previous_event, async_finish, allocate_on_comm_stream)
        channels, P = self._channels(config), self.group_size
        self._check_rows(x)
        T, D = x.shape
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            rank_prefix_matrix, channel_prefix_matrix, _, recv_src_idx, is_token_in_rank, _ = handle
            assert tuple(channel_prefix_matrix.shape) == (P, channels), "cached channel_prefix_matrix vs num_sms / 2"
            assert is_token_in_rank.shape == (T, P)
            recv_x = torch.cat(self._all_to_all([x[is_token_in_rank[:, r]] for r in range(P)]))
            recv_x = _undefined_tail(recv_x, recv_src_idx.shape[0])  # W rows if made with num_worst_tokens
            assert recv_x.shape[0] == recv_src_idx.shape[0]
            return recv_x, None, None, None, None, event

        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        assert is_token_in_rank.dtype == torch.bool and is_token_in_rank.shape == (T, P)
        assert num_tokens_per_rank.dtype == torch.int32 and num_tokens_per_expert.dtype == torch.int32
        num_experts = num_tokens_per_expert.size(0)
        assert num_experts % P == 0
        local = num_experts // P
        assert local <= 128, "notify_dispatch: num_experts / num_ranks <= 128"
        assert (topk_idx is None) == (topk_weights is None)
        K = 0
        if topk_idx is not None:
            K = topk_idx.size(1)
            assert topk_idx.dtype == topk_idx_t and topk_idx.is_contiguous() and topk_idx.shape[0] == T
            assert topk_weights.dtype == torch.float32 and topk_weights.is_contiguous() and topk_weights.shape == (T, K)
            assert K <= 32
        recv_buffer = config._fields[2]
        assert (P * P * 4 + channels * P * 4 * 4
                + channels * P * recv_buffer * (D * x.element_size() + 4 + K * 8 + K * 4)) <= self.num_nvl_bytes

        # Send: to each rank, its tokens in token order, with local ids (-1 elsewhere) and weights (0 there).
        rows, meta, weights = [], [], []
        token = torch.arange(T)
        for r in range(P):
            sel = is_token_in_rank[:, r]
            rows.append(x[sel])
            if K:
                ids = topk_idx[sel]
                mine = (ids >= r * local) & (ids < (r + 1) * local)
                meta.append(torch.cat([token[sel, None], torch.where(mine, ids - r * local, -1)], dim=1))
                weights.append(torch.where(mine, topk_weights[sel], 0.0))
            else:
                meta.append(token[sel, None])
        if num_worst_tokens > 0:
            assert K, "num_worst_tokens: must be forward with top-k stuffs"
        recv_x = torch.cat(self._all_to_all(rows))
        recv_meta = torch.cat(self._all_to_all(meta))
        recv_src_idx = recv_meta[:, 0].int()
        recv_topk_idx = recv_topk_weights = None
        num_recv_tokens_per_expert_list = []
        if K:
            recv_topk_idx = recv_meta[:, 1:].contiguous()
            recv_topk_weights = torch.cat(self._all_to_all(weights)).contiguous()
            if num_worst_tokens == 0:  # the host sync
                counts = torch.bincount(recv_topk_idx[recv_topk_idx >= 0], minlength=local).tolist()
                num_recv_tokens_per_expert_list = [-(-c // expert_alignment) * expert_alignment for c in counts]
        if num_worst_tokens > 0:
            assert recv_x.shape[0] <= num_worst_tokens, "fake deep_ep: more rows received than num_worst_tokens"
            recv_x = _undefined_tail(recv_x, num_worst_tokens)
            recv_topk_weights = _undefined_tail(recv_topk_weights, num_worst_tokens)
            recv_topk_idx = torch.cat([recv_topk_idx, recv_topk_idx.new_full(
                (num_worst_tokens - recv_topk_idx.shape[0], K), -1)])
            recv_src_idx = torch.cat([recv_src_idx, recv_src_idx.new_zeros(num_worst_tokens - recv_src_idx.shape[0])])

        # The handle, shaped as the real one: rank prefix [P, P] (source-major cumulative counts),
        # channel prefix [P, C] (tokens to each rank up to each channel), the received channels'
        # start offsets [P, C], source token of each received row, is_token_in_rank, send_head [T, P].
        per_rank_all: list = [None] * P
        dist.all_gather_object(per_rank_all, num_tokens_per_rank.tolist(), group=self.group)
        rank_prefix_matrix = torch.tensor(per_rank_all, dtype=torch.int64).cumsum(dim=0).int()
        channel = _channel_of(T, channels)
        to_rank_per_channel = torch.zeros(P, channels, dtype=torch.int64)
        for r in range(P):
            to_rank_per_channel[r] = torch.bincount(channel[is_token_in_rank[:, r]], minlength=channels)
        channel_prefix_matrix = to_rank_per_channel.cumsum(dim=1).int()
        starts = self._all_to_all([(channel_prefix_matrix[r] - to_rank_per_channel[r]).int()[None] for r in range(P)])
        recv_channel_prefix_matrix = torch.cat(starts).contiguous()
        send_head = torch.full((T, P), -1, dtype=torch.int32)
        for r in range(P):
            sel = is_token_in_rank[:, r]
            before = torch.cumsum(sel.long(), 0) - sel.long()  # earlier tokens to r
            start_of_channel = (channel_prefix_matrix[r] - to_rank_per_channel[r])[channel]
            send_head[:, r] = torch.where(sel, before - start_of_channel, -1).int()
        handle = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
                  is_token_in_rank, send_head)
        return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False,
                allocate_on_comm_stream=False):
        config = self.get_combine_config(self.group_size) if config is None else config
        assert bias is None, "fake deep_ep: no bias"
        event = _on_comm_stream(previous_event, async_finish, allocate_on_comm_stream)
        channels, P = self._channels(config), self.group_size
        rank_prefix_matrix, _, channel_prefix_matrix, src_idx, is_token_in_rank, send_head = handle
        assert x.dim() == 2 and x.is_contiguous()
        assert src_idx.dim() == 1 and src_idx.dtype == torch.int32 and send_head.dtype == torch.int32
        assert tuple(channel_prefix_matrix.shape) == (P, channels), "channel_prefix_matrix vs num_sms / 2"
        assert x.size(0) == src_idx.size(0) and send_head.size(1) == P
        assert (x.size(1) * x.element_size()) % 16 == 0
        assert x.dtype == torch.bfloat16, "Unsupported type"
        K = 0
        if topk_weights is not None:
            assert topk_weights.dim() == 2 and topk_weights.is_contiguous() and topk_weights.dtype == torch.float32
            assert topk_weights.size(0) == x.size(0)
            K = topk_weights.size(1)
        recv_buffer = config._fields[2]
        assert (channels * P * 4 * 2
                + channels * P * recv_buffer * (x.size(1) * x.element_size() + 4 + K * 4)) <= self.num_nvl_bytes

        # Rows received from source s sit at [prefix[s - 1][me], prefix[s][me]): send them back to s.
        ends = rank_prefix_matrix[:, self.rank].tolist()
        bounds = list(zip([0] + ends[:-1], ends))
        back = self._all_to_all([x[a:b] for a, b in bounds])
        back_w = self._all_to_all([topk_weights[a:b] for a, b in bounds]) if K else None
        T = send_head.size(0)
        out = torch.zeros(T, x.size(1), dtype=torch.float32)
        out_w = torch.zeros(T, K, dtype=torch.float32) if K else None
        for r in range(P):  # in rank order, fp32, as the kernel reduces
            sel = is_token_in_rank[:, r]
            out[sel] += back[r].float()
            if K:
                out_w[sel] += back_w[r]
        return out.to(x.dtype), out_w, event
