"""FLOPs per token in both counts (components/flops.py) against a hand computation for Qwen3-30B-A3B at
seq 4096, the model's own count, the planner's, and the MFU each gives (components/metrics.flop_rates)."""

import pytest
import torch

from torchtitan_moe.components.flops import causal_flops_per_token
from torchtitan_moe.components.metrics import flop_rates
from torchtitan_moe.models.qwen3_moe import Qwen3MoEModel, flavor_args
from torchtitan_moe.tools.plan import Shape

SEQ = 4096


def hand_count() -> tuple[int, int, int]:
    """(active parameters N, torchtitan's F, causal F_c) for 30b-a3b at seq 4096, term by term."""
    L, D, H, KV, HD, E, K, I, V = 48, 2048, 32, 4, 128, 128, 8, 768, 151_936
    attention = D * (H * HD + 2 * KV * HD) + H * HD * D + 2 * HD  # wq, wk, wv; wo; q and k norms
    layer = attention + 2 * D + E * D + 3 * K * I * D  # + two norms, the router gate, K experts' w1, w3, w2
    active = L * layer + V * D + D  # + the output layer and the final norm (the input embedding is a lookup)
    scores_and_values = 12 * L * H * HD * SEQ  # QK^T and AV: 2 x 2 d_h S a token and head, x 3 for training
    return active, 6 * active + scores_and_values, 6 * active + scores_and_values // 2


def test_the_counts_are_the_hand_computation_and_the_docstrings_numbers():
    active, full, causal = hand_count()
    assert (active, full, causal) == (3_041_867_776, 27_914_883_072, 23_083_044_864)  # components/flops.py
    args = flavor_args("30b-a3b")
    with torch.device("meta"):
        model = Qwen3MoEModel(args)
    total, flops = args.get_nparams_and_flops(model, SEQ)
    assert (total, flops) == (30_532_122_624, full)
    assert causal_flops_per_token(flops, args, SEQ) == causal
    shape = Shape.of(args)
    assert (shape.flops_per_token(SEQ), shape.flops_per_token(SEQ, causal=True)) == (full, causal)


def test_nemos_qwen3_count_is_the_causal_one_but_the_router_and_the_norms():
    # NeMo's qwen3_flops per token, written out: 6 L D (H d_h / D) D [(2 KV / H + 1) + S / D + 1] for attention
    # (its causal 0.5 applied), 6 L D 3 I K for the experts, 6 D V for the output layer.
    L, D, H, KV, HD, K, I, V = 48, 2048, 32, 4, 128, 8, 768, 151_936
    nemo = 6 * L * D * H * HD * (2 * KV / H + 2) + 6 * L * H * HD * SEQ + 6 * L * D * 3 * I * K + 6 * D * V
    _, _, causal = hand_count()
    router, norms = 6 * L * 128 * D, 6 * (L * (2 * D + 2 * HD) + D)
    assert nemo == pytest.approx(23_006_281_728) and causal - nemo == pytest.approx(router + norms)


def test_mfu_in_both_counts():
    # The issue's deepep row: 7,718 tokens/s/GPU on 30b-a3b at seq 4096 against H200's 989 TFLOP/s.
    _, full, causal = hand_count()
    rates = flop_rates(7_718.0, full, causal, 989e12)
    assert rates["tflops"] == pytest.approx(full * 7_718 / 1e12)
    assert rates["tflops_causal"] == pytest.approx(causal * 7_718 / 1e12)
    assert round(rates["mfu(%)"], 1) == 21.8 and round(rates["mfu_causal(%)"], 1) == 18.0
    assert flop_rates(7_718.0, full, causal, None) == {"tflops": rates["tflops"], "tflops_causal": rates["tflops_causal"]}
    assert set(flop_rates(1.0, full, None, 989e12)) == {"tflops", "mfu(%)"}  # a model without the shapes
