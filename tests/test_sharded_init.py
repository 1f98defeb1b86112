"""Sharded init: the debug model's initial weights on 2 gloo ranks (FSDP2, and EP = 2) equal a
single process's from the same seed, and no two experts or gate rows are clones."""

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

from torchtitan_moe.models.sharded_init import full_tensors

ROOT = Path(__file__).resolve().parents[1]
DEBUG = ROOT / "configs" / "debug.toml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_worker(rank: int, world: int, port: int, overrides: list[str], out: str, failures) -> None:
    """Build the trainer (which initializes the model) and save the full parameters from rank 0."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from torchtitan_moe.train import MoETrainer, prepare

    trainer = None
    try:
        config = prepare(["--job.config_file", str(DEBUG), "--job.dump_folder", str(Path(out).parent / "dump"),
                          "--checks.router_init", "off", *overrides])
        trainer = MoETrainer(config)
        full = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for name, p in trainer.model_parts[0].named_parameters()}
        if rank == 0:
            torch.save(full, out)
    except BaseException as e:
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def initial_weights(tmp_path: Path, world: int, *overrides: str) -> dict[str, torch.Tensor]:
    out = tmp_path / f"init_{world}_{'_'.join(overrides).replace('-', '')}.pt"
    failures = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(init_worker, args=(world, free_port(), list(overrides), str(out), failures), nprocs=world)
    except Exception:
        messages = []
        while not failures.empty():
            messages.append(failures.get())
        pytest.fail("\n".join(messages) or "a rank failed")
    return torch.load(out)


def assert_no_clones(weights: dict[str, torch.Tensor]) -> None:
    """No two experts' weights and no two gate rows are equal, in any layer."""
    checked = 0
    for name, w in weights.items():
        if name.endswith(("experts.w13", "experts.w2", "router.gate.weight")):
            rows = w.reshape(w.shape[0], -1)
            same = (rows[:, None, :] == rows[None, :, :]).all(dim=-1)
            pairs = same.triu(diagonal=1).nonzero().tolist()
            assert not pairs, f"{name}: rows {pairs} are equal"
            checked += 1
    assert checked == 12  # 4 layers x (w13, w2, gate)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks; the GPU tier checks NCCL ranks")
def test_two_rank_init_equals_one_rank_init(tmp_path):
    single = initial_weights(tmp_path, 1)
    assert_no_clones(single)
    for overrides in [(), ("--parallelism.expert_parallel_degree", "2")]:
        sharded = initial_weights(tmp_path, 2, *overrides)
        assert_no_clones(sharded)
        assert sharded.keys() == single.keys()
        for name in single:
            assert torch.equal(sharded[name], single[name]), f"{overrides}: {name} differs from the 1-rank init"


def full_tensors_worker(rank: int, world: int, port: int, failures) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        # a = -std, b = std: trunc_normal_ redraws most values, in a loop that runs until the
        # whole tensor is in bounds (one rank's shard is sooner).
        torch.manual_seed(7)
        expected = torch.nn.init.trunc_normal_(torch.empty(8, 6, 5), std=0.5, a=-0.5, b=0.5)
        after = torch.rand(3)
        for placement in (Shard(0), Shard(1)):
            module = torch.nn.Linear(5, 6)
            module.weight = torch.nn.Parameter(distribute_tensor(torch.empty(8, 6, 5), mesh, [placement]))
            torch.manual_seed(7)
            with full_tensors(module):
                assert not isinstance(module.weight, DTensor)
                torch.nn.init.trunc_normal_(module.weight, std=0.5, a=-0.5, b=0.5)
            assert isinstance(module.weight, DTensor) and module.weight.placements == (placement,)
            assert torch.equal(module.weight.full_tensor(), expected), placement
            assert torch.equal(torch.rand(3), after), "the generator is not where one process leaves it"
    except BaseException as e:
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        dist.destroy_process_group()


def test_full_tensors_gives_each_rank_its_slice_of_one_process_init():
    failures = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(full_tensors_worker, args=(2, free_port(), failures), nprocs=2)
    except Exception:
        messages = []
        while not failures.empty():
            messages.append(failures.get())
        pytest.fail("\n".join(messages) or "a rank failed")
