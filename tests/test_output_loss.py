"""The model's output layer computes the training loss itself, given the labels.

Same loss and gradients as torchtitan's cross-entropy on the logits, for the torch kernels
(bitwise: the same ops) and the Triton kernels (under the interpreter on CPU, compiled on a GPU);
the trainer hands the labels to our model only; the loss function passes a computed loss on.
"""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from torchtitan_moe.models.qwen3_moe import Qwen3MoEModel, build_loss, flavor_args
from torchtitan_moe.ops.cross_entropy import IGNORE_INDEX
from torchtitan_moe.compat.torchtitan import build_cross_entropy_loss
from torchtitan_moe.train.trainer import MoETrainer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def debug_model(kernels: str) -> Qwen3MoEModel:
    args = flavor_args("debug")
    args.moe = dataclasses.replace(args.moe, kernels=kernels)
    # One block feeds the output layer, whose loss and gradients are compared (each MoE block costs
    # seconds under the Triton interpreter).
    args.vocab_size, args.max_seq_len, args.n_layers = 300, 32, 1
    torch.manual_seed(0)
    model = Qwen3MoEModel(args).to(DEVICE)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(DEVICE))
    return model


JOB = SimpleNamespace(compile=SimpleNamespace(enable=False, components=[], backend="inductor"))  # what the loss reads


def loss_and_grads(model, tokens, labels, fused: bool, autocast: bool = False):
    model.zero_grad()
    cross_entropy = build_cross_entropy_loss(JOB)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        loss = model(tokens, labels=labels) if fused else cross_entropy(model(tokens), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_output_layer_gives_torchtitans_loss_and_gradients(kernels):
    if kernels == "triton" and DEVICE == "cpu":
        pytest.importorskip("triton")
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton path on CPU needs TRITON_INTERPRET=1 (tests/ops run it)")
    model = debug_model(kernels)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 300, (2, 32), generator=g).to(DEVICE)
    labels = torch.randint(0, 300, (2, 32), generator=g).to(DEVICE)
    labels[0, :5] = IGNORE_INDEX  # ignored positions count nothing
    ref_loss, ref_grads = loss_and_grads(model, tokens, labels, fused=False)
    loss, grads = loss_and_grads(model, tokens, labels, fused=True)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    if kernels == "torch":  # the same ops: bitwise
        assert torch.equal(loss, ref_loss)
        assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    else:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        for n in ref_grads:
            torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6 * ref_grads[n].abs().max().item())


def test_under_autocast_the_output_layer_casts_as_a_linear_does():
    # One device without FSDP: torchtitan trains under autocast with fp32 weights. Autocast does
    # not reach into custom ops; the layer casts h and its weight itself, to the same logits.
    model = debug_model("torch")
    tokens = torch.randint(0, 300, (2, 16), device=DEVICE)
    ref_loss, ref_grads = loss_and_grads(model, tokens, tokens, fused=False, autocast=True)
    loss, grads = loss_and_grads(model, tokens, tokens, fused=True, autocast=True)
    assert torch.equal(loss, ref_loss)
    assert grads["output.weight"].dtype == torch.float32
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)


def test_without_labels_the_model_returns_logits():
    model = debug_model("torch")
    assert model(torch.zeros(1, 8, dtype=torch.long, device=DEVICE)).shape == (1, 8, 300)


def test_the_loss_function_passes_a_computed_loss_on_and_scores_logits():
    loss_fn = build_loss(JOB)
    summed = torch.tensor(3.5)
    assert loss_fn(summed, torch.zeros(2, 4, dtype=torch.long)) is summed
    logits, labels = torch.randn(2, 4, 10), torch.randint(0, 10, (2, 4))
    assert torch.equal(loss_fn(logits, labels), build_cross_entropy_loss(JOB)(logits, labels))


@pytest.mark.parametrize("ours", [True, False])
def test_the_trainer_hands_the_labels_to_our_model_only(ours):
    trainer = object.__new__(MoETrainer)  # the hook reads only these
    trainer.ours = ours
    trainer.model_args = SimpleNamespace(attn_type="sdpa")
    trainer.parallel_dims = SimpleNamespace(cp_enabled=False)
    tokens, labels = torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)
    inputs, out_labels, extra_inputs, extra_kwargs = trainer.post_dataloading_process({"input": tokens}, labels)
    assert inputs is tokens and out_labels is labels and extra_inputs == {}
    assert extra_kwargs == ({"labels": labels} if ours else {})
