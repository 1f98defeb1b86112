"""Several training runs in one torchrun launch (CPU test time goes to process start-up, not steps).

    torchrun --standalone --nproc_per_node=2 tests/resume_harness.py PLAN.json

PLAN.json is a list of operations that every rank runs in order:
    {"train": [override, ...]}                 configs/debug.toml + overrides, as `python -m torchtitan_moe.train`
                                               (+ "data_of_ranks": N: one process reads, each step, the batches
                                               of N data-parallel ranks side by side: N ranks' tokens at once)
    {"refused": [override, ...], "out": path}  a run that must stop with a CheckpointError; rank 0 writes the line
    {"diverged": [override, ...], "out": path} a run that must stop with a NonFiniteError; rank 0 writes the line
    {"copy": [src, dst]}                       rank 0 copies a folder (a step folder into another run's)
    {"prepare": [input, ...], "out": folder}   rank 0 tokenizes the inputs into token shards (bytes tokenizer)
    {"to_hf": [step_folder, out]}              rank 0 runs `convert to-hf --dtype float32 --drop-expert-bias`
    {"split_rows": out}                        the Hugging Face adapter on experts whose rows two ranks split
    {"train": [...], "experts": path}          also: rank 0 writes where layer 0's experts live after each step
                                               (+ "experts_in_fsdp": true: under FSDP2 even where their group
                                               has one rank, as before they stayed outside it)
    {"train": [...], "clip": "torchtitan"}       with torchtitan's clip_grad_norm_ (a multiply of the gradients)
                                               instead of ours (the clipping inside the optimizer's update)
    {"train": [...], "batches": N}             the data runs out after N batches (torchtitan ends the run there)
    {"train": [...], "order": path}            rank 0 writes, in order, each optimizer step ["step", N] and each
                                               step line ["line", N] (with "batches" too)
    {"train": [...], "slow_step": [N, S]}      step N's optimizer step takes S seconds longer (a sleep)
    {"train": [...], "data_workers": path}     rank 0 writes the exit codes of the run's data worker processes
                                               once the run is over (0: stopped when told; None: still running)
    {"stale": [...], "out": path}              a run whose layer 0 w2 working copy is changed after step 2's
                                               update, which must stop; rank 0 writes the error
    {"train": [...], "step": "torchtitan"}       with torchtitan's Trainer.train_step (host syncs at its start)
                                               instead of ours (train/step.py)
    {"host_syncs": [override, ...], "out": path}  a 4-step run; rank 0 writes the host syncs of each training
                                               step that reads no log back (steps 3 and 4) as a JSON list
An op with "log": PREFIX writes its output (every rank's) to PREFIX.out and PREFIX.err instead.
Each run is torchtitan's Trainer (our MoETrainer) from scratch; only the process group is shared
(torchtitan_moe/tools/train_runs.py, which `python -m torchtitan_moe.tools.parity --one-launch` uses too).
Tests launch a plan with `spawn_ranks.launch_plan`.
"""

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchtitan_moe.components.data import stop_workers
from torchtitan_moe.components.data.prepare import prepare
from torchtitan_moe.hf import convert

from torchtitan_moe.tools import train_runs
from torchtitan_moe.train.checkpoint import CheckpointError
from torchtitan_moe.train.divergence import NonFiniteError
from torchtitan_moe.compat.torchtitan import DataloaderExhaustedError, Trainer, replace_clip_grad_norm
from torchtitan_moe.tools.train_runs import shared_group

DEBUG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")


def train(overrides: list[str], adapt=None) -> None:
    """A run of the debug config from scratch (train_runs.train); `adapt(trainer)` changes it first."""
    train_runs.train(["--job.config_file", DEBUG, "--metrics.disable_color_printing", *overrides], adapt)


class RanksSideBySide:
    """The batches `loaders` (one per data-parallel rank) give, concatenated along the batch: one
    process then trains on the global batch that len(loaders) ranks would."""

    dp_world_size = 1  # this process is the only data-parallel rank (what the trainer's checks read)

    def __init__(self, loaders):
        self.loaders = loaders

    def __iter__(self):
        for batches in zip(*self.loaders):
            inputs = {k: torch.cat([b[0][k] for b in batches]) for k in batches[0][0]}
            yield inputs, torch.cat([b[1] for b in batches])


def data_of_ranks(n: int):
    """adapt(trainer) for `train`: a one-process run that reads the data of n data-parallel ranks."""

    def adapt(trainer) -> None:
        assert dist.get_world_size() == 1, "data_of_ranks is a one-process reference"
        build = trainer.train_spec.build_dataloader_fn
        loaders = [build(dp_world_size=n, dp_rank=r, tokenizer=trainer.tokenizer, job_config=trainer.job_config)
                   for r in range(n)]
        trainer.dataloader = RanksSideBySide(loaders)
        close = trainer.close

        def close_all() -> None:  # the trainer stops its own loader's workers, not these (5 s each otherwise)
            for loader in loaders:
                stop_workers(loader)
            close()

        trainer.close = close_all

    return adapt


def torchtitans_clip(trainer) -> None:
    """adapt(trainer) for `train`: torchtitan's own gradient clipping, as before clip_in_optimizer."""
    replace_clip_grad_norm(lambda torchtitan_clip: torchtitan_clip)


def torchtitans_step(trainer) -> None:
    """adapt(trainer) for `train`: torchtitan's own train step (with its host syncs), as before train/step.py."""

    def step(data_iterator):
        trainer._local_losses = []
        Trainer.train_step(trainer, data_iterator)

    trainer.train_step = step


def batches(n: int):
    """adapt(trainer) for `train`: the data runs out after n batches, as a finite dataset's does."""

    def adapt(trainer) -> None:
        generate = trainer.batch_generator

        def limited(data_iterable):
            for i, batch in enumerate(generate(data_iterable)):
                if i == n:
                    raise DataloaderExhaustedError()
                yield batch

        trainer.batch_generator = limited

    return adapt


def record_order(out: str):
    """adapt(trainer) for `train`: rank 0 writes each optimizer step and each step line to `out`, in order."""

    def adapt(trainer) -> None:
        events = []
        step, log = trainer.optimizers.step, trainer.metrics_processor.log

        def record(event):
            events.append(event)
            if dist.get_rank() == 0:
                Path(out).write_text(json.dumps(events))

        def stepped(*args, **kwargs):
            step(*args, **kwargs)
            record(["step", trainer.step])

        def logged(step_logged, *args, **kwargs):
            record(["line", step_logged])
            log(step_logged, *args, **kwargs)

        trainer.optimizers.step, trainer.metrics_processor.log = stepped, logged

    return adapt


def slow_step(step_slowed: int, seconds: float):
    """adapt(trainer) for `train`: step `step_slowed`'s optimizer step sleeps `seconds` first."""

    def adapt(trainer) -> None:
        step = trainer.optimizers.step

        def slowed(*args, **kwargs):
            if trainer.step == step_slowed:
                time.sleep(seconds)
            step(*args, **kwargs)

        trainer.optimizers.step = slowed

    return adapt


def stale(overrides: list[str], out: str) -> None:
    """A run whose layer 0 w2 working copy is changed after step 2's optimizer step, behind the update's back."""
    from torchtitan_moe.moe.experts import GroupedExperts

    def corrupt_after_step_2(trainer) -> None:
        step = trainer.optimizers.step

        def stepped(*args, **kwargs):
            step(*args, **kwargs)
            if trainer.step == 2:
                experts = next(m for m in trainer.model_parts[0].modules() if isinstance(m, GroupedExperts))
                with torch.no_grad():
                    experts.working["w2"].view(-1)[0] += 1

        trainer.optimizers.step = stepped

    try:
        train(overrides, corrupt_after_step_2)
    except RuntimeError as e:
        if dist.get_rank() == 0:
            Path(out).write_text(str(e))
        return
    raise AssertionError(f"the run {overrides} trained on with a stale working copy")


def host_syncs(overrides: list[str], out: str) -> None:
    """Count the host syncs (tests/host_reads.py) inside each train_step that does not log."""
    from host_reads import HostSyncs

    counts = []

    def count_steps(trainer) -> None:
        step = trainer.train_step

        def counted(data_iterator):
            # Step 1 logs: it launches what its line reads, and step 2 reads it back once it is queued.
            if trainer.metrics_processor.should_log(trainer.step) or trainer.pending_log is not None:
                return step(data_iterator)
            # The batches first: the synthetic stream is made on the host (a GPU run's loader too).
            batches = iter([next(data_iterator) for _ in range(trainer.gradient_accumulation_steps)])
            with HostSyncs(cuda=torch.cuda.is_available()) as syncs:
                step(batches)
            counts.append(syncs.count)
            if syncs.syncs:
                print(f"rank {dist.get_rank()} step {trainer.step}: host syncs at {syncs.syncs}", file=sys.stderr)

        trainer.train_step = counted

    train(["--training.steps", "4", "--metrics.log_freq", "100", "--checks.monitor_freq", "0", *overrides], count_steps)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(counts))


def refused(overrides: list[str], out: str, error: type[BaseException] = CheckpointError) -> None:
    try:
        train(overrides)
    except error as e:
        if dist.get_rank() == 0:
            Path(out).write_text(str(e))
        return
    raise AssertionError(f"the run {overrides} was not stopped by a {error.__name__}")


def train_recording_experts(overrides: list[str], out: str, in_fsdp: bool) -> None:
    """A run that records, after each step, whether layer 0's experts are an FSDP2 module and the
    mesh and dtypes of their weight and gradient; `in_fsdp` puts them under FSDP2 in every layout."""
    from torch.distributed.fsdp import FSDPModule

    from torchtitan_moe.models.qwen3_moe import parallelize

    seen = []

    def record(trainer) -> None:
        step = trainer.train_step

        def recorded(data_iterator):
            step(data_iterator)
            experts = trainer.model_parts[0].layers["0"].moe.experts
            seen.append({"fsdp": isinstance(experts, FSDPModule), "mesh": list(experts.w13.device_mesh.mesh_dim_names),
                         "weight": str(experts.w13.dtype), "grad": str(experts.w13.grad.dtype)})

        trainer.train_step = recorded

    outside = parallelize.experts_outside_fsdp
    parallelize.experts_outside_fsdp = (lambda mesh: False) if in_fsdp else outside
    try:
        train(overrides, record)
    finally:
        parallelize.experts_outside_fsdp = outside
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(seen))


def split_rows(out: str) -> None:
    """Experts fewer than expert-FSDP ranks: FSDP2 splits w13's rows (gate | up) over ranks.
    Here 2 ranks split the rows of 2 experts, as (Shard(1) on efsdp, Shard(0) on ep) of a 2 x 1 mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from torchtitan_moe.models.qwen3_moe import Qwen3MoEStateDictAdapter, flavor_args

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("efsdp", "ep"))
    args = flavor_args("debug")
    args.moe = dataclasses.replace(args.moe, num_experts=2, top_k=1)
    inter, dim = args.moe.inter_dim, args.dim
    g = torch.Generator().manual_seed(0)
    full = {"layers.0.moe.experts.w13": torch.randn(2, 2 * inter, dim, generator=g),
            "layers.0.moe.experts.w2": torch.randn(2, dim, inter, generator=g)}
    placements = [Shard(1), Shard(0)]
    sharded = {k: distribute_tensor(v, mesh, placements) for k, v in full.items()}
    adapter = Qwen3MoEStateDictAdapter(args)
    hf = adapter.to_hf(sharded)
    w13, w2 = full["layers.0.moe.experts.w13"], full["layers.0.moe.experts.w2"]
    expected = {}
    for e in range(2):
        prefix = f"model.layers.0.mlp.experts.{e}."
        expected |= {prefix + "gate_proj.weight": w13[e, :inter], prefix + "up_proj.weight": w13[e, inter:],
                     prefix + "down_proj.weight": w2[e]}
    to_hf_exact = sorted(hf) == sorted(expected) and all(hf[k].full_tensor().equal(v) for k, v in expected.items())
    back = adapter.from_hf(hf)
    round_trip_exact = all(back[k].placements == tuple(placements) and back[k].full_tensor().equal(v)
                           for k, v in full.items())
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"to_hf_exact": to_hf_exact, "round_trip_exact": round_trip_exact}))


def data_workers(overrides: list[str], out: str) -> None:
    """A run, then its data workers' exit codes: the trainer's close() must have stopped them (the
    loader kept here keeps its iterator, and so its workers, from the garbage collector)."""
    loaders = []
    train(overrides, lambda trainer: loaders.append(trainer.dataloader))
    workers = loaders[0]._iterator._workers
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps([w.exitcode for w in workers]))


def main(plan_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    with shared_group(["--job.config_file", DEBUG]):
        run_plan(plan)
    return 0


def run_plan(plan: list[dict]) -> None:
    for i, op in enumerate(plan):
        print(f"resume_harness: rank {dist.get_rank()} op {i}: {op}", flush=True)
        prefix = op.get("log")
        with train_runs.output_to(prefix and f"{prefix}.out", prefix and f"{prefix}.err"):
            if "train" in op and "experts" in op:
                train_recording_experts(op["train"], op["experts"], op.get("experts_in_fsdp", False))
            elif "train" in op and op.get("clip") == "torchtitan":
                train(op["train"], torchtitans_clip)
            elif "train" in op and op.get("step") == "torchtitan":
                train(op["train"], torchtitans_step)
            elif "train" in op and "data_workers" in op:
                data_workers(op["train"], op["data_workers"])
            elif "train" in op and ("batches" in op or "order" in op or "slow_step" in op):
                adapts = [*([batches(op["batches"])] if "batches" in op else []),
                          *([record_order(op["order"])] if "order" in op else []),
                          *([slow_step(*op["slow_step"])] if "slow_step" in op else [])]
                train(op["train"], lambda trainer: [adapt(trainer) for adapt in adapts])
            elif "train" in op:
                train(op["train"], data_of_ranks(op["data_of_ranks"]) if "data_of_ranks" in op else None)
            elif "stale" in op:
                stale(op["stale"], op["out"])
            elif "host_syncs" in op:
                host_syncs(op["host_syncs"], op["out"])
            elif "refused" in op:
                refused(op["refused"], op["out"])
            elif "diverged" in op:
                refused(op["diverged"], op["out"], NonFiniteError)
            elif dist.get_rank() == 0 and "prepare" in op:
                prepare(op["prepare"], op["out"], show_progress=False)
            elif dist.get_rank() == 0 and "copy" in op:
                shutil.copytree(*op["copy"])
            elif dist.get_rank() == 0 and "to_hf" in op:
                step, out = op["to_hf"]
                assert convert.main(["to-hf", step, out, "--dtype", "float32", "--drop-expert-bias"]) == 0
            elif "split_rows" in op:
                split_rows(op["split_rows"])
        dist.barrier()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
