"""Our qwen3_moe is Hugging Face Qwen3-MoE: the same logits as transformers, both ways (fp32, CPU).

A random `Qwen3MoeForCausalLM` saved by transformers is converted to our model; one of our
models exported by `python -m torchtitan_moe.hf.convert to-hf` loads with `from_pretrained`. The
settings differ from every default on purpose (rope theta, norm eps, head_dim != dim / heads,
GQA, norm_topk_prob both ways, random norm weights), so a dropped or swapped detail shows.
"""

import dataclasses
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchtitan_moe.hf import convert
from torchtitan_moe.train.checkpoint import write_model_args
from torchtitan_moe.models.qwen3_moe import Qwen3MoEModel, Qwen3MoEStateDictAdapter, flavor_args
from torchtitan_moe.models.qwen3_moe.state_dict_adapter import HFConversionError, hf_config

transformers = pytest.importorskip("transformers", reason="the Hugging Face parity tests need `pip install -e .[test]`")

RTOL = 1e-5


def hf_tiny_config(norm_topk_prob: bool):
    return transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=24, intermediate_size=96, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=norm_topk_prob, rms_norm_eps=1e-5, rope_theta=5000.0, max_position_embeddings=64,
        tie_word_embeddings=False, attn_implementation="eager",
    )


def build_ours(args) -> Qwen3MoEModel:
    model = Qwen3MoEModel(args).eval()
    with torch.no_grad():
        model.init_weights()
    return model


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Every weight random, norms around 1, so each tensor's mapping shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            p.copy_(1 + 0.2 * noise if p.dim() == 1 else 0.08 * noise)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).norm() / ref.double().norm())


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_hf_model_converted_gives_our_logits(tmp_path, norm_topk_prob):
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(hf_tiny_config(norm_topk_prob)).eval()
    randomize_(hf, seed=1)
    hf.save_pretrained(tmp_path / "hf")

    args = convert.read_hf_args(str(tmp_path / "hf"))
    assert (args.rope_theta, args.norm_eps, args.head_dim, args.moe.router.route_norm) == (5000.0, 1e-5, 16, norm_topk_prob)
    ours = Qwen3MoEModel(args).eval()
    ours.load_state_dict(convert.load_hf(str(tmp_path / "hf"), args, show_progress=False), strict=True)

    x = tokens(320)
    with torch.no_grad():
        expected = hf(x).logits
        got = ours(x)
    assert rel_err(got, expected) <= RTOL, rel_err(got, expected)


def test_our_export_loads_in_transformers_with_our_logits(tmp_path):
    args = flavor_args("debug")
    args.dim, args.n_layers, args.vocab_size, args.max_seq_len, args.rope_theta, args.norm_eps = 64, 2, 300, 64, 2e4, 1e-5
    args.moe = dataclasses.replace(args.moe, num_experts=6, top_k=2, inter_dim=40)
    torch.manual_seed(0)
    ours = build_ours(args)
    randomize_(ours, seed=2)
    dcp.save(ours.state_dict(), checkpoint_id=str(tmp_path / "step-3"))
    write_model_args(str(tmp_path / "step-3"), args)

    assert convert.main(["to-hf", str(tmp_path / "step-3"), str(tmp_path / "hf"), "--dtype", "float32"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_experts"] == 6 and config["norm_topk_prob"] is True and config["rope_theta"] == 2e4
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"

    x = tokens(300)
    with torch.no_grad():
        expected = ours(x)
        got = hf(x).logits
    assert rel_err(got, expected) <= RTOL, rel_err(got, expected)

    # And back: HF -> DCP gives the same tensors bit for bit.
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = {k: torch.empty_like(v) for k, v in ours.state_dict().items()}
    dcp.load(back, checkpoint_id=str(tmp_path / "back"))
    for key, value in ours.state_dict().items():
        assert torch.equal(back[key], value), key


def test_adapter_round_trip_and_refusals():
    args = flavor_args("debug")
    model = build_ours(args)
    adapter = Qwen3MoEStateDictAdapter(args)
    sd = model.state_dict()
    hf = adapter.to_hf(sd)
    assert "model.layers.3.mlp.experts.7.up_proj.weight" in hf and not any("bias" in k for k in hf)
    assert torch.equal(hf["model.layers.1.mlp.experts.5.up_proj.weight"], sd["layers.1.moe.experts.w13"][5, 128:])
    back = adapter.from_hf(hf)
    assert set(back) == set(sd) - {f"layers.{i}.moe.router.expert_bias" for i in range(4)}
    assert all(torch.equal(back[k], sd[k]) for k in back)

    del hf["model.layers.2.mlp.experts.3.down_proj.weight"]
    with pytest.raises(HFConversionError, match=r"layers\.2\.moe\.experts\.w2: needs down_proj of experts 0\.\.7"):
        adapter.from_hf(hf)
    with pytest.raises(HFConversionError, match="no counterpart"):
        adapter.to_hf({"layers.0.moe.shared_expert.weight": torch.zeros(1)})


def test_to_hf_refuses_what_hf_cannot_express(tmp_path, capsys):
    model = build_ours(flavor_args("debug"))
    model.layers["2"].moe.router.expert_bias[3] = 0.25  # as aux-loss-free balancing leaves it
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))
    out = str(tmp_path / "hf")

    assert convert.main(["to-hf", str(tmp_path / "ckpt"), out]) == 2
    assert "has no model_args.json: pass --config" in capsys.readouterr().err
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), out, "--flavor", "debug"]) == 2
    err = capsys.readouterr().err.strip()
    assert "layers.2.moe.router.expert_bias is not zero (max |bias| 0.25)" in err and "--drop-expert-bias" in err
    assert len(err.splitlines()) == 1
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), out, "--flavor", "debug", "--num-experts", "16"]) == 2
    err = capsys.readouterr().err
    assert "num_experts 8 vs 16 (checkpoint vs this run); set [moe] num_experts" in err
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), out, "--flavor", "30b-a3b"]) == 2
    assert "n_layers 4 vs 48" in capsys.readouterr().err
    # --drop-expert-bias first measures what that costs, on held-out tokens (tests/test_bias_cost.py)
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), out, "--flavor", "debug", "--drop-expert-bias"]) == 2
    assert "measures what dropping the bias costs on held-out tokens first" in capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    (dict(score_func="sigmoid"), "score_func = 'sigmoid'"),
    (dict(route_scale=2.0), "route_scale = 2.0"),
    (dict(n_groups=2, topk_groups=1), "n_groups = 2, topk_groups = 1"),
])
def test_routing_hf_cannot_express_is_refused(change, message):
    args = flavor_args("debug")
    args.moe.router = dataclasses.replace(args.moe.router, **change)
    with pytest.raises(HFConversionError, match=message):
        hf_config(args)
    # every group in use is plain top-k: exportable
    args = flavor_args("debug")
    args.moe.router = dataclasses.replace(args.moe.router, n_groups=2, topk_groups=2)
    hf_config(args)


def test_convert_refuses_a_non_empty_output_folder_unless_forced(tmp_path, capsys):
    model = build_ours(flavor_args("debug"))
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(out), "--flavor", "debug"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"convert: error: {out} is not empty: choose a new output folder, or pass --force to write into it"]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # nothing written
    assert convert.main(["from-hf", str(out), str(tmp_path / "ckpt")]) == 2  # the other way too
    assert "is not empty" in capsys.readouterr().err
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(out), "--flavor", "debug", "--force"]) == 0
    assert (out / "config.json").is_file() and (out / "notes.txt").read_text() == "mine"
