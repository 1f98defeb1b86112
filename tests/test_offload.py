"""[activation_checkpoint] offload_inputs (parallel/offload.py): checkpointed blocks' inputs kept in host memory
between forward and backward. The same gradients to the bit; every block's input but the last's offloaded, and
nothing else; each brought back one block ahead of its backward; the hooks left when a forward raises."""

import gc

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from torchtitan_moe.config.sections import ConfigError
from torchtitan_moe.parallel import offload as offload_module
from torchtitan_moe.parallel.offload import offload_block_inputs
from torchtitan_moe.train.job_config import load_job_config

from test_config import DEBUG


class Block(nn.Module):
    def __init__(self, dim: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(dim, dim, generator=g) / dim**0.5)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        return self.attend(x, rope)

    def attend(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x @ self.w) * rope


def model(blocks: int, dim: int, device, compiled: bool = False) -> nn.ModuleList:
    layers = nn.ModuleList(checkpoint_wrapper(Block(dim, seed)) for seed in range(blocks)).to(device)
    for layer in layers:  # as parallelize compiles our blocks' dense math: inside the checkpoint wrapper
        if compiled:
            inner = layer._checkpoint_wrapped_module
            inner.attend = torch.compile(inner.attend, fullgraph=True)
    return layers


def train_step(layers: nn.ModuleList, x: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    h = x
    for layer in layers:
        h = layer(h, rope)
    loss = (h.float() ** 2).sum()
    return loss, torch.autograd.grad(loss, [layer._checkpoint_wrapped_module.w for layer in layers])


def inputs(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 16, generator=g).to(device, dtype).requires_grad_()
    return x, torch.randn(16, generator=g).to(device, dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_same_gradients_to_the_bit_with_every_input_but_the_last_offloaded(device, monkeypatch):
    plain = model(5, 16, device)
    reference = train_step(plain, *inputs(device))
    layers = model(5, 16, device)
    packed = []  # (block input shape?, numel) of each tensor the offloaded blocks save
    pack = offload_module.InputOffload.pack
    monkeypatch.setattr(offload_module.InputOffload, "pack", lambda self, t: packed.append(
        (self._shape is not None and t.shape == self._shape, t.numel())) or pack(self, t))
    offload = offload_block_inputs(list(layers))
    for _ in range(2):  # a second step chains its own blocks again
        loss, grads = train_step(layers, *inputs(device))
        assert torch.equal(loss, reference[0])
        assert all(torch.equal(a, b) for a, b in zip(grads, reference[1]))
    assert offload.offloaded == 2 * 4  # blocks 0-3 each step; the last block's input stays
    # each offloaded block saves its input and the rope cache (and, before torch 2.13, an empty placeholder)
    assert [numel for block_input, numel in packed if block_input] == [2 * 6 * 16] * 8
    assert {numel for block_input, numel in packed if not block_input} <= {16, 0}
    assert [numel for block_input, numel in packed].count(16) == 8


def test_compiled_regions_inside_offloaded_blocks_give_the_same_gradients():
    reference = train_step(model(4, 16, "cpu", compiled=True), *inputs("cpu"))
    layers = model(4, 16, "cpu", compiled=True)
    offload = offload_block_inputs(list(layers))
    loss, grads = train_step(layers, *inputs("cpu"))
    assert offload.offloaded == 3
    assert torch.equal(loss, reference[0]) and all(torch.equal(a, b) for a, b in zip(grads, reference[1]))


def test_each_input_comes_back_one_block_ahead_of_its_backward(monkeypatch):
    events = []
    bring, unpack = offload_module.InputOffload._bring_back, offload_module.InputOffload.unpack
    monkeypatch.setattr(offload_module.InputOffload, "_bring_back",
                        lambda self, saved: events.append(("bring", saved)) or bring(self, saved))
    monkeypatch.setattr(offload_module.InputOffload, "unpack",
                        lambda self, saved: events.append(("unpack", saved)) or unpack(self, saved))
    layers = model(4, 16, "cpu")
    offload = offload_block_inputs(list(layers))
    x, rope = inputs("cpu")
    for _ in range(2):  # each step's blocks chain from its own first one
        events.clear()
        h, chain = x, []
        for layer in layers:
            h = layer(h, rope)
            chain.append(offload._last)
        c0, c1, c2 = chain[:3]  # the last block's input is not offloaded: blocks 0-2's
        assert (c0.previous, c1.previous, c2.previous) == (None, c0, c1)
        (h ** 2).sum().backward()
        # block 2's backward brings back its own input (nothing came before it) and block 1's; block 1's, block 0's
        offloaded = [e for e in events if e[0] == "bring" or isinstance(e[1], offload_module._Offloaded)]
        assert offloaded == [("unpack", c2), ("bring", c2), ("bring", c1), ("unpack", c1), ("bring", c0),
                             ("unpack", c0)]
        assert (c0.previous, c1.previous, c2.previous) == (None, None, None)  # nothing holds a used host copy


def test_a_copy_brought_back_but_never_taken_is_let_go_by_the_next_forward():
    layers = model(3, 16, "cpu")
    offload = offload_block_inputs(list(layers))
    x, rope = inputs("cpu")
    h = layers[2](layers[1](layers[0](x, rope), rope), rope)
    last = offload._last
    first = last.previous
    assert torch.equal(offload.unpack(last), last.host[0])  # a backward that takes block 1's input, then stops
    assert offload._ahead is first and first.gpu is not None  # block 0's brought back ahead
    layers[0](x, rope)  # the next forward
    assert offload._ahead is None and first.gpu is None
    del h


def test_only_the_block_input_shape_is_offloaded():
    layers = model(2, 16, "cpu")
    offload = offload_block_inputs(list(layers))
    x, rope = inputs("cpu")
    h = layers[1](layers[0](x, rope), rope)
    assert offload.offloaded == 1
    saved = offload._last
    assert len(saved.host) == 1 and torch.equal(saved.host[0], x.detach())  # a copy of the input's bits
    del h


def test_every_step_writes_the_same_host_buffers_and_a_stale_backward_is_refused():
    layers = model(3, 16, "cpu")
    offload = offload_block_inputs(list(layers))
    x, rope = inputs("cpu")
    buffers = []
    for _ in range(2):
        loss, _ = train_step(layers, x, rope)
        buffers.append({key: t.data_ptr() for key, t in offload._memory._buffers.items()})
    assert buffers[0] == buffers[1] and sorted(buffers[0]) == [(0, 0), (1, 0)]  # blocks 0 and 1's inputs
    first = layers[2](layers[1](layers[0](x, rope), rope), rope)
    second = layers[2](layers[1](layers[0](x * 2, rope), rope), rope)  # writes the first forward's buffers
    with pytest.raises(RuntimeError, match="a later forward has written its host memory since: run each forward's "
                                           "backward before the next forward"):
        first.sum().backward()
    del second


def test_a_forward_that_raises_leaves_the_hooks(monkeypatch):
    layers = model(3, 16, "cpu")
    offload = offload_block_inputs(list(layers))
    x, rope = inputs("cpu")
    with pytest.raises(RuntimeError):
        layers[0](x, rope[:3])  # a shape that does not broadcast
    assert offload._shape is None
    before = offload.offloaded
    y = torch.tanh(x)  # autograd outside any block: saved as it is
    (y ** 2).sum().backward()
    assert offload.offloaded == before


def test_offload_needs_full_recompute():
    with pytest.raises(ConfigError) as e:
        load_job_config(["--job.config_file", str(DEBUG), "--activation_checkpoint.mode", "selective",
                         "--activation_checkpoint.offload_inputs"])
    assert str(e.value) == ("[activation_checkpoint] offload_inputs = true offloads what full recompute keeps, each "
                            "block's input: it needs mode = 'full' (got 'selective')")
    config = load_job_config(["--job.config_file", str(DEBUG), "--activation_checkpoint.mode", "full",
                              "--activation_checkpoint.offload_inputs"])
    assert config.activation_checkpoint.offload_inputs


@pytest.mark.gpu
def test_on_a_gpu_the_inputs_leave_its_memory_while_the_host_runs_ahead(monkeypatch):
    # 12 blocks of [16384, 1024] fp32 inputs (64 MiB each; weights of 4 MiB), the GPU kept behind the host (as in a
    # training step once its pinned host memory is cached: the second step) by a spin before the forward and the
    # backward: offloaded, the peak of active memory (what the allocator cannot hand out, frees pending on another
    # stream included) holds at least 6 fewer inputs, in the forward and in the backward (kept: the 11 blocks'
    # inputs after the first; offloaded: the last block's, the one offloaded last, one brought back). The
    # gradients are the same bits with every copy slowed down (a spin queued before it on the offload stream): no
    # copy is read before it lands, no tensor is reused while a copy reads it.
    for name in ("pack", "_bring_back"):
        def slowed(self, t, original=getattr(offload_module.InputOffload, name)):
            if torch.is_tensor(t) and t.is_cuda or isinstance(t, offload_module._Offloaded):
                with torch.cuda.stream(self.stream()):
                    torch.cuda._sleep(50_000_000)
            return original(self, t)
        monkeypatch.setattr(offload_module.InputOffload, name, slowed)
    def peaks(offloaded: bool) -> tuple[int, int, list[torch.Tensor]]:
        layers = nn.ModuleList(checkpoint_wrapper(Block(1024, seed)) for seed in range(12)).cuda()
        if offloaded:
            offload_block_inputs(list(layers))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16384, 1024, generator=g).cuda().requires_grad_()
        rope = torch.randn(1024, generator=g).cuda()
        for step in range(2):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_stats()["active_bytes.all.current"]
            torch.cuda._sleep(500_000_000)  # ~0.3 s: the host queues the whole forward meanwhile
            h = x
            for layer in layers:
                h = layer(h, rope)
            forward = torch.cuda.memory_stats()["active_bytes.all.peak"] - start
            torch.cuda.reset_peak_memory_stats()
            torch.cuda._sleep(500_000_000)
            (h ** 2).sum().backward()
            del h
            backward = torch.cuda.memory_stats()["active_bytes.all.peak"] - start
            torch.cuda.synchronize()
        return forward, backward, [x.grad] + [layer._checkpoint_wrapped_module.w.grad for layer in layers]
    kept, offloaded = peaks(False), peaks(True)
    assert kept[0] - offloaded[0] >= 6 * 64 << 20, (kept[:2], offloaded[:2])
    assert kept[1] - offloaded[1] >= 6 * 64 << 20, (kept[:2], offloaded[:2])
    assert all(torch.equal(a, b) for a, b in zip(kept[2], offloaded[2]))


def test_a_node_without_the_host_memory_is_refused(monkeypatch):
    from torchtitan_moe.train import machine

    args = ["--job.config_file", str(DEBUG), "--activation_checkpoint.mode", "full",
            "--activation_checkpoint.offload_inputs", "--training.mixed_precision_param", "bfloat16"]
    config = load_job_config(args)
    # the debug model: 4 layers, dim 128; 3 blocks' bf16 inputs of local_batch x seq tokens on each of 2 ranks
    need = 2 * 3 * config.training.local_batch_size * config.training.seq_len * 128 * 2
    assert machine.offloaded_bytes_per_node(config, 2) == need
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert machine.offloaded_bytes_per_node(config, 1) == need  # one process: fp32 inputs, half the ranks
    # with the attention's outputs: out [T, 4 heads x 32] bf16 and lse [4, T] fp32 a block besides
    attention = load_job_config(args + ["--activation_checkpoint.offload_attention"])
    assert machine.offloaded_bytes_per_node(attention, 2) == need + need // 256 * 4 * (32 * 2 + 4)
    page = 4096
    monkeypatch.setattr(machine.os, "sysconf", lambda name: page if name == "SC_PAGE_SIZE" else need // page)
    with pytest.raises(ConfigError, match=r"offload_inputs = true pins 0 GiB of host memory on this node \(2 ranks x "
                                          r"every block's input but the last's\), over 75% of its 0 GiB"):
        machine.check_machine(config, 2)
    monkeypatch.setattr(machine.os, "sysconf", lambda name: page if name == "SC_PAGE_SIZE" else 2 * need // page)
    machine.check_machine(config, 2)  # within 75%


class AttentionBlock(nn.Module):
    """x [B, S, D] -> x + tanh(attention(x)) * rope: `heads` query heads and `groups` KV heads of D / heads
    (fp64 on the CPU); where parallelize puts KeptAttention, `attention.inner_attention`."""

    def __init__(self, seed: int, dim: int = 16, heads: int = 4, groups: int = 2, dtype=torch.float64):
        from torchtitan_moe.models.qwen3_moe.attention import KeptAttention

        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.split = [dim, dim * groups // heads, dim * groups // heads]
        self.head_dim = dim // heads
        self.w = nn.Parameter((torch.randn(dim, sum(self.split), generator=g) / dim**0.5).to(dtype))  # q | k | v
        self.wo = nn.Parameter((torch.randn(dim, dim, generator=g) / dim**0.5).to(dtype))
        self.attention = nn.Module()
        self.attention.inner_attention = KeptAttention(-1)  # no keeper: the op computes every time

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        return self.attend(x, rope)

    def attend(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (x @ self.w).split(self.split, dim=-1)
        q, k, v = (t.reshape(b, s, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        a = self.attention.inner_attention(q, k, v, scale=0.5).transpose(1, 2).reshape(b, s, d)
        return x + torch.tanh(a @ self.wo) * rope


def attention_model(blocks: int, kept: bool, compiled: bool = False, **sizes):
    from torchtitan_moe.models.qwen3_moe.parallelize import keep_attention_outputs

    layers = nn.ModuleList(checkpoint_wrapper(AttentionBlock(seed, **sizes)) for seed in range(blocks))
    offload = None
    if kept:
        offload = offload_block_inputs(list(layers))
        keep_attention_outputs(list(layers), offload)
    if compiled:
        for layer in layers:
            inner = layer._checkpoint_wrapped_module
            inner.attend = torch.compile(inner.attend, fullgraph=True)
    return layers, offload


def attention_step(layers, x, rope):
    h = x
    for layer in layers:
        h = layer(h, rope)
    loss = (h ** 2).sum()
    params = [p for layer in layers for p in (layer._checkpoint_wrapped_module.w, layer._checkpoint_wrapped_module.wo)]
    return loss, torch.autograd.grad(loss, [x] + params)


@pytest.mark.parametrize("compiled", [False, True])
def test_kept_attention_outputs_spare_the_recompute_its_attention_and_give_the_same_gradients(monkeypatch, compiled):
    from torchtitan_moe.ops import attention as attention_module

    computed = []
    compute = attention_module._compute
    monkeypatch.setattr(attention_module, "_compute", lambda *a: computed.append(1) or compute(*a))
    x, rope = inputs("cpu", torch.float64)
    plain, _ = attention_model(5, kept=False, compiled=compiled)
    reference = attention_step(plain, x, rope)
    assert len(computed) == 10  # each block's forward, then its recompute
    layers, offload = attention_model(5, kept=True, compiled=compiled)
    for step in range(2):  # the second step keeps and takes its own outputs
        computed.clear()
        loss, grads = attention_step(layers, x, rope)
        assert torch.equal(loss, reference[0]) and all(torch.equal(a, b) for a, b in zip(grads, reference[1]))
        assert len(computed) == 6  # the forward's 5, and the last block's recompute (its input is not offloaded)
        assert (offload.offloaded, offload.kept) == (4 * (step + 1), 4 * (step + 1))


def test_a_forward_that_saves_nothing_keeps_no_attention_output():
    layers, offload = attention_model(3, kept=True)
    x, rope = inputs("cpu", torch.float64)
    with torch.no_grad():
        h = x
        for layer in layers:
            h = layer(h, rope)
    assert (offload.offloaded, offload.kept) == (0, 0)
    loss, grads = attention_step(layers, x, rope)  # then a step keeps its own
    assert offload.kept == 2


def test_offload_attention_needs_offload_inputs_and_causal_attention():
    with pytest.raises(ConfigError) as e:
        load_job_config(["--job.config_file", str(DEBUG), "--activation_checkpoint.mode", "full",
                         "--activation_checkpoint.offload_attention"])
    assert str(e.value) == ("[activation_checkpoint] offload_attention = true sends the attention's outputs to host "
                            "memory with each block's input: it needs offload_inputs = true")
    with pytest.raises(ConfigError, match=r"it needs \[data\] attention = 'causal' \(got 'document'\)"):
        load_job_config(["--job.config_file", str(DEBUG), "--activation_checkpoint.mode", "full",
                         "--activation_checkpoint.offload_inputs", "--activation_checkpoint.offload_attention",
                         "--data.attention", "document", "--training.dataset", "shards"])


@pytest.mark.gpu
def test_on_a_gpu_the_recompute_takes_the_first_forward_s_bits_with_every_copy_slowed(monkeypatch):
    # 8 bf16 blocks of Qwen3's attention shape (32 query heads, 4 KV heads of 128, 2 x 2048 tokens), each copy to and
    # from host memory slowed by a spin on the offload stream, the GPU kept behind the host: what each recompute
    # takes is, when the compute stream reads it, the bits its block's forward made (no copy read before it
    # lands, no tensor reused while a copy reads it); attention's forward runs once a block and again for the last
    # block alone; the loss is the same bits and the gradients those of a step that computes attention again, up to
    # cuDNN's backward, which accumulates dq in fp32 with atomics (not the same bits run to run).
    from torchtitan_moe.ops import attention as attention_module

    for name in ("_copy_out", "_bring_back"):
        def slowed(self, saved, *rest, original=getattr(offload_module.InputOffload, name)):
            with torch.cuda.stream(self.stream()):
                torch.cuda._sleep(20_000_000)
            return original(self, saved, *rest)
        monkeypatch.setattr(offload_module.InputOffload, name, slowed)
    made, taken = [], []
    keep, take = offload_module.InputOffload.keep, offload_module.InputOffload.take
    def recorded_keep(self, out, lse):
        if self._running is not None:  # blocks 0-6: cloned on the compute stream, in its order
            made.append((out.clone(), lse.clone()))
        keep(self, out, lse)
    def checked_take(self, q):
        kept = take(self, q)
        if kept is not None:
            taken.append(all(torch.equal(a, b) for a, b in zip(kept, made.pop())))
        return kept
    monkeypatch.setattr(offload_module.InputOffload, "keep", recorded_keep)
    monkeypatch.setattr(offload_module.InputOffload, "take", checked_take)
    computed = []
    compute = attention_module._compute
    monkeypatch.setattr(attention_module, "_compute", lambda *a: computed.append(1) or compute(*a))
    registered, unregistered, cudart = [], [], torch.cuda.cudart()  # pointers registered, unregistered: successes
    class Calls:
        def __getattr__(self, name):
            return getattr(cudart, name)
        def cudaHostRegister(self, ptr, size, flags):
            code = cudart.cudaHostRegister(ptr, size, flags)
            registered.extend([ptr] if int(code) == 0 else [])
            return code
        def cudaHostUnregister(self, ptr):
            code = cudart.cudaHostUnregister(ptr)
            unregistered.extend([ptr] if int(code) == 0 else [])
            return code
    monkeypatch.setattr(torch.cuda, "cudart", Calls)
    sizes = dict(dim=4096, heads=32, groups=4, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 2048, 4096, generator=g).cuda().bfloat16().requires_grad_()
    rope = torch.randn(4096, generator=g).cuda().bfloat16()
    results = []
    for kept in (False, False, True):  # attention computed again (twice: cuDNN's spread), then kept
        layers, offload = attention_model(8, kept=kept, **sizes)
        layers.cuda()
        for step in range(2):
            computed.clear()
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)
            result = attention_step(layers, x, rope)
            assert len(computed) == (9 if kept else 16)
        results.append(result)
        del layers
    assert taken == [True] * 14  # blocks 0-6, two steps
    # blocks 0-6's input, out and lse, exactly their size, page-locked (tensor.is_pinned asks torch's own pinned
    # allocator only: the registrations are read from the calls)
    buffers = offload._memory._buffers
    assert {tuple(t.shape) for t in buffers.values()} == {(2, 2048, 4096), (2, 32, 2048, 128), (2, 32, 2048)}
    pointers = sorted(ptr for _, ptr in offload._memory._pinned.values())
    assert len(pointers) == len(buffers) == 21 and sorted(registered) == pointers
    (loss, grads), (_, again), (kept_loss, kept_grads) = results
    assert torch.equal(loss, kept_loss)
    difference = lambda x, y: [(a.float() - b.float()).abs().max().item() for a, b in zip(x, y)]
    spread, kept_off = difference(grads, again), difference(grads, kept_grads)
    largest = [a.float().abs().max().item() for a in grads]
    assert all(d <= 4 * s + 2**-8 * m for d, s, m in zip(kept_off, spread, largest)), (kept_off, spread, largest)
    # once the model goes, its host pages are unregistered (freed registered pages would stay registered)
    del offload, buffers
    gc.collect()
    assert sorted(unregistered) == pointers
