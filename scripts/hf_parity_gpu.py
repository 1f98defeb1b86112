"""Hugging Face parity on a GPU: our qwen3_moe against transformers' Qwen3MoeForCausalLM, in fp32 and
bf16, on a larger random config (Qwen3-30B-A3B's layer: dim 2048, 32/4 heads of 128, 128 experts,
top-8, inter 768; 4 layers and a 32k vocabulary by default).

    python scripts/hf_parity_gpu.py [--out DIR] [--layers 4] [--vocab 32768] [--batch 2] [--seq 2048]
    python scripts/hf_parity_gpu.py --device cpu --flavor debug --layers 2 --vocab 512 --seq 64  # smoke run

Both directions, with weights rounded to bf16 so that the fp32 and bf16 copies hold the same numbers:
  hf -> ours   a random transformers model saved with save_pretrained, read by `convert.load_hf`;
  ours -> hf   our random model (init_weights) through the adapter, read by `from_pretrained`.
Checks, per direction: fp32 logits agree (relative error <= 1e-5, TF32 off); in bf16, each side's
logits are compared with the fp32 ones of the same weights, and ours must be no further from them
than transformers' own bf16 (relative error <= 1.5x, top-1 agreement >= transformers' - 1 point).
Writes results.json and results.md to --out (default $OUT); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan_moe.hf import convert  # noqa: E402
from torchtitan_moe.models.qwen3_moe import Qwen3MoEModel, Qwen3MoEStateDictAdapter, flavor_args  # noqa: E402
from torchtitan_moe.models.qwen3_moe.state_dict_adapter import hf_config  # noqa: E402

FP32_RTOL = 1e-5
BF16_ERR_RATIO = 1.5
TOP1_SLACK = 0.01


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "outputs/hf_parity_gpu"))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--flavor", default="30b-a3b", help="dims, heads, experts, top-k, rope theta and eps from it")
    p.add_argument("--device", default="cuda")
    return p.parse_args(argv)


def model_args(opts):
    args = flavor_args(opts.flavor)
    args.n_layers, args.vocab_size, args.max_seq_len = opts.layers, opts.vocab, opts.seq
    return args


def round_to_bf16_(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def params_to_(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast parameters only: buffers (RoPE cache, expert bias) stay fp32, as under FSDP2 mixed precision."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


@torch.no_grad()
def logits(model, tokens, hf: bool) -> torch.Tensor:
    out = model(tokens).logits if hf else model(tokens)
    return out.float()


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = (got.double() - ref.double())
    return {
        "rel_err": float(diff.norm() / ref.double().norm()),
        "max_abs_err": float(diff.abs().max()),
        "top1_agree": float((got.argmax(-1) == ref.argmax(-1)).double().mean()),
    }


def free(*objs) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def hf_to_ours(transformers, args, tokens, tmp: Path, seed: int) -> dict:
    device = tokens.device
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**{k: v for k, v in hf_config(args, torch.bfloat16).items()
                                            if k not in ("architectures", "model_type", "torch_dtype")})
    with device:
        hf = transformers.Qwen3MoeForCausalLM(config).eval()
    round_to_bf16_(hf)
    ref = logits(hf, tokens, hf=True)
    params_to_(hf, torch.bfloat16)
    hf_bf16 = logits(hf, tokens, hf=True)
    hf.save_pretrained(tmp / "hf")  # bf16: the same numbers as the fp32 copy
    free(hf)

    read_args = convert.read_hf_args(str(tmp / "hf"))
    with device:
        ours = Qwen3MoEModel(read_args).eval()
    ours.load_state_dict(convert.load_hf(str(tmp / "hf"), read_args, torch.float32, show_progress=False), strict=True)
    ours_fp32 = logits(ours, tokens, hf=False)
    params_to_(ours, torch.bfloat16)
    ours_bf16 = logits(ours, tokens, hf=False)
    free(ours)
    return {"fp32": compare(ours_fp32, ref), "hf_bf16": compare(hf_bf16, ref), "ours_bf16": compare(ours_bf16, ref)}


def ours_to_hf(transformers, args, tokens, tmp: Path, seed: int) -> dict:
    from safetensors.torch import save_file

    device = tokens.device
    torch.manual_seed(seed + 1)
    with device:
        ours = Qwen3MoEModel(args).eval()
    with torch.no_grad():
        ours.init_weights()
    round_to_bf16_(ours)
    ref = logits(ours, tokens, hf=False)
    params_to_(ours, torch.bfloat16)
    ours_bf16 = logits(ours, tokens, hf=False)
    hf_state = Qwen3MoEStateDictAdapter(args).to_hf(ours.state_dict())
    (tmp / "ours").mkdir()
    save_file({k: v.contiguous() for k, v in hf_state.items()}, tmp / "ours" / "model.safetensors", metadata={"format": "pt"})
    (tmp / "ours" / "config.json").write_text(json.dumps(hf_config(args, torch.bfloat16)))
    free(ours, hf_state)

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp / "ours", dtype=torch.float32).to(device).eval()
    hf_fp32 = logits(hf, tokens, hf=True)
    params_to_(hf, torch.bfloat16)
    hf_bf16 = logits(hf, tokens, hf=True)
    free(hf)
    return {"fp32": compare(hf_fp32, ref), "hf_bf16": compare(hf_bf16, ref), "ours_bf16": compare(ours_bf16, ref)}


def verdicts(result: dict) -> dict[str, bool]:
    return {
        "fp32 rel_err <= 1e-5": result["fp32"]["rel_err"] <= FP32_RTOL,
        f"bf16 rel_err ours <= {BF16_ERR_RATIO} x transformers'": (
            result["ours_bf16"]["rel_err"] <= BF16_ERR_RATIO * result["hf_bf16"]["rel_err"]),
        "bf16 top-1 agreement ours >= transformers' - 1 point": (
            result["ours_bf16"]["top1_agree"] >= result["hf_bf16"]["top1_agree"] - TOP1_SLACK),
    }


def main(argv=None) -> int:
    opts = parse(argv)
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("hf_parity_gpu: needs a CUDA GPU (--device cpu for a smoke run)", file=sys.stderr)
        return 2
    try:
        import transformers
    except ImportError:
        print("hf_parity_gpu: needs transformers (pip install -e .[test])", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    args = model_args(opts)
    tokens = torch.randint(0, args.vocab_size, (opts.batch, opts.seq),
                           generator=torch.Generator().manual_seed(opts.seed)).to(opts.device)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="hf_parity_"))
    device_name = torch.cuda.get_device_name() if opts.device == "cuda" else opts.device
    results = {"device": device_name, "torch": torch.__version__,
               "transformers": transformers.__version__,
               "config": {"dim": args.dim, "layers": args.n_layers, "heads": f"{args.n_heads}/{args.n_kv_heads}x{args.head_dim}",
                          "experts": args.moe.num_experts, "top_k": args.moe.top_k, "inter": args.moe.inter_dim,
                          "vocab": args.vocab_size, "tokens": f"{opts.batch}x{opts.seq}"}}
    try:
        for name, run in (("hf -> ours", hf_to_ours), ("ours -> hf", ours_to_hf)):
            start = time.perf_counter()
            result = run(transformers, args, tokens, tmp, opts.seed)
            result["checks"] = verdicts(result)
            result["seconds"] = round(time.perf_counter() - start, 1)
            results[name] = result
            print(name, json.dumps(result, indent=2), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ok = all(all(results[name]["checks"].values()) for name in ("hf -> ours", "ours -> hf"))
    results["pass"] = ok
    (out / "results.json").write_text(json.dumps(results, indent=2))
    lines = [f"# Hugging Face parity, {results['device']}, torch {results['torch']}, transformers {results['transformers']}",
             "", f"config: {results['config']}", "",
             "| direction | logits | rel err | max abs err | top-1 agree (vs fp32) |", "|---|---|---|---|---|"]
    for name in ("hf -> ours", "ours -> hf"):
        for key, label in (("fp32", "fp32 (other side vs this side)"), ("hf_bf16", "transformers bf16"),
                           ("ours_bf16", "ours bf16")):
            m = results[name][key]
            lines.append(f"| {name} | {label} | {m['rel_err']:.3e} | {m['max_abs_err']:.3e} | {m['top1_agree']:.4f} |")
    lines += ["", *(f"- {name}: {check}: {'ok' if v else 'FAIL'}" for name in ("hf -> ours", "ours -> hf")
                    for check, v in results[name]["checks"].items())]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
