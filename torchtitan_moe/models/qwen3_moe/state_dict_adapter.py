"""Our qwen3_moe state dict <-> Hugging Face Qwen3-MoE as published on the hub, and Qwen3MoEArgs
<-> its config.json.

    ours                                      Hugging Face
    tok_embeddings.weight                     model.embed_tokens.weight
    layers.{i}.attention_norm.weight          model.layers.{i}.input_layernorm.weight
    layers.{i}.attention.wq|wk|wv|wo.weight   model.layers.{i}.self_attn.q_proj|k_proj|v_proj|o_proj.weight
    layers.{i}.attention.q_norm|k_norm.weight model.layers.{i}.self_attn.q_norm|k_norm.weight
    layers.{i}.ffn_norm.weight                model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.moe.router.gate.weight [E, D]  model.layers.{i}.mlp.gate.weight
    layers.{i}.moe.experts.w13 [E, 2I, D]     model.layers.{i}.mlp.experts.{e}.gate_proj.weight = w13[e, :I]
                                              model.layers.{i}.mlp.experts.{e}.up_proj.weight   = w13[e, I:]
    layers.{i}.moe.experts.w2 [E, D, I]       model.layers.{i}.mlp.experts.{e}.down_proj.weight = w2[e]
    layers.{i}.moe.router.expert_bias [E]     (none: Hugging Face Qwen3-MoE picks experts without a bias)
    norm.weight, output.weight                model.norm.weight, lm_head.weight

The math is the same on both sides (tests/test_hf.py checks logits against transformers): RoPE on
rotate-half pairs with the same frequencies, RMSNorm of q and k per head before RoPE, softmax over
the gate logits, top-k, renormalized when norm_topk_prob (our route_norm).

Sharded state dicts (FSDP2, EP) stay sharded: a rank turns only the experts it holds into
per-expert tensors (DTensors over the mesh dims that do not split experts), so torchtitan's
`initial_load_in_hf` / `last_save_in_hf` read and write each rank's part only.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from torchtitan_moe.models.qwen3_moe.args import FLAVORS, Qwen3MoEArgs
from torchtitan_moe.compat.torchtitan import StateDictAdapter

# Keys outside the blocks, and keys inside block {i} (relative to "layers.{i}." / "model.layers.{i}.").
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
}
_NO_HF_COUNTERPART = {"moe.router.expert_bias"}
_OUR_BLOCK_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_HF_BLOCK_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_EXPERT_KEY = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


class HFConversionError(ValueError):
    """A state dict or config that has no faithful counterpart on the other side (one line)."""


def _shard_dim(placement) -> int | None:
    """The tensor dim a placement splits, or None (Replicate, Partial)."""
    if placement.is_shard() or isinstance(placement, _StridedShard):
        return placement.dim
    return None


@dataclass
class _ExpertLayout:
    """How a rank holds one stacked expert weight [E, R, C], recorded by to_hf for from_hf."""

    mesh: Any
    placements: tuple  # the parameter's own
    split_placements: tuple  # those of the tensor that was split per expert
    shape: torch.Size
    first_expert: int
    num_local: int


class Qwen3MoEStateDictAdapter(StateDictAdapter):
    """torchtitan's StateDictAdapter for qwen3_moe (registered in the TrainSpec)."""

    def __init__(self, model_args: Qwen3MoEArgs, hf_assets_path: str | None = None):
        # torchtitan's base reads model.safetensors.index.json there, to shard a save like the
        # published checkpoint, and warns on every run without one (our default "." has none).
        index = hf_assets_path and os.path.isfile(os.path.join(hf_assets_path, "model.safetensors.index.json"))
        super().__init__(model_args, hf_assets_path if index else None)
        self.hf_assets_path = hf_assets_path  # where initial_load_in_hf reads without initial_load_path
        self.model_args = model_args
        self._layouts: dict[str, _ExpertLayout] = {}

    # -- ours -> Hugging Face ---------------------------------------------------------------

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        hf: dict[str, Any] = {}
        for key, value in state_dict.items():
            block = _OUR_BLOCK_KEY.fullmatch(key)
            if block is None:
                if key == "output.weight" and self.model_args.enable_weight_tying:
                    continue  # tied to the embedding: Hugging Face stores it once
                hf[_lookup(_TOP, key)] = value
                continue
            layer, name = block.groups()
            prefix = f"model.layers.{layer}."
            if name in _NO_HF_COUNTERPART:
                continue
            if name in ("moe.experts.w13", "moe.experts.w2"):
                hf.update(self._split_experts(key, prefix, value))
            else:
                hf[prefix + _lookup(_BLOCK, name, key)] = value
        return hf

    def _split_experts(self, key: str, prefix: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        local, first, sub_mesh, sub_placements = self._local_experts(key, weight)
        inter = self.model_args.moe.inter_dim
        out = {}
        for i in range(local.shape[0]):
            expert = f"{prefix}mlp.experts.{first + i}."
            if key.endswith("w13"):
                parts = {"gate_proj": local[i, :inter], "up_proj": local[i, inter:]}
                full_shape = (inter, weight.shape[2])
            else:
                parts = {"down_proj": local[i]}
                full_shape = tuple(weight.shape[1:])
            for proj, part in parts.items():
                if sub_mesh is not None:
                    part = DTensor.from_local(part, sub_mesh, sub_placements, run_check=False,
                                              shape=torch.Size(full_shape), stride=_contiguous_stride(full_shape))
                out[f"{expert}{proj}.weight"] = part
        return out

    def _local_experts(self, key: str, weight: torch.Tensor):
        """weight [E, R, C] -> (this rank's [E_here, R_here, C_here], its first expert id,
        the sub-mesh and placements of one expert's [R, C] part, or None for a plain tensor)."""
        if not isinstance(weight, DTensor):
            return weight, 0, None, None
        mesh, placements = weight.device_mesh, tuple(weight.placements)
        # w13's rows are gate | up. A mesh dim that splits rows (experts fewer than expert-FSDP
        # ranks) splits columns instead here, so that each rank holds whole rows of both halves.
        split = tuple(Shard(2) if key.endswith("w13") and _shard_dim(p) == 1 else p for p in placements)
        if split != placements:
            weight = weight.redistribute(mesh, split)
        local_shape, offset = compute_local_shape_and_global_offset(weight.shape, mesh, split)
        self._layouts[key] = _ExpertLayout(mesh, placements, split, weight.shape, offset[0], local_shape[0])
        names, sub_placements = [], []
        for name, placement in zip(mesh.mesh_dim_names, split):
            dim = _shard_dim(placement)
            if dim == 0:
                continue  # splits experts: this rank's experts are whole along that mesh dim
            if dim is not None and not placement.is_shard():
                raise HFConversionError(f"{key}: placement {placement} is not supported for the Hugging Face layout")
            names.append(name)
            sub_placements.append(Replicate() if dim is None else Shard(dim - 1))
        sub_mesh = mesh[tuple(names)] if names else None
        return weight.to_local(), offset[0], sub_mesh, sub_placements

    # -- Hugging Face -> ours ---------------------------------------------------------------

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict: dict[str, Any] = {}
        experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}  # layer -> proj -> expert -> tensor
        top = {hf: ours for ours, hf in _TOP.items()}
        block = {hf: ours for ours, hf in _BLOCK.items()}
        for hf_key, value in hf_state_dict.items():
            match = _HF_BLOCK_KEY.fullmatch(hf_key)
            if match is None:
                state_dict[_lookup(top, hf_key)] = value
                continue
            layer, name = match.groups()
            expert = _HF_EXPERT_KEY.fullmatch(name)
            if expert is None:
                state_dict[f"layers.{layer}.{_lookup(block, name, hf_key)}"] = value
            else:
                experts.setdefault(layer, {}).setdefault(expert.group(2), {})[int(expert.group(1))] = value
        if self.model_args.enable_weight_tying and "output.weight" not in state_dict:
            state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
        for layer, projs in experts.items():
            key = f"layers.{layer}.moe.experts."
            gate, up = self._stack(key + "w13", projs, "gate_proj"), self._stack(key + "w13", projs, "up_proj")
            state_dict[key + "w13"] = self._join(key + "w13", torch.cat([gate, up], dim=1))
            state_dict[key + "w2"] = self._join(key + "w2", self._stack(key + "w2", projs, "down_proj"))
        return state_dict

    def _stack(self, key: str, projs: dict[str, dict[int, torch.Tensor]], proj: str) -> torch.Tensor:
        """This rank's experts of one projection, local parts stacked: [E_here, R_here, C_here]."""
        layout = self._layouts.get(key)
        first, count = (layout.first_expert, layout.num_local) if layout else (0, self.model_args.moe.num_experts)
        found = projs.get(proj, {})
        if sorted(found) != list(range(first, first + count)):
            have = f"{min(found)}..{max(found)}" if found else "none"
            raise HFConversionError(
                f"{key}: needs {proj} of experts {first}..{first + count - 1}, found {have} "
                f"([moe] num_experts = {self.model_args.moe.num_experts})"
            )
        return torch.stack([found[e].to_local() if isinstance(found[e], DTensor) else found[e]
                            for e in range(first, first + count)])

    def _join(self, key: str, local: torch.Tensor) -> torch.Tensor:
        """The inverse of _local_experts: this rank's stacked experts -> the parameter's layout."""
        layout = self._layouts.get(key)
        if layout is None:
            return local
        weight = DTensor.from_local(local, layout.mesh, layout.split_placements, run_check=False,
                                    shape=layout.shape, stride=_contiguous_stride(layout.shape))
        if layout.split_placements != layout.placements:
            weight = weight.redistribute(layout.mesh, layout.placements)
        return weight


def _lookup(table: dict[str, str], name: str, key: str | None = None) -> str:
    if name not in table:
        raise HFConversionError(f"{key or name}: no counterpart in the Hugging Face Qwen3-MoE layout")
    return table[name]


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(tuple(shape)):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


# ---------------------------------------------------------------------------------------
# config.json
# ---------------------------------------------------------------------------------------


def check_exportable(args: Qwen3MoEArgs) -> None:
    """Refuse (one line) model settings that Hugging Face Qwen3-MoE cannot express."""
    router = args.moe.router
    if router.score_func != "softmax":
        raise HFConversionError(f"[router] score_func = {router.score_func!r}: Hugging Face Qwen3-MoE routes with softmax")
    if router.route_scale != 1.0:
        raise HFConversionError(f"[router] route_scale = {router.route_scale}: Hugging Face Qwen3-MoE has no route scale (1.0)")
    if router.topk_groups < router.n_groups:
        raise HFConversionError(f"[router] n_groups = {router.n_groups}, topk_groups = {router.topk_groups}: Hugging Face "
                                "Qwen3-MoE picks its top-k over all experts (no group-limited routing)")
    if not args.qk_norm:
        raise HFConversionError("qk_norm = False: Hugging Face Qwen3-MoE always normalizes q and k")


def hf_config(args: Qwen3MoEArgs, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """config.json for `args`, with the keys of the published Qwen3-MoE checkpoints."""
    check_exportable(args)
    moe = args.moe
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.inter_dim,
        "norm_topk_prob": moe.router.route_norm,
        # Every layer is an MoE layer; the dense width is unused (the hub's 30B-A3B states 8 x 768).
        "intermediate_size": moe.top_k * moe.inter_dim,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        # Training only (output_router_logits is off): transformers normalizes its loss differently.
        "router_aux_loss_coef": moe.router.balance_loss_coeff,
        "output_router_logits": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": args.enable_weight_tying,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def args_from_hf_config(config: dict[str, Any], source: str = "config.json") -> Qwen3MoEArgs:
    """Qwen3MoEArgs of a Qwen3-MoE config.json (transformers 4.x or 5.x spelling)."""

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise HFConversionError(f"{source}: {what}")

    need(config.get("model_type") == "qwen3_moe", f"model_type = {config.get('model_type')!r}, expected 'qwen3_moe'")
    need(config.get("hidden_act", "silu") == "silu", f"hidden_act = {config.get('hidden_act')!r}: only 'silu'")
    need(not config.get("attention_bias", False), "attention_bias = true: our attention has no biases")
    need(not config.get("mlp_only_layers") and config.get("decoder_sparse_step", 1) == 1,
         "dense MLP layers (mlp_only_layers / decoder_sparse_step): every layer of ours is an MoE layer")
    need(not config.get("use_sliding_window", False), "use_sliding_window = true: we attend causally over the full sequence")
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    need(rope.get("rope_type", "default") == "default" and scaling.get("rope_type", scaling.get("type", "default")) == "default",
         "RoPE scaling is not supported (rope_type must be 'default')")
    num_experts = config.get("num_experts", config.get("num_local_experts"))
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    base = Qwen3MoEArgs()
    args = Qwen3MoEArgs(
        dim=hidden,
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or hidden // heads,
        vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
        max_seq_len=config.get("max_position_embeddings", base.max_seq_len),
        enable_weight_tying=config.get("tie_word_embeddings", False),
    )
    router = dataclasses.replace(args.moe.router, score_func="softmax",
                                 route_norm=bool(config.get("norm_topk_prob", False)), route_scale=1.0)
    args.moe = dataclasses.replace(args.moe, num_experts=num_experts, top_k=config["num_experts_per_tok"],
                                   inter_dim=config["moe_intermediate_size"], router=router)
    return args


# Fields that fix the weights' shapes and the forward pass; the rest (max_seq_len, router
# training knobs, kernels) are settings of a run.
ARCH_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "norm_eps", "rope_theta",
               "enable_weight_tying")
ARCH_MOE_FIELDS = ("num_experts", "top_k", "inter_dim")
ARCH_ROUTER_FIELDS = ("route_norm",)


def arch_differences(a: Qwen3MoEArgs, b: Qwen3MoEArgs) -> list[str]:
    """'name: a vs b' for each architecture field that differs."""
    diffs = [f"{f}: {getattr(a, f)} vs {getattr(b, f)}" for f in ARCH_FIELDS if getattr(a, f) != getattr(b, f)]
    diffs += [f"{f}: {getattr(a.moe, f)} vs {getattr(b.moe, f)}" for f in ARCH_MOE_FIELDS
              if getattr(a.moe, f) != getattr(b.moe, f)]
    diffs += [f"{f}: {getattr(a.moe.router, f)} vs {getattr(b.moe.router, f)}" for f in ARCH_ROUTER_FIELDS
              if getattr(a.moe.router, f) != getattr(b.moe.router, f)]
    return diffs


def matching_flavor(args: Qwen3MoEArgs) -> str | None:
    """The shipped flavor with `args`' architecture, if one has it, ignoring what [moe] can set."""
    for name, flavor in FLAVORS.items():
        moe_free = [d for d in arch_differences(flavor, args) if d.split(":")[0] not in ("num_experts", "top_k", "inter_dim", "route_norm")]
        if not moe_free:
            return name
    return None
