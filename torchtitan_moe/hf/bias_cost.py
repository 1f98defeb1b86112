"""What exporting without the expert bias costs: a checkpoint against itself with every expert bias at zero.

Aux-loss-free balancing ([router] bias_update_rate > 0) trains an expert bias that picks experts (top-k over
scores + bias) without weighing them. Hugging Face's Qwen3-MoE has no such bias, so `convert to-hf
--drop-expert-bias` exports a model that picks by the scores alone. On held-out tokens this measures:

    loss_with, loss_without   mean cross-entropy (nats/token) of the model with its bias, and with it at zero
    changed_per_layer [L]     share of tokens whose set of top-k experts the bias decides in layer l: top-k of
                              scores + bias against top-k of the same scores (the trained model's hidden
                              states), so each layer's number is its own, not what earlier layers passed on

The checkpoint is read one part at a time (embedding, each block, norm and output), as `convert.to_hf`
writes it: memory is one block's weights plus two [tokens, dim] hidden states per batch (with and without
the bias), not the whole model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_moe.models.qwen3_moe.args import Qwen3MoEArgs
from torchtitan_moe.models.qwen3_moe.model import Qwen3MoEModel

IGNORE_INDEX = -100  # labels that score nothing (torch's and torchtitan's default)
# The synthetic stream's data-parallel rank that no training run reads: held-out walks on the run's chain.
HELD_OUT_RANK = -1
EVAL_ROWS = 8  # sequences per batch of an --eval-tokens file


@dataclass
class BiasCost:
    loss_with: float  # nats/token, the model as trained
    loss_without: float  # nats/token, every expert bias at zero (the Hugging Face export)
    tokens: int  # held-out tokens scored
    changed_per_layer: list[float]  # per MoE layer: share of tokens whose expert set the bias changes
    max_abs_bias: float

    @property
    def changed(self) -> float:
        """Share of (token, layer) pairs whose expert set the bias changes."""
        return sum(self.changed_per_layer) / len(self.changed_per_layer)

    def describe(self) -> str:
        per_layer = " ".join(f"{c:.1%}" for c in self.changed_per_layer)
        return (f"dropping the expert bias (max |bias| {self.max_abs_bias:.3g}): held-out loss {self.loss_with:.4f} "
                f"with it, {self.loss_without:.4f} without ({self.loss_without - self.loss_with:+.4f} nats/token, "
                f"{self.tokens:,} tokens); the expert set changes for {self.changed:.1%} of tokens over all layers "
                f"(per layer: {per_layer})")


def _load_part(module: nn.Module, prefix: str, load, device: torch.device) -> None:
    """Materialize `module` on `device` with the checkpoint's tensors under `prefix`."""
    module.to_empty(device=device)
    names = list(module.state_dict())
    tensors = load([prefix + name for name in names])
    module.load_state_dict({name: tensors[prefix + name] for name in names})


def _free(module: nn.Module) -> None:
    module.to_empty(device="meta")


@torch.no_grad()
def measure_bias_cost(args: Qwen3MoEArgs, load, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                      device: torch.device | str = "cpu") -> BiasCost:
    """args: the checkpoint's model settings; load(keys) -> {key: full tensor} of the checkpoint;
    batches: (inputs [B, S], labels [B, S]) int64 of held-out tokens. Runs in fp32 on `device`."""
    device = torch.device(device)
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, kernels="auto"))  # triton on CUDA only
    with torch.device("meta"):
        model = Qwen3MoEModel(args)
    model.eval()
    rope_cache = model._rope_cache().to(device)
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    if not batches:
        raise ValueError("no held-out batches to measure the expert bias on")

    _load_part(model.tok_embeddings, "tok_embeddings.", load, device)
    with_bias = [model.tok_embeddings(x) for x, _ in batches]
    without = [h.clone() for h in with_bias]
    _free(model.tok_embeddings)

    changed_per_layer, max_abs_bias = [], 0.0
    for name, block in model.layers.items():
        _load_part(block, f"layers.{name}.", load, device)
        router = block.moe.router
        max_abs_bias = max(max_abs_bias, float(router.expert_bias.abs().max()))
        counts = []  # [changed, tokens] per batch

        def count_changed(_module, _inputs, routing):
            unbiased = torch.topk(routing.scores, router.top_k, dim=-1).indices
            differs = (unbiased.sort(dim=-1).values != routing.experts.sort(dim=-1).values).any(dim=-1)
            counts.append((int(differs.sum()), differs.numel()))

        hook = router.register_forward_hook(count_changed)
        with_bias = [block(h, rope_cache) for h in with_bias]
        hook.remove()
        router.expert_bias.zero_()
        without = [block(h, rope_cache) for h in without]
        changed_per_layer.append(sum(c for c, _ in counts) / sum(n for _, n in counts))
        _free(block)

    _load_part(model.norm, "norm.", load, device)
    output_prefix = "output." if not args.enable_weight_tying else "tok_embeddings."
    _load_part(model.output, output_prefix, load, device)
    losses = []
    for hidden in (with_bias, without):
        total = 0.0
        for h, (_, labels) in zip(hidden, batches):
            logits = model.output(model.norm(h)).float()
            total += float(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum",
                                           ignore_index=IGNORE_INDEX))
        losses.append(total)
    tokens = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)
    return BiasCost(losses[0] / tokens, losses[1] / tokens, tokens, changed_per_layer, max_abs_bias)


def synthetic_held_out(job_config, vocab_size: int, num_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`num_batches` batches [local_batch_size, seq_len] of the run's synthetic stream (its chain, its
    shape) from a rank no training process reads."""
    from torchtitan_moe.components.data.synthetic import SyntheticMarkovDataset

    training, data = job_config.training, job_config.data
    stream = iter(SyntheticMarkovDataset(vocab_size, training.seq_len, HELD_OUT_RANK,
                                         successors=data.synthetic_successors, seed=data.synthetic_seed))
    batches = []
    for _ in range(num_batches):
        samples = [next(stream) for _ in range(training.local_batch_size)]
        batches.append((torch.stack([s[0]["input"] for s in samples]), torch.stack([s[1] for s in samples])))
    return batches


def token_file_batches(path: str, num_batches: int, vocab_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Held-out token ids saved with torch.save, int64 [sequences, length + 1] -> up to `num_batches`
    batches of EVAL_ROWS sequences (inputs row[:-1], labels row[1:])."""
    tokens = torch.load(path, weights_only=True)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[1] < 2 or tokens.is_floating_point():
        raise ValueError(f"{path}: expected an integer tensor [sequences, length + 1] saved with torch.save")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(f"{path}: token ids must be in 0..{vocab_size - 1} (the model's vocabulary), "
                         f"found {int(tokens.min())}..{int(tokens.max())}")
    tokens = tokens.long()[: num_batches * EVAL_ROWS]
    return [(rows[:, :-1], rows[:, 1:]) for rows in tokens.split(EVAL_ROWS)]
