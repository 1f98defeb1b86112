"""Break the code on purpose and check that the tests notice: a mutation test of the numerics.

    python scripts/mutation_check.py [--only NAME ...] [--list] [--timeout S]

Each mutation is a one-line source patch (zero the experts' output, drop the router
probabilities, swap two experts, halve a gradient, skip the bias update, ...). For each one
the script applies the patch to a private copy of the repository (never the working tree,
which stays yours to edit and commit meanwhile), runs the tests named for it there (pytest -x,
the copy first on PYTHONPATH), restores the file, and records whether they failed ("caught")
and the first failing test. It prints a table and exits 1 when a mutation survived. Each
mutation runs only its tests: ~10 minutes on 2 CPU cores. The table, with what caught each
mutation, is in tests/README.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest arguments


M = Mutation
# One patch, two ways to run the layer (eager, compiled by inductor): the exchange's backward halved.
HALVED_EXCHANGE_GRADIENT = (
    "return _exchange(grads, ctx.recv_splits, ctx.send_splits, ctx.group_name), None, None, None",
    "return [g * 0.5 for g in _exchange(grads, ctx.recv_splits, ctx.send_splits, ctx.group_name)], None, None, None",
)
MUTATIONS = [
    # -- the MoE layer: experts, router, balancing ------------------------------------------------
    M("experts: zero the output", "torchtitan_moe/moe/experts.py",
      "return ops.grouped_mm(h, w2.transpose(-2, -1), batch.offsets)",
      "return 0 * ops.grouped_mm(h, w2.transpose(-2, -1), batch.offsets)",
      ("tests/test_moe_layer.py",)),
    M("experts: drop the probabilities", "torchtitan_moe/moe/experts.py",
      "ops.swiglu_prob(ab, batch.probs,", "ops.swiglu_prob(ab, torch.ones_like(batch.probs),",
      ("tests/test_moe_layer.py",)),
    M("experts: swap experts 0 and 1 (w13)", "torchtitan_moe/moe/experts.py",
      "w13, w2 = _local(self.w13), _local(self.w2)",
      "w13, w2 = _local(self.w13)[[1, 0, *range(2, self.w13.shape[0])]], _local(self.w2)",
      ("tests/test_moe_layer.py",)),
    M("experts: fp32 GEMMs under autocast", "torchtitan_moe/moe/experts.py",
      "return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None",
      "return None",
      ("tests/test_moe_layer.py", "-k", "autocast")),
    M("router: top-k of the smallest scores", "torchtitan_moe/moe/router.py",
      "torch.topk(choice, self.top_k, dim=-1)", "torch.topk(choice, self.top_k, dim=-1, largest=False)",
      ("tests/test_router.py",)),
    M("router: ignore route_norm", "torchtitan_moe/moe/router.py",
      "if self.route_norm:", "if False:", ("tests/test_router.py",)),
    M("router: the expert bias weighs", "torchtitan_moe/moe/router.py",
      "probs = scores.gather(1, experts)", "probs = (scores + self.expert_bias).gather(1, experts)",
      ("tests/test_router.py",)),
    M("router: probabilities carry no gradient", "torchtitan_moe/moe/router.py",
      "probs = scores.gather(1, experts)", "probs = scores.detach().gather(1, experts)",
      ("tests/test_router.py", "tests/test_moe_layer.py")),
    M("layer: aux loss not attached", "torchtitan_moe/moe/layer.py",
      "out = _AttachAuxLoss.apply(out, routing.aux_loss, self.aux_loss_scale)", "pass",
      ("tests/test_moe_layer.py",)),
    M("layer: tokens cast to the (sharded, fp32) weights' dtype before dispatch", "torchtitan_moe/moe/layer.py",
      "dtype = autocast_dtype(tokens.device)", "dtype = autocast_dtype(tokens.device) or self.experts.w13.dtype",
      ("tests/test_moe_layer.py", "-k", "dispatch_moves")),
    M("balance: skip the bias update", "torchtitan_moe/moe/balance.py",
      "layer.router.expert_bias.add_(delta - delta.mean())", "pass", ("tests/test_balance.py",)),
    M("balance: update with the wrong sign", "torchtitan_moe/moe/balance.py",
      "torch.sign(loads.mean(dim=1, keepdim=True) - loads)", "torch.sign(loads - loads.mean(dim=1, keepdim=True))",
      ("tests/test_balance.py",)),
    M("balance: a host sync per layer", "torchtitan_moe/moe/balance.py",
      "        if layer.bias_update_rate:", "        if layer.bias_update_rate and sign.abs().sum() > 0:",
      ("tests/test_balance.py",)),
    M("router: the global counts compiled (a recompute counts again)", "torchtitan_moe/models/qwen3_moe/parallelize.py",
      "router.route = torch.compile(router.route,", "router.forward = torch.compile(router.forward,",
      ("tests/test_router_losses.py::test_checkpointed_recompute_counts_once_and_gives_the_same_gradients",)),
    M("bias cost: the bias never set to zero", "torchtitan_moe/hf/bias_cost.py",
      "        router.expert_bias.zero_()", "        pass", ("tests/test_bias_cost.py",)),
    M("bias cost: expert sets compared with the bias on both sides", "torchtitan_moe/hf/bias_cost.py",
      "torch.topk(routing.scores, router.top_k", "torch.topk(routing.scores + router.expert_bias, router.top_k",
      ("tests/test_bias_cost.py",)),
    M("step_profile: the ranks' columns swapped", "torchtitan_moe/tools/step_profile.py",
      "    ranks = sorted(by_rank)\n", "    ranks = sorted(by_rank, reverse=True)\n",
      ("tests/test_step_profile.py", "-k", "ranks")),
    M("step_profile: the longest step's kernels not set against the shortest's", "torchtitan_moe/tools/step_profile.py",
      "extra = {n: ms - by_step[shortest].get(n, 0.0) for n, ms in by_step[longest].items()}",
      "extra = dict(by_step[longest])",
      ("tests/test_step_profile.py", "-k", "longest")),
    M("clip in the optimizer: the scale never reaches the step", "torchtitan_moe/components/optimizer.py",
      "            optimizer.grad_scale = scale\n", "            optimizer.grad_scale = None\n",
      ("tests/test_clip.py",)),
    # -- ops: swiglu_prob, gather/combine, routing index (torch references and Triton kernels) ----
    M("swiglu_prob (torch): drop the probabilities", "torchtitan_moe/ops/swiglu_prob.py",
      "h = torch.nn.functional.silu(a) * b * torch.where(valid, probs, 0.0)[:, None]",
      "h = torch.nn.functional.silu(a) * b", ("tests/ops/test_swiglu_prob.py", "-k", "torch")),
    M("swiglu_prob (triton): drop the probabilities", "torchtitan_moe/ops/swiglu_prob_triton.py",
      "h = a * tl.sigmoid(a) * b * p", "h = a * tl.sigmoid(a) * b",
      ("tests/ops/test_swiglu_prob.py", "-k", "triton and dtype2")),  # dtype2: float32
    M("swiglu_prob (triton): halve dprobs", "torchtitan_moe/ops/swiglu_prob_triton.py",
      "dp += tl.sum(dh * silu * b, axis=1)", "dp += 0.5 * tl.sum(dh * silu * b, axis=1)",
      ("tests/ops/test_swiglu_prob.py", "-k", "triton and dtype2")),  # dtype2: float32
    M("swiglu_prob (triton): dab written past num_rows", "torchtitan_moe/ops/swiglu_prob_triton.py",
      "round_to(dh * p * b * dsilu, dab_ptr.dtype.element_ty), mask=read)",
      "round_to(dh * p * b * dsilu, dab_ptr.dtype.element_ty), mask=in_bounds[:, None] & (cols < I))",
      ("tests/ops/test_swiglu_prob.py", "-k", "triton")),
    M("combine (torch): drop the probabilities", "torchtitan_moe/ops/combine.py",
      "out = out + (per_slot[:, k] if probs is None else per_slot[:, k] * probs[:, k, None])",
      "out = out + per_slot[:, k]",
      ("tests/ops/test_combine.py", "-k", "torch")),
    M("gather_rows (torch): the next token's row", "torchtitan_moe/ops/combine.py",
      "per_slot = xf.unsqueeze(1)", "per_slot = xf.roll(-1, 0).unsqueeze(1)",
      ("tests/ops/test_combine.py", "-k", "torch")),
    M("combine (torch): gathered by inv (a backward that repeats indices)", "torchtitan_moe/ops/combine.py",
      "per_slot = yf.new_zeros(T * K + 1, y.shape[1]).index_put((target,), yf)[: T * K].view(T, K, y.shape[1])",
      "per_slot = torch.where((index.inv >= 0)[..., None], yf[index.inv.long().clamp_min(0)], 0.0)",
      ("tests/ops/test_combine.py", "-k", "torch or repeated")),
    M("combine (triton): only the first of k terms", "torchtitan_moe/ops/combine_triton.py",
      "for k in range(K):  # in k order", "for k in range(1):  # in k order",
      ("tests/ops/test_combine.py", "-k", "triton and dtype1 and plain")),  # dtype1: float32
    M("gather (triton): pad rows left unzeroed with the tail", "torchtitan_moe/ops/combine_triton.py",
      "unowned = ((slot < 0) & (rows < limit))[:, None]", "unowned = ((slot < 0) & (rows < 0))[:, None]",
      ("tests/ops/test_combine.py", "-k", "triton and (aligned or zeroes)")),
    M("routing index (torch): groups in reverse expert order", "torchtitan_moe/ops/permute.py",
      "order = torch.sort(key, stable=True).indices", "order = torch.sort(key, stable=True, descending=True).indices",
      ("tests/ops/test_permute.py", "-k", "torch")),
    M("cross-entropy kernel: count ignored rows", "torchtitan_moe/ops/cross_entropy_triton.py",
      "counted = label != ignore_index", "counted = label == label",
      ("tests/ops/test_cross_entropy.py",)),
    M("cross-entropy kernel: gradient without the one-hot", "torchtitan_moe/ops/cross_entropy_triton.py",
      "g = tl.exp((x - m) - log_s) - tl.where(cols == label, 1.0, 0.0)", "g = tl.exp((x - m) - log_s)",
      ("tests/ops/test_cross_entropy.py",)),
    M("linear_cross_entropy: backward ignores the loss's gradient", "torchtitan_moe/ops/cross_entropy.py",
      "dh, dweight = _scale_gradients(dh, dweight, dloss)", "dh, dweight = dh, dweight",
      ("tests/ops/test_cross_entropy.py",)),
    M("linear_cross_entropy: backward rounds the loss's gradient first", "torchtitan_moe/ops/cross_entropy_triton.py",
      "round_to(x * tl.load(scale_ptr), out_ptr.dtype.element_ty)",
      "round_to(x * round_to(tl.load(scale_ptr), out_ptr.dtype.element_ty).to(tl.float32), out_ptr.dtype.element_ty)",
      ("tests/ops/test_cross_entropy.py", "-k", "unrounded")),
    M("output layer: weight not cast under autocast", "torchtitan_moe/models/qwen3_moe/model.py",
      "h.flatten(0, -2).to(dtype), self.weight.to(dtype)", "h.flatten(0, -2).to(dtype), self.weight",
      ("tests/test_output_loss.py",)),
    M("trainer: labels not handed to our model", "torchtitan_moe/train/trainer.py",
      'extra_kwargs["labels"] = labels', "pass",
      ("tests/test_output_loss.py",)),
    # -- expert parallelism, FSDP, sharded init, the model ----------------------------------------
    M("grouped_mm: halve the weight gradient", "torchtitan_moe/ops/grouped_mm.py",
      "dw = _grouped_mm_weight(dy, x, offsets).transpose(-2, -1)",
      "dw = 0.5 * _grouped_mm_weight(dy, x, offsets).transpose(-2, -1)",
      ("tests/ops/test_custom_ops.py",)),
    M("grouped_mm: weight gradient in the GEMM's layout, not the weight's", "torchtitan_moe/ops/grouped_mm.py",
      "if w.stride(-2) == 1 and w.stride(-1) != 1:", "if False:",
      ("tests/ops/test_custom_ops.py",)),
    M("all-to-all: halve the gradient on the way back", "torchtitan_moe/dispatch/exchange.py",
      *HALVED_EXCHANGE_GRADIENT,
      ("tests/test_all_to_all.py", "-k", "2-none-False-False-None")),
    M("all-to-all: halve the gradient on the way back, seen by the EP parity (one launch)",
      "torchtitan_moe/dispatch/exchange.py", *HALVED_EXCHANGE_GRADIENT,
      ("tests/test_parity.py", "-k", "ep_1_2_4")),
    M("all-to-all, layer compiled by inductor: halve the gradient on the way back", "torchtitan_moe/dispatch/exchange.py",
      *HALVED_EXCHANGE_GRADIENT,
      ("tests/test_all_to_all.py", "-k", "inductor")),
    M("send_plan (triton): a slot counts as its own earlier slot", "torchtitan_moe/ops/send_plan_triton.py",
      "earlier = (k[None, None, :] < k[None, :, None])", "earlier = (k[None, None, :] <= k[None, :, None])",
      ("tests/ops/test_send_plan.py",)),
    M("send_meta (triton): global expert ids", "torchtitan_moe/ops/send_plan_triton.py",
      "ids = tl.where(here, e % num_local, -1)", "ids = tl.where(here, e, -1)",
      ("tests/ops/test_send_plan.py",)),
    M("send_meta (triton): the gradient read from the ids columns", "torchtitan_moe/ops/send_plan_triton.py",
      "g = tl.load(dmeta_ptr + r[:, None] * (2 * K) + K + k[None, :]", "g = tl.load(dmeta_ptr + r[:, None] * (2 * K) + k[None, :]",
      ("tests/ops/test_send_plan.py",)),
    M("send_meta (torch): rows past the sent ones carry slots", "torchtitan_moe/ops/send_plan.py",
      "& (row_slot >= 0).unsqueeze(1)  # [S, K]", " # [S, K]",
      ("tests/ops/test_send_plan.py",)),
    M("all-to-all: keep the split sizes again in a checkpointed recompute", "torchtitan_moe/dispatch/all_to_all.py",
      "        if not self._replaying():\n            self._keep(sizes)", "        self._keep(sizes)",
      ("tests/test_all_to_all.py", "-k", "2-always-False-True-None")),
    M("all-to-all worst-case buffers: a rank's rows left at their compact place", "torchtitan_moe/dispatch/all_to_all.py",
      "send_index.inv - starts[rank] + rank * num_tokens, -1)", "send_index.inv, -1)",
      ("tests/test_all_to_all.py", "-k", "worst_case_buffers_match and 2-always-False-False-None")),
    M("DeepEP worst-case buffers: num_worst_tokens for one rank's tokens", "torchtitan_moe/dispatch/deepep.py",
      "worst = self.ep_size * x.shape[0] if", "worst = x.shape[0] if",
      ("tests/test_deepep.py", "-k", "fake and worst_case")),
    M("all-gather: each rank computes the other rank's experts", "torchtitan_moe/dispatch/all_gather.py",
      "local = experts - self.rank * self.local_experts", "local = experts - (1 - self.rank) * self.local_experts",
      ("tests/test_all_gather.py", "-k", "matches_local and none-False-False-None")),
    M("all-gather: the ranks' sums added to the other rank's tokens", "torchtitan_moe/dispatch/all_gather.py",
      "return pending.finish([per_token(self.rank)])[0]", "return pending.finish([per_token(1 - self.rank)])[0]",
      ("tests/test_all_gather.py", "-k", "matches_local and none-False-False-None")),
    M("all-gather: the rows' gradients not sent back", "torchtitan_moe/dispatch/all_gather.py",
      "dx, dprobs = ctx.transport.reduce_scatter(grads)",
      "dx, dprobs = ctx.transport.reduce_scatter(grads)\n        dx = grads[0].chunk(ctx.transport.size)[ctx.transport.rank]",
      ("tests/test_all_gather.py", "-k", "matches_local and none-False-False-None")),
    M("all-gather: the recompute gathers again instead of replaying", "torchtitan_moe/dispatch/all_gather.py",
      "        if self._replaying():\n            gathered_x, experts, probs = self._replayed()\n        else:",
      "        if False:\n            pass\n        else:",
      ("tests/test_all_gather.py", "-k", "matches_local and always-False-True-None")),
    M("all-gather: combine_tokens ignores the token range (Triton)", "torchtitan_moe/ops/combine.py",
      "return combine(y, index._replace(inv=index.inv[start:end]), backend=backend)",
      "return combine(y, index, backend=backend)",
      ("tests/ops/test_combine.py", "-k", "combine_tokens")),
    M("sum in rank order: two bf16 parts rounded twice", "torchtitan_moe/dispatch/peer_memory.py",
      "if len(parts) == 2:", "if len(parts) == 3:",
      ("tests/test_all_gather.py", "-k", "rounds_once")),
    M("all-gather: start_dispatch sends the tokens again instead of taking send_tokens'", "torchtitan_moe/dispatch/all_gather.py",
      "            if sent is None:  # called without send_tokens", "            if True:  # called without send_tokens",
      ("tests/test_all_gather.py", "-k", "matches_local and none-False-False-None")),
    M("all-gather: send_tokens sends zeros", "torchtitan_moe/dispatch/all_gather.py",
      "(x, self._start_gather(x))\n\n    def start_dispatch", "(x, self._start_gather(torch.zeros_like(x)))\n\n    def start_dispatch",
      ("tests/test_all_gather.py", "-k", "matches_local and none-False-False-None")),
    M("auto: all_gather taken where this run cannot use it", "torchtitan_moe/parallel/choose.py",
      "        if blocker is None:\n            return Choice(\"all_gather\"", "        if True:\n            return Choice(\"all_gather\"",
      ("tests/test_dispatch_choice.py", "-k", "all_gather")),
    M("all-gather: uneven tokens over the ranks not checked", "torchtitan_moe/dispatch/all_gather.py",
      "if x.shape[0] != self.checked_tokens:", "if False:",
      ("tests/test_all_gather.py", "-k", "uneven")),
    M("gate_logits: the weight's low bf16 part left out (forward)", "torchtitan_moe/ops/gate.py",
      "return _blocks_sum(_mm(x, _weight_blocks(w, (0, 1, 2)).t()), 3, dim=1)",
      "return _blocks_sum(_mm(x, _weight_blocks(w, (0, 1, 1)).t()), 3, dim=1)",
      ("tests/ops/test_gate.py",)),
    M("gate_logits: dx without the gradient's second bf16 part", "torchtitan_moe/ops/gate.py",
      "_weight_blocks(w, (0, 1, 0))", "_weight_blocks(w, (0, 1, 1))",
      ("tests/ops/test_gate.py",)),
    M("gate_logits: dw without the gradient's third bf16 part", "torchtitan_moe/ops/gate.py",
      "(0, 0, 1), (0, 1, 2))", "(0, 0, 1), (0, 1, 1))",
      ("tests/ops/test_gate.py",)),
    M("gate_logits: the split's blocks laid out one row apart", "torchtitan_moe/ops/gate_triton.py",
      "base = offs + 2 * row * C", "base = offs + row * C",
      ("tests/ops/test_gate.py",)),
    M("overlap: the chunks' combines joined in the wrong order", "torchtitan_moe/moe/chunks.py",
      "return torch.cat([c.wait() for c in combines])", "return torch.cat([c.wait() for c in combines][::-1])",
      ("tests/test_overlap.py", "-k", "chunks_match_one_chunk and all_to_all-exact-False-False")),
    M("overlap: chunk 1's dispatch drops what chunk 0 kept for the recompute", "torchtitan_moe/dispatch/replay.py",
      "        if chunk == 0:\n            self._kept.clear()", "        self._kept.clear()",
      ("tests/test_overlap.py", "-k", "chunks_match_one_chunk and all_to_all-worst_case-True")),
    M("overlap: chunk 1 routed with chunk 0's probabilities", "torchtitan_moe/moe/chunks.py",
      "probs=routing.probs[start:end]", "probs=routing.probs[: end - start]",
      ("tests/test_overlap.py", "-k", "chunks_match_one_chunk and deepep-exact")),
    M("all-to-all: rows to the wrong local expert", "torchtitan_moe/ops/send_plan.py",
      "experts[token] % num_local", "(experts[token] + 1) % num_local",
      ("tests/test_all_to_all.py", "-k", "2-none-False-False-None")),
    M("experts outside FSDP2: GEMMs in the weights' fp32", "torchtitan_moe/models/qwen3_moe/parallelize.py",
      "    experts.param_dtype = param_dtype", "    pass",
      ("tests/test_train_cpu.py", "-k", "experts_outside")),
    M("working copies: the GEMMs cast the fp32 weights instead of reading the copies", "torchtitan_moe/moe/experts.py",
      'return (_WorkingCopy.apply(w13, self.working["w13"], self.kernels),\n'
      '                    _WorkingCopy.apply(w2, self.working["w2"], self.kernels))',
      "return w13.to(self.param_dtype), w2.to(self.param_dtype)",
      ("tests/test_overlap.py", "-k", "working_copy")),
    M("working copies: an optimizer step leaves them current", "torchtitan_moe/components/optimizer.py",
      "    optimizers.register_step_pre_hook(mark_stale)\n", "",
      ("tests/test_working_copies.py", "-k", "optimizer_step")),
    M("working copies: a checkpoint load leaves them current", "torchtitan_moe/moe/experts.py",
      "lambda module, keys: module.mark_working_stale()", "lambda module, keys: None",
      ("tests/test_working_copies.py", "-k", "load_state_dict")),
    M("working copies: our AdamW marks them current without writing them", "torchtitan_moe/components/optimizer.py",
      "working = experts.working_copy(name) if experts is not None else None",
      "working = None\n                if experts is not None:\n                    experts.current.add(name)",
      ("tests/test_working_copies.py", "-k", "our_adamw")),
    M("adamw (triton): working copy truncated, not rounded to nearest", "torchtitan_moe/ops/adamw_triton.py",
      "round_to(p, WORKING)", "p.to(WORKING)",
      ("tests/ops/test_adamw.py", "-k", "working_copy and triton")),
    M("adamw (triton): one launch for a group rounds every parameter with the first one's seed",
      "torchtitan_moe/ops/adamw_triton.py", "w, sizes[i], seeds[i]]", "w, sizes[i], seeds[0]]",
      ("tests/ops/test_adamw.py", "-k", "group_in_one_call and triton")),
    M("adamw (triton): exp_avg_sq rounded on exp_avg's random bits", "torchtitan_moe/ops/adamw_triton.py",
      "round_stochastic_bf16(v, bits >> 16)", "round_stochastic_bf16(v, bits)",
      ("tests/ops/test_adamw.py", "-k", "bits_of_their_own and triton")),
    M("adamw (triton): the four elements of a Philox call round on one word", "torchtitan_moe/ops/adamw_triton.py",
      "tl.join(tl.join(r0, r1), tl.join(r2, r3))", "tl.join(tl.join(r0, r0), tl.join(r0, r0))",
      ("tests/ops/test_adamw.py", "-k", "bits_of_their_own and triton")),
    M("round_to (interpreter): bf16 made by the interpreter's cast, which loses subnormals",
      "torchtitan_moe/ops/_triton_utils.py", "return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)",
      "return (top << 16).to(tl.float32, bitcast=True).to(dtype)",
      ("tests/ops/test_triton_utils.py",)),
    M("copies_differ (triton): a NaN weight's NaN copy counted as stale", "torchtitan_moe/ops/copy_check_triton.py",
      " | (\n        (weight != weight) & (wide != wide))", "",
      ("tests/ops/test_copy_check.py", "-k", "nan and triton")),
    M("copies_differ (triton): a program's flag given to the tensor of its block number", "torchtitan_moe/ops/copy_check_triton.py",
      "scatter_reduce_(0, block_pair.long()", "scatter_reduce_(0, block_index.long() % len(weights)",
      ("tests/ops/test_copy_check.py", "-k", "triton")),
    M("sum_of_squares (triton): the last program's partial sum dropped", "torchtitan_moe/ops/sum_of_squares_triton.py",
      "    return partial.sum()", "    return partial[:-1].sum()",
      ("tests/ops/test_sum_of_squares.py", "-k", "triton or large")),
    M("working copies: the check names another layer's weight", "torchtitan_moe/moe/experts.py",
      "[c for _, _, c in found], backend=backend))", "[c for _, _, c in found], backend=backend).flip(0))",
      ("tests/test_working_copies.py", "-k", "out_of_step")),
    M("data: a worker process's loader resumes from the stream's start", "torchtitan_moe/components/data/synthetic.py",
      'self.sample_idx = state["sample_idx"]', "self.sample_idx = 0",
      ("tests/test_data.py", "-k", "workers")),
    M("data: the text stream resumes at its first document", "torchtitan_moe/components/data/text.py",
      'self.epoch, self.doc_idx, self.buffer = state["epoch"], state["doc_idx"], list(state["buffer"])',
      'self.epoch, self.doc_idx, self.buffer = state["epoch"], 0, list(state["buffer"])',
      ("tests/test_data.py", "-k", "workers and text")),
    M("op registration: no autograd node (the op's outputs carry no gradient)", "torchtitan_moe/ops/_library.py",
      "if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):", "if False:",
      ("tests/ops/test_combine.py", "-k", "triton and dtype1 and plain")),
    M("op registration: no fake implementation (torch.compile cannot trace the op)", "torchtitan_moe/ops/_library.py",
      "torch.library.register_fake(self._qualname, fake, lib=self._lib)", "pass",
      ("tests/ops/test_custom_ops.py", "-k", "gather_rows_and_combine_opcheck")),
    M("FSDP: halve every gradient", "torchtitan_moe/models/qwen3_moe/parallelize.py",
      "module.set_gradient_divide_factor(1.0)", "module.set_gradient_divide_factor(2.0)",
      ("tests/test_sharded_init.py", "-k", "two_rank")),
    M("HSDP: no gradient sum over the replicas", "torchtitan_moe/compat/torchtitan.py",
      'names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]',
      'names = ["fsdp"]', ("tests/test_hsdp.py", "-k", "one_process")),
    M("HSDP: balance counts over one replica", "torchtitan_moe/models/qwen3_moe/__init__.py",
      'loss_mesh = parallel_dims.get_optional_mesh("loss")', 'loss_mesh = parallel_dims.get_optional_mesh("fsdp")',
      ("tests/test_hsdp.py", "-k", "count_every_replica")),
    M("init: per-shard random init (the clone bug)", "torchtitan_moe/models/qwen3_moe/model.py",
      "with full_tensors(layer):", "with __import__('contextlib').nullcontext():",
      ("tests/test_sharded_init.py", "-k", "two_rank")),
    M("init: per-shard random init, seen by the debug run", "torchtitan_moe/models/qwen3_moe/model.py",
      "with full_tensors(layer):", "with __import__('contextlib').nullcontext():",
      ("tests/test_train_cpu.py", "-k", "learns")),
    M("model: the block drops the MoE output", "torchtitan_moe/models/qwen3_moe/model.py",
      "return h + self.moe(moe_input)", "return h + 0 * self.moe(moe_input)",
      ("tests/test_sharded_init.py", "-k", "two_rank")),
    # -- checks and the parity harness -------------------------------------------------------------
    M("router-init: ties at the k-th choice only", "torchtitan_moe/components/checks/router_init.py",
      "tied = top.values[:, 1:] == top.values[:, :-1]",
      "tied = (top.values[:, 1:] == top.values[:, :-1]) & (torch.arange(top_k, device=choice.device) == top_k - 1)",
      ("tests/test_checks.py", "-k", "tie")),
    M("router-init: duplicated gate rows not checked", "torchtitan_moe/components/checks/router_init.py",
      "duplicates = duplicated_rows(w)", "duplicates = []", ("tests/test_checks.py", "-k", "duplicated or cloned")),
    M("parity: grad norms not compared", "torchtitan_moe/tools/parity_report.py",
      'grad_norm=max(rel_diff(a["grad_norm"], b["grad_norm"]) for a, b in zip(base, other)),', "grad_norm=0.0,",
      ("tests/test_parity.py", "-m", "not slow")),
    M("compile: the blocks' regions left eager (the component misspelt)", "torchtitan_moe/models/qwen3_moe/parallelize.py",
      'if job_config.compile.enable and "model" in job_config.compile.components:',
      'if job_config.compile.enable and "models" in job_config.compile.components:',
      ("tests/test_parity.py", "-k", "compiled_training")),
    M("parity: drift windows shifted by a step", "torchtitan_moe/tools/parity_report.py",
      "pairs = list(zip(runs[0][lo : lo + width], run[lo : lo + width]))",
      "pairs = list(zip(runs[0][lo : lo + width], run[lo + 1 : lo + width + 1]))",
      ("tests/test_parity.py", "-k", "drift")),
    M("step_profile: idle gaps after a sync not marked", "torchtitan_moe/tools/step_profile.py",
      "synced = bisect.bisect_right(sync_ends, e.start) > bisect.bisect_left(sync_ends, reach)", "synced = False",
      ("tests/test_step_profile.py", "-k", "idle")),
    M("bench_train: --vary values not passed to the run", "torchtitan_moe/tools/bench_train.py",
      "    return [arg for key, value in vary for arg in override(key, value)]", "    return []",
      ("tests/test_bench_train.py", "-k", "vary")),
    M("bench_train: --repeat pairs each run with another round's", "torchtitan_moe/tools/bench_train.py",
      'zip(base.get("tps_runs", []), mine.get("tps_runs", []))', 'zip(base.get("tps_runs", []), mine.get("tps_runs", [])[::-1])',
      ("tests/test_bench_train.py", "-k", "repeat")),
    M("bench_train: --repeat runs every round in one order", "torchtitan_moe/tools/bench_train.py",
      "enumerate(variants if round_ % 2 else variants[::-1], 1)", "enumerate(variants, 1)",
      ("tests/test_bench_train.py", "-k", "repeat")),
    M("trainer: close() leaves the data worker to the garbage collector", "torchtitan_moe/train/trainer.py",
      'stop_workers(getattr(self, "dataloader", None))', "pass",
      ("tests/test_train_cpu.py", "-k", "data_worker")),
    M("bench_train: --resume reads back a run a time limit cut off", "torchtitan_moe/tools/bench_train.py",
      "elif args.resume and finished(dump):", 'elif args.resume and (dump / "metrics.jsonl").exists():',
      ("tests/test_bench_train.py", "-k", "resume")),
    M("bench_train: the config's [debug] seed overridden by --seed", "torchtitan_moe/tools/bench_train.py",
      'seed = config_value(args.config, args.extra, "debug.seed", args.seed)', "seed = args.seed",
      ("tests/test_bench_train.py", "-k", "log_freq")),
    M("bench_train: the loss table names how many steps were logged, not the last one", "torchtitan_moe/tools/bench_train.py",
      "| {loss_steps(eager)[n - 1]} |", "| {n} |", ("tests/test_bench_train.py", "-k", "agreement")),
    M("optimizer: update = 'triton' with fp32 moments builds torch's AdamW", "torchtitan_moe/components/optimizer.py",
      'return update == "triton"', 'return False',
      ("tests/ops/test_adamw.py", "-k", "update_picks")),
    M("train step: the global token count read back to the host, as torchtitan's step does",
      "torchtitan_moe/train/step.py",
      'global_valid_tokens = all_reduce(local_valid_tokens, "sum", dims.get_mesh("batch")).float()',
      'global_valid_tokens = dist_utils.dist_sum(local_valid_tokens, dims.get_mesh("batch"))',
      ("tests/test_step_host_syncs.py",)),
    M("train step: the loss divided by this rank's token count, not the global one", "torchtitan_moe/train/step.py",
      'global_valid_tokens = all_reduce(local_valid_tokens, "sum", dims.get_mesh("batch")).float()',
      "global_valid_tokens = local_valid_tokens.float()",
      ("tests/test_train_cpu.py", "-k", "train_step_trains_as")),
    M("upcast (triton): the bf16 bits moved one place short", "torchtitan_moe/ops/upcast_triton.py",
      "bits << 16", "bits << 15", ("tests/ops/test_upcast.py", "-k", "triton")),
    M("router: bf16 logits from a bf16 gate and bf16 tokens", "torchtitan_moe/moe/router.py",
      "logits = F.linear(x.to(dtype), weight.to(dtype)).float()", "logits = F.linear(x, weight).float()",
      ("tests/test_router.py", "-k", "bf16_gate")),
    M("step_profile: a kernel launched before the trace counted in the step it starts in",
      "torchtitan_moe/tools/step_profile.py",
      "        if launch is None and launched_by and e.correlation is not None:\n            continue\n", "",
      ("tests/test_step_profile.py", "-k", "before_the_trace")),
    M("step_profile: kernels counted in the step they start in, not the one that launched them",
      "torchtitan_moe/tools/step_profile.py",
      "t = launch.start if launch is not None else e.start", "t = e.start",
      ("tests/test_step_profile.py", "-k", "behind")),
    M("step_profile: a compute-stream gap put on the kernel beside it that covers least of it",
      "torchtitan_moe/tools/step_profile.py",
      "keys.append(max(kernels, key=kernels.get)", "keys.append(min(kernels, key=kernels.get)",
      ("tests/test_step_profile.py", "-k", "compute_stream_idle or most_of_it")),
    M("step_profile: a compute-stream gap put on the kernel covering most of it, whatever its stream",
      "torchtitan_moe/tools/step_profile.py",
      "kernels = max(streams.values(), key=lambda k: sum(k.values()))",
      "kernels = {name: t for k in streams.values() for name, t in k.items()}",
      ("tests/test_step_profile.py", "-k", "most_of_it")),
    M("step_profile --gaps: the host ops of the kernel before a gap, not of the one after it",
      "torchtitan_moe/tools/step_profile.py",
      "launch = launched_by.get(b.correlation)", "launch = launched_by.get(a.correlation)",
      ("tests/test_step_profile.py", "-k", "gaps_lists")),
    M("step_profile: a GEMM that starts as another stream's kernel ends counted as started beside it",
      "torchtitan_moe/tools/step_profile.py",
      "if i < 0 or furthest[i] <= t:", "if i < 0 or furthest[i] < t:",
      ("tests/test_step_profile.py", "-k", "beside_another")),
    M("kept expert gradients: AdamW reads the weights' own .grad only", "torchtitan_moe/components/optimizer.py",
      "grad = p.grad if experts is None else experts.gradient(name)", "grad = p.grad",
      ("tests/test_working_copies.py", "-k", "train_as_the_fp32")),
    M("kept expert gradients: zero_grad leaves them on the working copies", "torchtitan_moe/components/optimizer.py",
      "            experts.clear_working_gradients()\n\n    def load_state_dict", "            pass\n\n    def load_state_dict",
      ("tests/test_working_copies.py", "-k", "zero_grad")),
    M("kept expert gradients: their squares not summed over the ranks of the other shards",
      "torchtitan_moe/components/optimizer.py",
      'squares = funcol.all_reduce(squares, "sum", (mesh, dim))', "pass",
      ("tests/test_train_cpu.py", "-k", "kept_in_bf16")),
    M("kept expert gradients: the monitors' grad norm leaves them out", "torchtitan_moe/components/checks/monitors.py",
      "    grads += [copy.grad", "    grads += [] and [copy.grad",
      ("tests/test_working_copies.py", "-k", "monitors")),
    M("expert_grad_dtype: 'float32' keeps the gradients in bf16 too", "torchtitan_moe/components/optimizer.py",
      '    if setting == "float32":\n        return False\n', "",
      ("tests/test_working_copies.py", "-k", "auto_keeps")),
    M("planner: expert_grad_dtype 'auto' counted bf16 under gradient accumulation", "torchtitan_moe/tools/plan.py",
      'setting == "auto" and accum == 1 and', 'setting == "auto" and',
      ("tests/test_plan.py", "-k", "auto")),
    M("embedding by rows: the other ranks' rows not masked out of the lookup", "torchtitan_moe/parallel/embedding.py",
      "rows.masked_fill_(~held[:, None], 0)", "pass",
      ("tests/test_embedding_rows.py",)),
    M("embedding by rows: every rank's rows start at row 0", "torchtitan_moe/parallel/embedding.py",
      "start = min(mesh.get_local_rank() * rows_per_rank, weight.shape[0])", "start = 0",
      ("tests/test_embedding_rows.py",)),
    M("embedding by rows: each rank's gradient taken for every rank's (no all-gather in backward)",
      "torchtitan_moe/parallel/embedding.py",
      "all_grad = all_gather(grad.contiguous(), ctx.mesh)", "all_grad = grad.repeat(ctx.mesh.size(), 1)",
      ("tests/test_embedding_rows.py",)),
    M("embedding by rows: the rows' gradients summed in bf16", "torchtitan_moe/parallel/embedding.py",
      "embedding_dense_backward(all_grad.float(), index", "embedding_dense_backward(all_grad, index",
      ("tests/test_embedding_rows.py", "-k", "fp32")),
    M("by rows: 'auto' leaves the embedding and the routers' gates to FSDP2", "torchtitan_moe/models/qwen3_moe/parallelize.py",
      'if setting == "fsdp" or (setting == "auto" and why_not):', 'if setting != "rows" or why_not:',
      ("tests/test_sharded_init.py", "-m", "slow", "-k", "two_rank")),
    M("router gate by rows: each rank keeps its own tokens' gradient (no reduce-scatter in backward)",
      "torchtitan_moe/compat/collectives.py",
      "return reduce_scatter_sum(grad.contiguous(), ctx.mesh), None",
      "return grad.chunk(ctx.mesh.size())[ctx.mesh.get_local_rank()].contiguous(), None",
      ("tests/test_router_gate_rows.py",)),
    M("router gate by rows: every rank keeps the first rows", "torchtitan_moe/parallel/router_gate.py",
      "[mesh.get_local_rank()].clone()", "[0].clone()", ("tests/test_router_gate_rows.py",)),
    M("router gate by rows: the router reads its own rows only (no all-gather)", "torchtitan_moe/moe/router.py",
      "weight = gathered_rows(weight)", "weight = weight.to_local()", ("tests/test_router_gate_rows.py",)),
    M("bench_train --gpu-power: the window starts at the first timed step's log (one logged interval short)",
      "torchtitan_moe/tools/bench_train.py", 'result["window"] = ((untimed or timed)[-1]["time"], timed[-1]["time"])',
      'result["window"] = (timed[0]["time"], timed[-1]["time"])', ("tests/test_gpu_power.py",)),
    M("gpu_power: the held-by-power-cap share counts every clock-limit reason", "torchtitan_moe/tools/gpu_power.py",
      "sum(bool(s.reasons & POWER_CAP) for s in mine)", "sum(bool(s.reasons) for s in mine)",
      ("tests/test_gpu_power.py",)),
    M("bench_train --gpu-power: tokens per joule from the GPUs' median power, not their mean",
      "torchtitan_moe/tools/bench_train.py", 'g.get("mean_watts", g["watts"])', 'g["watts"]',
      ("tests/test_gpu_power.py", "-k", "tokens_per_joule")),
    M("train_step: a logging step's line read before the next step is queued (the GPU drains)",
      "torchtitan_moe/train/step.py",
      "    trainer.optimizers.zero_grad()\n    lr = ",
      "    flush_log(trainer)\n    trainer.optimizers.zero_grad()\n    lr = ",
      ("tests/test_train_cpu.py", "-k", "once_the_next_step")),
    M("train_step: a line timed from the last line's writing, not from the last logged step's end",
      "torchtitan_moe/components/metrics.py",
      "        if elapsed is None:\n            elapsed = time.perf_counter() - self.time_last_log",
      "        elapsed = time.perf_counter() - self.time_last_log",
      ("tests/test_train_cpu.py", "-k", "own_steps")),
    M("train_step: a run whose data runs out loses its last logged step's line", "torchtitan_moe/train/trainer.py",
      "            flush_log(self)  # the last logged step's line", "            pass  # the last logged step's line",
      ("tests/test_train_cpu.py", "-k", "once_the_next_step")),
    M("metrics: a stale working copy found at a monitor step does not stop the run", "torchtitan_moe/components/metrics.py",
      "        if stale:  # after the line and the record", "        if False:  # after the line and the record",
      ("tests/test_train_cpu.py", "-k", "stale_working_copy")),
    M("bench_train --report: the runs trained again", "torchtitan_moe/tools/bench_train.py",
      "            if args.report:  # the run is in --out already (or failed there)",
      "            if False:  # the run is in --out already (or failed there)",
      ("tests/test_bench_train.py", "-k", "report")),
    M("parity: one seed checkpoint for every model", "torchtitan_moe/tools/parity.py",
      'seed_dir = out / f"seed-{seed_key(model_args)}"', 'seed_dir = out / "seed"',
      ("tests/test_parity.py", "-m", "not slow")),
    M("parity: --deterministic repeat not judged", "torchtitan_moe/tools/parity.py",
      "repeat_ok = repeat_is_bitwise(runs[0], repeat)", "repeat_ok = True",
      ("tests/test_parity.py", "-m", "not slow")),
]


def copy_of_repository(into: Path) -> Path:
    """The sources, tests, configs and scripts, without environments, outputs or git."""
    skip = shutil.ignore_patterns(".git", ".venv", ".whl", ".diag", "outputs", "third_party", "__pycache__", "*.egg-info")
    return Path(shutil.copytree(ROOT, into / ROOT.name, ignore=skip))


def run_tests(tests: tuple[str, ...], timeout: int, root: Path) -> tuple[bool, str, float]:
    """(caught, first failing test or why, seconds), for the tests of the copy at `root`."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    # The copy's package first: an editable install would otherwise import the working tree's.
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    start = time.time()
    try:
        result = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout,
                                env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=path))
    except subprocess.TimeoutExpired:
        return True, f"timed out after {timeout} s", time.time() - start
    seconds = time.time() - start
    if result.returncode == 0:
        return False, "-", seconds
    if result.returncode == 5:  # pytest found no test: the selection is wrong, not the code
        raise SystemExit(f"no test selected by {' '.join(tests)}: fix the mutation's tests")
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", result.stdout, re.MULTILINE)
    if failed:
        return True, failed[0].removeprefix("tests/"), seconds
    return True, f"pytest exit {result.returncode}: " + (result.stdout.strip().splitlines() or ["?"])[-1], seconds


def apply(mutation: Mutation, root: Path) -> str:
    """Patch the file in the copy at `root`; returns its original text."""
    path = root / mutation.path
    text = path.read_text()
    if text.count(mutation.old) != 1:
        raise SystemExit(f"mutation {mutation.name!r}: {mutation.path} has {text.count(mutation.old)} "
                         f"copies of the text to replace (need 1): update the mutation")
    path.write_text(text.replace(mutation.old, mutation.new))
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], help="run mutations whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutation's tests")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or any(o in m.name for o in args.only)]
    if args.list:
        for m in chosen:
            print(f"{m.name:55s} {m.path:45s} {' '.join(m.tests)}")
        return 0
    for m in chosen:  # every patch still applies before anything is touched
        if (ROOT / m.path).read_text().count(m.old) != 1:
            raise SystemExit(f"mutation {m.name!r}: the text to replace is not (once) in {m.path}")

    rows = []
    with tempfile.TemporaryDirectory(prefix="mutation_check_") as tmp:
        root = copy_of_repository(Path(tmp))
        for m in chosen:
            original = apply(m, root)
            try:
                caught, by, seconds = run_tests(m.tests, args.timeout, root)
            finally:
                (root / m.path).write_text(original)
            rows.append((m, caught, by, seconds))
            print(f"{'caught  ' if caught else 'SURVIVED'} {m.name} ({seconds:.0f} s): {by}", flush=True)

    print("\n| mutation | file | caught by (first failing test) | verdict |\n|---|---|---|---|")
    for m, caught, by, _ in rows:
        print(f"| {m.name} | `{m.path.removeprefix('torchtitan_moe/')}` | `{by}` | {'caught' if caught else 'SURVIVED'} |")
    survived = [m.name for m, caught, _, _ in rows if not caught]
    print(f"\n{len(rows) - len(survived)} of {len(rows)} mutations caught" + (f"; survived: {survived}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
