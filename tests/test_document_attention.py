"""Document masking ([data] attention = "document"): packed documents compute what each would alone,
the mask is block-causal within documents and nothing more, the CPU's dense path is flex-attention's
mask, and on a GPU the flex path matches the dense one. CPU tests: seconds."""

import dataclasses
import warnings

import pytest
import torch

from torchtitan_moe.models.qwen3_moe import Qwen3MoEModel, flavor_args
from torchtitan_moe.models.qwen3_moe.attention import (
    DocumentAttention,
    dense_mask,
    document_block_mask,
    document_ids,
    document_mask_mod,
)

SEQ = 48


def positions_of(rows: list[list[int]]) -> torch.Tensor:
    """positions [B, S] of rows of document lengths."""
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])


ROWS = [[10, 1, 20, 17], [1, 47]]


def reference_mask(rows) -> torch.Tensor:
    """[B, 1, S, S]: query q sees key kv iff kv <= q in the same document, built from the lengths."""
    seq = sum(rows[0])
    mask = torch.zeros(len(rows), 1, seq, seq, dtype=torch.bool)
    for b, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            for q in range(start, start + n):
                mask[b, 0, q, start:q + 1] = True
            start += n
    return mask


def test_the_mask_is_causal_within_each_document_and_nothing_else():
    positions = positions_of(ROWS)
    assert document_ids(positions)[0].tolist() == [1] * 10 + [2] + [3] * 20 + [4] * 17
    mask = dense_mask(document_block_mask(positions), 2, SEQ, positions.device)
    assert torch.equal(mask, reference_mask(ROWS))


def test_the_cpu_dense_path_is_flex_attentions_mask():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    positions = positions_of(ROWS)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, SEQ, 16, generator=g) for h in (4, 2, 2))
    block_mask = create_block_mask(document_mask_mod(document_ids(positions)), 2, None, SEQ, SEQ, device="cpu")
    with torch.no_grad(), warnings.catch_warnings():  # flex without compile warns; its CPU forward is exact
        warnings.simplefilter("ignore")
        flex = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    ours = DocumentAttention()(q, k, v, block_mask=document_block_mask(positions), enable_gqa=True)
    torch.testing.assert_close(ours, flex, rtol=1e-5, atol=1e-6)


def model(attention: str, seed: int = 0) -> Qwen3MoEModel:
    args = flavor_args("debug")
    args.max_seq_len = 128
    # No balance loss: it couples the tokens of a batch, which a per-document reference cannot reproduce.
    router = dataclasses.replace(args.moe.router, balance_loss="none", balance_loss_coeff=0.0)
    args.moe = dataclasses.replace(args.moe, router=router)
    if attention == "document":
        args.attn_type, args.attn_mask_type = "flex", "block_causal"
    torch.manual_seed(seed)
    m = Qwen3MoEModel(args)
    with torch.no_grad():
        m.init_weights()
    return m


def test_packed_documents_compute_what_each_document_computes_alone():
    packed, alone = model("document"), model("causal")
    alone.load_state_dict(packed.state_dict())
    tokens = torch.randint(0, 2048, (2, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 2048, (2, SEQ), generator=torch.Generator().manual_seed(2))
    positions = positions_of(ROWS)
    logits = packed(tokens, positions=positions)
    packed(tokens, positions=positions, labels=labels).backward()
    reference_loss = 0.0
    for b, lengths in enumerate(ROWS):
        start = 0
        for n in lengths:
            piece = slice(start, start + n)
            torch.testing.assert_close(logits[b:b + 1, piece], alone(tokens[b:b + 1, piece]), rtol=1e-4, atol=1e-5)
            reference_loss = reference_loss + alone(tokens[b:b + 1, piece], labels=labels[b:b + 1, piece])
            start += n
    reference_loss.backward()
    grads = dict(alone.named_parameters())
    for name, p in packed.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_one_document_a_row_is_causal_attention():
    document, causal = model("document"), model("causal")
    causal.load_state_dict(document.state_dict())
    tokens = torch.randint(0, 2048, (2, SEQ), generator=torch.Generator().manual_seed(3))
    whole = torch.arange(SEQ).expand(2, SEQ)
    expected = causal(tokens)
    torch.testing.assert_close(document(tokens, positions=whole), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(document(tokens), expected, rtol=1e-5, atol=1e-5)  # no positions: one document
    h = torch.randn(2, SEQ, 128, generator=torch.Generator().manual_seed(4))  # a block called alone (hf/bias_cost.py)
    block, causal_block = document.layers["0"], causal.layers["0"]
    torch.testing.assert_close(block(h, document.rope_cache), causal_block(h, causal.rope_cache), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_gpu_flex_path_matches_the_dense_mask():
    # Two of flex's 128-token blocks: at 48 tokens (ROWS) inductor's flex lowering finds no kernel choice.
    rows = [[100, 1, 60, 95], [1, 255]]
    positions = positions_of(rows).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, h, positions.shape[1], 64, device="cuda", generator=g, requires_grad=True) for h in (8, 2, 2))
    flex = DocumentAttention()(q, k, v, block_mask=document_block_mask(positions), enable_gqa=True)
    flex.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    mask = reference_mask(rows).cuda()
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    dense.square().sum().backward()
    torch.testing.assert_close(flex, dense, rtol=2e-3, atol=2e-3)
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad, rtol=2e-3, atol=2e-3)
