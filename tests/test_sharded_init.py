"""Sharded init and the first gradients: on 2 gloo ranks (FSDP2, and EP = 2 with all-to-all) the
debug model's initial weights equal a single process's from the same seed, no two experts or
gate rows are clones, and the gradients of one batch split over the ranks equal the single
process's gradients of the whole batch (FSDP sums, EP exchanges, nothing halved or doubled)."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh

from numerics import assert_close_to_max
from spawn_ranks import rank_group, run_ranks
from torchtitan_moe.models.sharded_init import full_tensors

ROOT = Path(__file__).resolve().parents[1]
DEBUG = ROOT / "configs" / "debug.toml"
BATCH, SEQ = 4, 32  # the global batch, split over the ranks by sequence


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()



def init_worker(rank: int, world: int, port: int, overrides: list[str], out: str, failures) -> None:
    """Build the trainer (which initializes the model), run one forward/backward on this rank's
    share of a fixed batch, and save the full parameters and gradients from rank 0."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from torchtitan_moe.train.trainer import MoETrainer, prepare

    trainer = None
    try:
        config = prepare(["--job.config_file", str(DEBUG), "--job.dump_folder", str(Path(out).parent / "dump"),
                          "--checks.router_init", "off", *overrides])
        trainer = MoETrainer(config)
        model = trainer.model_parts[0]
        params = {name: full(p) for name, p in model.named_parameters()}
        tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
        mine = tokens[rank * BATCH // world : (rank + 1) * BATCH // world].to(trainer.device)
        logits = model(mine[:, :-1])
        # Summed over this rank's tokens, divided by the global count (as torchtitan's loss is):
        # FSDP's summed gradients are then those of the whole batch's mean.
        loss = F.cross_entropy(logits.flatten(0, 1).float(), mine[:, 1:].flatten(), reduction="sum") / (BATCH * SEQ)
        loss.backward()
        grads = {name: full(p.grad) for name, p in model.named_parameters()}
        if rank == 0:
            by_rows = isinstance(model.tok_embeddings.weight, DTensor) and not isinstance(model.tok_embeddings, FSDPModule)
            router = next(iter(model.layers.values())).moe.router
            gate_rows = isinstance(router.gate.weight, DTensor) and not isinstance(router, FSDPModule)
            torch.save({"params": params, "grads": grads, "embedding_by_rows": by_rows, "gate_rows": gate_rows}, out)
    except BaseException as e:
        failures.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def first_step(tmp_path: Path, world: int, *overrides: str) -> dict[str, dict[str, torch.Tensor]]:
    out = tmp_path / f"init_{world}_{'_'.join(overrides).replace('-', '')}.pt"
    run_ranks(init_worker, world, list(overrides), str(out))
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
@pytest.mark.skipif(torch.cuda.is_available(), reason="gloo ranks; the GPU test below takes NCCL ranks")
def test_two_rank_init_and_gradients_equal_one_rank(tmp_path):
    check_first_step(tmp_path, grad_rel=1e-5)  # fp32 sums in another order


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="2-GPU init and gradients need 2 GPUs")
def test_two_gpu_init_and_gradients_equal_one_gpu(tmp_path):
    # cuBLAS picks its kernels by shape: half the batch is summed in other orders.
    check_first_step(tmp_path, grad_rel=1e-4)


def check_first_step(tmp_path: Path, grad_rel: float) -> None:
    single = first_step(tmp_path, 1)
    assert_no_clones(single["params"])
    for name, g in single["grads"].items():  # every parameter takes part: none is cut off the graph
        per_row = g.reshape(g.shape[0], -1).abs().amax(dim=1) if name.endswith(("w13", "w2")) else g.abs().max()
        assert (per_row > 0).all(), f"{name}: zero gradient"
    # [parallelism] embedding and router = "auto" shard the embedding and the gates by rows here (a 1-D FSDP
    # mesh); "fsdp" gathers them.
    for overrides in [(), ("--parallelism.embedding", "fsdp"), ("--parallelism.router", "fsdp"),
                      ("--parallelism.expert_parallel_degree", "2")]:
        sharded = first_step(tmp_path, 2, *overrides)
        assert sharded["embedding_by_rows"] is ("--parallelism.embedding" not in overrides), overrides
        assert sharded["gate_rows"] is ("--parallelism.router" not in overrides), overrides
        assert_no_clones(sharded["params"])
        assert sharded["params"].keys() == single["params"].keys()
        for name, expected in single["params"].items():
            assert torch.equal(sharded["params"][name], expected), f"{overrides}: {name} differs from the 1-rank init"
        for name, expected in single["grads"].items():
            assert_close_to_max(sharded["grads"][name], expected, grad_rel, f"{overrides}: grad {name}")


def full_tensors_worker(rank: int, world: int, port: int, failures) -> None:
    with rank_group(rank, world, port, failures):
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


def test_full_tensors_gives_each_rank_its_slice_of_one_process_init():
    run_ranks(full_tensors_worker, 2)
