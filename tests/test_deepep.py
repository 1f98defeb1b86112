"""The DeepEP dispatcher's own: the same ExpertBatch as the all-to-all one, row for row; DeepEP called once
per exchange, its events waited for, nothing exchanged again by a checkpointed recompute; a handle kept with
its configs; the node and peer checks; training, the tuner and the benchmark end to end.

On the CPU a faithful fake of DeepEP v1's Buffer (tests/fakes/deep_ep) runs over gloo; on 2 GPUs
(marked gpu) the real deep_ep runs over NCCL. Against the local dispatcher, outputs and gradients, with
the others: tests/test_dispatchers.py.
"""

import importlib.util
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from spawn_ranks import rank_group, run_ranks
from torchtitan_moe.dispatch.all_to_all import AllToAllDispatcher
from torchtitan_moe.dispatch.deepep import DeepEPDispatcher
from torchtitan_moe.dispatch.deepep_backend import (
    DeepEPSettings,
    DeepEPUnavailable,
    DeepEPV1,
    check_group,
    default_settings,
    release_buffers,
)
from torchtitan_moe.moe import MoE, MoEArgs, RouterOptions

ROOT = Path(__file__).resolve().parents[1]
FAKES = ROOT / "tests" / "fakes"
DIM, EXPERTS, TOP_K, INTER = 128, 8, 3, 32


def load_fake_deep_ep():
    spec = importlib.util.spec_from_file_location("deep_ep", FAKES / "deep_ep" / "__init__.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_layer(padding: str, zero_gate: bool, rank: int, world: int, device) -> MoE:
    """The same weights on every rank; this rank's expert shard in bf16, the router in fp32."""
    torch.manual_seed(0)
    layer = MoE(MoEArgs(num_experts=EXPERTS, top_k=TOP_K, inter_dim=INTER, padding=padding, kernels="torch",
                        router=RouterOptions(init_std=0.0 if zero_gate else 0.5, bias_update_rate=0.0)), DIM)
    layer.init_weights(out_std=0.1)
    local = EXPERTS // world
    mine = slice(rank * local, (rank + 1) * local)
    for name in ("w13", "w2"):
        setattr(layer.experts, name, torch.nn.Parameter(getattr(layer.experts, name).detach()[mine].to(torch.bfloat16)))
    return layer.to(device)


def forward_backward(layer: MoE, x: torch.Tensor, grad: torch.Tensor, use_checkpoint: bool = False):
    x = x.clone().requires_grad_()
    out = checkpoint(layer, x, use_reentrant=False) if use_checkpoint else layer(x)
    out.backward(grad)
    return out.detach(), x.grad, layer.router.gate.weight.grad, layer.experts.w13.grad, layer.experts.w2.grad


def count_calls(backend) -> Counter:
    calls: Counter = Counter()
    for name in ("dispatch", "dispatch_again", "combine", "start_combine"):
        def counted(*args, _method=getattr(backend, name), _name=name, **kwargs):
            calls[_name] += 1
            return _method(*args, **kwargs)

        setattr(backend, name, counted)
    return calls


def count_waits() -> list:
    """Count the waits on the fake's events (one entry per wait)."""
    handle = sys.modules["deep_ep"].EventHandle
    waits: list = []
    handle.current_stream_wait = lambda self: waits.append(1)
    return waits


def run_case(rank: int, world: int, device, kernels: str, padding: str, case: str) -> None:
    zero_gate = case == "zero_gate"  # every token to the same 3 experts: other ranks receive nothing
    torch.manual_seed(100 + rank)  # other tokens on every rank
    x = torch.randn(2, 7, DIM, device=device, dtype=torch.bfloat16)
    grad = torch.randn(2, 7, DIM, device=device, dtype=torch.bfloat16)
    group = dist.group.WORLD

    a2a_layer = make_layer(padding, zero_gate, rank, world, device)
    kernels_align = a2a_layer.dispatch_settings(device)[1]
    a2a = AllToAllDispatcher(EXPERTS, group, align=kernels_align, kernels=kernels)
    a2a_layer.set_dispatcher(a2a)
    deepep_layer = make_layer(padding, zero_gate, rank, world, device)
    backend = DeepEPV1(group, default_settings(world), DIM)
    buffers = "worst_case" if case.startswith("worst_case") else "exact"
    deepep = DeepEPDispatcher(EXPERTS, backend, align=kernels_align, kernels=kernels, buffers=buffers)
    deepep_layer.set_dispatcher(deepep)

    # The ExpertBatch, row for row: same rows in the same order (pure data movement).
    tokens = x.reshape(-1, DIM)
    with torch.no_grad():
        routing = a2a_layer.router(tokens)
        expected, batch = a2a.start_dispatch(tokens, routing).wait(), deepep.start_dispatch(tokens, routing).wait()
    n = int(expected.num_rows)
    assert int(batch.num_rows) == n
    for field in ("offsets", "tokens_per_expert"):
        assert torch.equal(getattr(batch, field), getattr(expected, field)), field
    assert torch.equal(batch.x[:n], expected.x[:n]) and torch.equal(batch.probs[:n], expected.probs[:n])
    if zero_gate:  # the test covers ranks that receive nothing (pad rows only, when aligned)
        received = batch.tokens_per_expert.sum().reshape(1)
        dist.all_reduce(received, op=dist.ReduceOp.MIN)
        assert int(received) == 0

    # The layer, forward and backward.
    calls = count_calls(backend)
    deepep.keep_exchanges = case.endswith("checkpoint")
    waits = count_waits() if "deep_ep" in sys.modules and hasattr(sys.modules["deep_ep"], "EventHandle") else None
    forward_backward(deepep_layer, x, grad, use_checkpoint=case.endswith("checkpoint"))
    # Forward: dispatch, combine (both started on DeepEP's stream); backward: dispatch with the
    # handle, combine. The recompute of a checkpointed block replays both results.
    assert calls == Counter(dispatch=1, start_combine=1, combine=1, dispatch_again=1), calls
    if waits is not None:  # the fake: the forward waited for both events (the recompute for the kept one)
        assert waits == [1, 1] + [1] * case.endswith("checkpoint"), waits
    assert not deepep._kept

    # A handle keeps its configs: a backend of another num_sms combines it with them; DeepEP
    # itself refuses the handle with a config of another num_sms.
    other = DeepEPV1(group, DeepEPSettings(16, 8, 4), DIM)
    d = backend.dispatch(tokens, routing.experts, routing.probs, EXPERTS)
    out, _ = other.combine(d.x, d.handle)
    assert out.shape == tokens.shape
    with pytest.raises(Exception):
        other.buffer.combine(d.x, d.handle.raw, config=other.combine_config)


def worker(rank: int, world: int, port: int, mode: str, padding: str, case: str, failures) -> None:
    # The rank processes are pooled across tests: one that ran a fake case still holds the fake
    # module, which a GPU case must not get (the GPU tier runs the fake cases first).
    sys.modules.pop("deep_ep", None)
    if mode == "fake":
        sys.modules["deep_ep"] = load_fake_deep_ep()
        device, kernels, backend, init = torch.device("cpu"), "torch", "gloo", {}
    else:
        import deep_ep

        assert not Path(deep_ep.__file__).is_relative_to(FAKES), f"the GPU cases got the fake deep_ep ({deep_ep.__file__})"
        torch.cuda.set_device(rank)
        device, kernels = torch.device("cuda", rank), "triton"
        backend, init = "nccl", {"device_id": device}
    with rank_group(rank, world, port, failures, backend, **init):
        if case == "errors":
            run_error_checks(rank)
        else:
            run_case(rank, world, device, kernels, padding, case)
        release_buffers()


def run_error_checks(rank: int) -> None:
    """EP across nodes and GPUs without peer access stop with one line (collective checks)."""
    real_host = socket.gethostname
    socket.gethostname = lambda: f"node{rank}"
    with pytest.raises(DeepEPUnavailable, match=r"the EP group spans nodes node0, node1 .*LOCAL_WORLD_SIZE"):
        check_group(dist.group.WORLD)
    socket.gethostname = real_host
    cuda = (torch.cuda.is_available, torch.cuda.current_device, torch.cuda.can_device_access_peer)
    torch.cuda.is_available, torch.cuda.current_device = (lambda: True), (lambda: rank)
    torch.cuda.can_device_access_peer = lambda a, b: False
    try:
        with pytest.raises(DeepEPUnavailable, match=rf"GPU {rank} cannot access GPU {1 - rank} .*peer access"):
            check_group(dist.group.WORLD)
    finally:
        torch.cuda.is_available, torch.cuda.current_device, torch.cuda.can_device_access_peer = cuda
    check_group(dist.group.WORLD)  # one host, no GPUs to check: passes



def spawn(world: int, mode: str, padding: str, case: str) -> None:
    run_ranks(worker, world, mode, padding, case)


@pytest.mark.parametrize(
    "padding, case",
    [
        ("none", "random"),
        ("always", "zero_gate"),  # rank 1 receives nothing; 5 of 8 experts get no tokens
        ("always", "checkpoint"),  # activation checkpointing replays the exchanges
        ("always", "worst_case"),  # num_worst_tokens: no host sync, undefined rows past the received
        ("none", "worst_case_checkpoint"),
    ],
)
def test_deepep_lays_out_all_to_alls_rows_on_fake_deep_ep(padding, case):
    spawn(2, "fake", padding, case)


def test_node_and_peer_checks():
    spawn(2, "fake", "none", "errors")


def deep_ep_is_installed() -> bool:
    try:
        return importlib.util.find_spec("deep_ep") is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2 or not deep_ep_is_installed(), reason="needs 2 GPUs and deep_ep")
@pytest.mark.parametrize(
    "padding, case",
    [("none", "random"), ("always", "zero_gate"), ("always", "checkpoint"), ("always", "worst_case"),
     ("none", "worst_case_checkpoint")],  # zero_gate: rank 1 receives nothing
)
def test_deepep_lays_out_all_to_alls_rows_on_gpus(padding, case):
    spawn(2, "nccl", padding, case)


# -- end to end on the CPU: training, the tuner and the benchmark with the fake on PYTHONPATH ----

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo runs with the fake deep_ep")


def with_fake_on_path(monkeypatch) -> dict:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAKES), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def torchrun(*args: str, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@cpu_only
def test_training_with_deepep_matches_all_to_all_under_checkpointing(parity_out, monkeypatch, forked_launches):
    # bf16 FSDP2 mixed precision, EP = 2, full activation checkpointing: the same losses to the bit.
    from torchtitan_moe.tools.parity import main as parity

    with_fake_on_path(monkeypatch)
    code = parity([str(ROOT / "configs" / "debug.toml"), "--vary", "dispatch.backend=all_to_all,deepep",
                   "--steps", "4", "--nproc", "2", "--out", str(parity_out), "--no-plot", "--one-launch", "--",
                   "--parallelism.expert_parallel_degree", "2", "--training.mixed_precision_param", "bfloat16",
                   "--activation_checkpoint.mode", "full"])
    report = (parity_out / "parity.md").read_text()
    assert code == 0, report
    assert "| backend=deepep | 0.00e+00 | 0.00e+00 | 0.00e+00 | 0.00e+00 | = | ok |" in report, report  # aux: balance loss
    assert "[dispatch] deepep: DeepEP's defaults, 24 SMs" in (parity_out / "backenddeepep.log").read_text()


@pytest.mark.slow
@cpu_only
def test_deepep_without_deep_ep_stops_training_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = torchrun("-m", "torchtitan_moe.train", "--job.config_file", str(ROOT / "configs" / "debug.toml"),
                      "--job.dump_folder", str(tmp_path), "--parallelism.expert_parallel_degree", "2",
                      "--dispatch.backend", "deepep", "--training.mixed_precision_param", "bfloat16", env=env)
    assert result.returncode != 0
    errors = {line for line in result.stderr.splitlines() if "config error:" in line}
    assert len(errors) >= 1 and all("[dispatch] backend = 'deepep': the deep_ep package cannot be imported" in e
                                    and "scripts/install_deepep.sh" in e for e in errors), result.stderr[-3000:]
    assert "step:" not in result.stdout


@pytest.mark.slow
@cpu_only
def test_tune_dispatch_writes_an_entry_that_auto_reads_and_the_bench_runs(tmp_path, monkeypatch):
    from torchtitan_moe.parallel import tuned

    env = with_fake_on_path(monkeypatch)
    out = tmp_path / "dispatch.json"
    result = torchrun("-m", "torchtitan_moe.tools.tune_dispatch", str(ROOT / "configs" / "debug.toml"), "--out", str(out),
                      "--num-sms", "2,4", "--dispatch-chunks", "4", "--combine-chunks", "2", "--warmup", "1",
                      "--iters", "2", "--training.local_batch_size", "2", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "| deepep | 4 |" in result.stdout and "| all_gather | - |" in result.stdout and "15/15" in result.stderr
    assert "fastest by (b) head to head, in turn:" in result.stdout
    (index, entry), = [tuned.match(tuned.load(str(out)), tuned.Shape("cpu", 2, 128, 2, 8, 256))]
    assert entry.best in ("deepep", "all_to_all", "all_gather") and entry.deepep.num_sms in (2, 4)
    assert set(entry.layer_ms) == set(entry.dispatch_combine_ms) == {"deepep", "all_to_all", "all_gather"}
    assert entry.best == min(entry.layer_ms, key=entry.layer_ms.get)  # the head-to-head times decide

    result = torchrun("kernels/bench_dispatch.py", "--ep", "2", "--tokens", "256", "--dim", "128", "--experts", "8",
                      "--top-k", "2", "--warmup", "1", "--iters", "2", "--tuned-file", str(out), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| 2 | deepep")]
    assert len(rows) == 2 and all("n/a" not in row for row in rows), result.stdout


def test_install_script_refuses_a_tree_that_is_not_deepep_v1(tmp_path):
    result = subprocess.run(["bash", str(ROOT / "scripts" / "install_deepep.sh"), str(tmp_path)], capture_output=True,
                            text=True, env=dict(os.environ, PYTHON=sys.executable))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"install_deepep: {tmp_path} is not a DeepEP v1 source tree (no setup.py or "
                                     "deep_ep/buffer.py); use commit 567632dd59810d77b3cc05553df953cc0f779799")
