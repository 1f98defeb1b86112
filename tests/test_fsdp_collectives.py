"""FSDP2's collectives through our transports ([parallelism] fsdp_collectives, parallel/fsdp_collectives.py).

On CPU (2 gloo ranks) the comm objects run over CollectiveTransport: FSDP2's bf16 all-gathers and fp32
reduce-scatters through them give the same gradients, bit for bit, as FSDP2's own collectives, for parameters
split evenly and unevenly (FSDP2 pads). On 2 GPUs the copy engines (PeerMemoryTransport) train the debug model
to the same losses and grad norms as NCCL, bit for bit. And where 'copy_engines' cannot run, one error."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import init_device_mesh

from spawn_ranks import rank_group, run_ranks
from test_all_gather import ROOT, two_gpus
from torchtitan_moe.config import ConfigError
from torchtitan_moe.dispatch.peer_memory import CollectiveTransport
from torchtitan_moe.parallel import fsdp_collectives
from torchtitan_moe.parity import main as parity


class CountingTransport(CollectiveTransport):
    def __init__(self, group):
        super().__init__(group)
        self.calls = {"all_gather": 0, "reduce_scatter": 0}

    def all_gather_into(self, out, part):
        self.calls["all_gather"] += 1
        super().all_gather_into(out, part)

    def reduce_scatter_into(self, out, t):
        self.calls["reduce_scatter"] += 1
        super().reduce_scatter_into(out, t)


def train_worker(rank, world, port, failures):
    with rank_group(rank, world, port, failures):
        mesh = init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        grads, params = {}, {}
        for custom in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 7))  # 33, 7 rows: FSDP2 pads
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
            transport = CountingTransport(dist.group.WORLD)
            if custom:
                assert fsdp_collectives.install(model, transport) == 3
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            torch.manual_seed(1 + rank)  # each rank its own batch: the sums over ranks matter
            for _ in range(2):
                optimizer.zero_grad()
                model(torch.randn(5, 16)).float().square().sum().backward()
                optimizer.step()
            grads[custom] = [p.grad.to_local().clone() for p in model.parameters()]
            params[custom] = [p.to_local().detach().clone() for p in model.parameters()]
            if custom:  # FSDP2 went through the transport: a step gathers the two layers for forward and again
                # for backward (resharded after forward) and reduce-scatters both (the root holds no parameter)
                assert transport.calls == {"all_gather": 8, "reduce_scatter": 4}, transport.calls
        for a, b in zip(grads[False] + params[False], grads[True] + params[True]):
            assert torch.equal(a, b)


def test_fsdp_through_the_transport_matches_fsdp_collectives():
    run_ranks(train_worker, 2)


def refuse_worker(rank, world, port, failures):
    with rank_group(rank, world, port, failures):
        mesh = init_device_mesh("cpu", (world,))
        with pytest.raises(ConfigError, match=r"\[parallelism\] fsdp_collectives = 'copy_engines' moves FSDP2's "
                                              r"collectives between CUDA GPUs, this run is on cpu: use 'default'"):
            fsdp_collectives.use_copy_engines(nn.Linear(2, 2), mesh)


def test_copy_engines_refuse_cpu():
    run_ranks(refuse_worker, 2)


def test_reduce_scatter_refuses_other_ops():
    _, reduce_scatter = fsdp_collectives.make_comms(transport=None)
    with pytest.raises(ValueError, match="sums gradients only"):
        reduce_scatter(torch.zeros(2), torch.zeros(4), None, dist.ReduceOp.AVG)


@pytest.mark.gpu
@two_gpus
def test_training_with_fsdp_on_copy_engines_matches_nccl_on_gpus(tmp_path):
    code = parity([str(ROOT / "configs" / "debug.toml"), "--vary", "parallelism.fsdp_collectives=default,copy_engines",
                   "--steps", "6", "--nproc", "2", "--out", str(tmp_path), "--no-plot", "--one-launch", "--",
                   "--parallelism.expert_parallel_degree", "2", "--training.mixed_precision_param", "bfloat16",
                   "--kernels.backend", "triton", "--dispatch.backend", "all_gather"])
    report = (tmp_path / "parity.md").read_text()
    print(report)
    assert code == 0, report
    assert "| fsdp_collectives=copy_engines | 0.00e+00 | 0.00e+00 | 0.00e+00 | 0.00e+00 | = | ok |" in report, report
