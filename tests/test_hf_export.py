"""Hugging Face folders at the size users have them: several safetensors shards and their index, in every
direction. `convert to-hf` writing shards, a transformers checkpoint saved in shards read by `convert from-hf`
and by the trainer's initial_load_in_hf, and the trainer's last_save_in_hf sharded like [model] hf_assets_path:
each read back by transformers (no weight missing, our logits). And the export a run cannot make is refused
before it trains. (Single-file folders: test_hf.py.)"""

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchtitan_moe.hf import convert
from torchtitan_moe.models.qwen3_moe import Qwen3MoEModel, Qwen3MoEStateDictAdapter, flavor_args
from torchtitan_moe.train.checkpoint import record_model_args, write_model_args

from test_hf import build_ours, hf_tiny_config, randomize_, rel_err, tokens

transformers = pytest.importorskip("transformers", reason="the Hugging Face tests need `pip install -e .[test]`")
from safetensors import safe_open  # noqa: E402 (transformers brings it)

RTOL = 1e-5
SHARD_BYTES = 200_000  # a tiny model's 0.7 MB in fp32: four shards


def small_args():
    args = flavor_args("debug")
    args.dim, args.n_layers, args.vocab_size, args.max_seq_len, args.rope_theta, args.norm_eps = 64, 2, 300, 64, 2e4, 1e-5
    args.moe = dataclasses.replace(args.moe, num_experts=6, top_k=2, inter_dim=40)
    return args


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    """(args, our model with random weights, its DCP step folder)."""
    args = small_args()
    torch.manual_seed(0)
    model = build_ours(args)
    randomize_(model, seed=2)
    step = tmp_path_factory.mktemp("run") / "step-3"
    dcp.save(model.state_dict(), checkpoint_id=str(step))
    write_model_args(str(step), args)
    return args, model, step


def shard_contents(folder) -> dict[str, str]:
    """Every tensor key -> the safetensors file that holds it, read from the files themselves."""
    found = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                for key in f.keys():
                    assert key not in found, f"{key} in {found.get(key)} and {name}"
                    found[key] = name
    return found


def assert_index_matches_the_shards(folder) -> dict:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == shard_contents(folder)  # every key, in the file that holds it
    total = 0
    for name in set(index["weight_map"].values()):
        with safe_open(str(folder / name), framework="pt") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys())
    assert index["metadata"]["total_size"] == total
    return index


def transformers_logits(folder, x):
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                                 output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info  # no weight missing, unexpected or mismatched
    with torch.no_grad():
        return hf.eval()(x).logits


def test_to_hf_in_shards_loads_in_transformers_and_converts_back(ours, tmp_path):
    args, model, step = ours
    out = tmp_path / "hf"
    assert convert.main(["to-hf", str(step), str(out), "--dtype", "float32", "--shard-gb", str(SHARD_BYTES / 2**30)]) == 0
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert names == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    index = assert_index_matches_the_shards(out)
    for name in names:  # each shard within the limit (none of these tensors is larger on its own)
        assert (out / name).stat().st_size <= SHARD_BYTES + 10_000, name
    # Layer by layer: the embedding in the first shard, the head in the last.
    assert index["weight_map"]["model.embed_tokens.weight"] == names[0] and index["weight_map"]["lm_head.weight"] == names[-1]

    x = tokens(300)
    with torch.no_grad():
        expected = model(x)
    got = transformers_logits(out, x)
    assert rel_err(got, expected) <= RTOL, rel_err(got, expected)

    assert convert.main(["from-hf", str(out), str(tmp_path / "back")]) == 0
    back = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load(back, checkpoint_id=str(tmp_path / "back"))
    for key, value in model.state_dict().items():
        assert torch.equal(back[key], value), key


def test_to_hf_in_bf16_shards_holds_the_weights_rounded_once(ours, tmp_path):
    args, model, step = ours
    out = tmp_path / "hf"
    assert convert.main(["to-hf", str(step), str(out), "--shard-gb", str(SHARD_BYTES / 2 / 2**30)]) == 0  # bfloat16
    assert len(list(out.glob("*.safetensors"))) == 4 and json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert_index_matches_the_shards(out)
    ours_hf = Qwen3MoEStateDictAdapter(args).to_hf(model.state_dict())
    for key, name in shard_contents(out).items():
        with safe_open(str(out / name), framework="pt") as f:
            assert torch.equal(f.get_tensor(key), ours_hf[key].to(torch.bfloat16)), key


@pytest.fixture(scope="module")
def transformers_shards(tmp_path_factory):
    """A random transformers Qwen3-MoE saved in shards of 100 kB, and the model."""
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(hf_tiny_config(norm_topk_prob=True)).eval()
    randomize_(hf, seed=1)
    folder = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(folder, max_shard_size="100KB")
    assert len(list(folder.glob("*.safetensors"))) >= 4 and (folder / "model.safetensors.index.json").is_file()
    return folder, hf


def test_a_transformers_checkpoint_in_shards_converts_to_our_logits(transformers_shards, tmp_path):
    folder, hf = transformers_shards
    out = tmp_path / "dcp"
    assert convert.main(["from-hf", str(folder), str(out)]) == 0
    args = convert.read_hf_args(str(folder))
    model = Qwen3MoEModel(args).eval()
    state = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=str(out))
    model.load_state_dict(state, strict=True)
    x = tokens(320)
    with torch.no_grad():
        assert rel_err(model(x), hf(x).logits) <= RTOL


@pytest.fixture
def one_rank_group(tmp_path):
    """A process group of this process alone, as the trainer has (rank 0 writes the export's index)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def checkpointer(args, hf_assets_path, folder, model_state=None):
    """torchtitan's CheckpointManager as far as its Hugging Face save and load go, with our adapter."""
    from torchtitan.components.checkpoint import AsyncMode, CheckpointManager

    manager = SimpleNamespace(sd_adapter=Qwen3MoEStateDictAdapter(args, str(hf_assets_path)), pg=None, folder=str(folder),
                              states={"model": SimpleNamespace(load_state_dict=model_state.update if model_state is not None else None)})

    def save(curr_step, last_step=False):  # the last step's save with last_save_in_hf, as the trainer makes it
        CheckpointManager.dcp_save(manager, dict(manager.model.state_dict()), os.path.join(manager.folder, f"step-{curr_step}"),
                                   AsyncMode.DISABLED, to_hf=True)

    manager.save = save
    manager.load = lambda state, path: CheckpointManager.dcp_load(manager, state, path, from_hf=True, from_quantized=False)
    return manager


def test_the_trainers_export_is_sharded_like_hf_assets_and_loads_in_transformers(ours, transformers_shards, tmp_path,
                                                                                  one_rank_group):
    # [model] hf_assets_path names a folder in 4 shards (our own export of this model): last_save_in_hf writes the
    # same shards, their index, and (record_model_args) config.json.
    args, model, step = ours
    assets = tmp_path / "assets"
    assert convert.main(["to-hf", str(step), str(assets), "--dtype", "float32", "--shard-gb", str(SHARD_BYTES / 2**30)]) == 0
    manager = checkpointer(args, assets, tmp_path / "checkpoint")
    manager.model = model
    record_model_args(manager, args, torch.float32)
    manager.save(10, last_step=True)
    export = tmp_path / "checkpoint" / "step-10"
    index = assert_index_matches_the_shards(export)
    assert index["weight_map"] == json.loads((assets / "model.safetensors.index.json").read_text())["weight_map"]
    assert (export / "config.json").is_file() and (export / "model_args.json").is_file()
    x = tokens(300)
    with torch.no_grad():
        expected = model(x)
    assert rel_err(transformers_logits(export, x), expected) <= RTOL


def test_the_trainers_initial_load_in_hf_reads_a_checkpoint_in_shards(transformers_shards, tmp_path, one_rank_group):
    folder, hf = transformers_shards
    args = convert.read_hf_args(str(folder))
    model = Qwen3MoEModel(args).eval()
    loaded = {}
    manager = checkpointer(args, folder, tmp_path, loaded)
    manager.load({k: torch.empty_like(v) for k, v in model.state_dict().items()}, str(folder))
    loaded.update({k: v for k, v in model.state_dict().items() if k not in loaded})  # the expert bias: HF has none
    model.load_state_dict(loaded, strict=True)
    x = tokens(320)
    with torch.no_grad():
        assert rel_err(model(x), hf(x).logits) <= RTOL


@pytest.mark.parametrize("flags, what", [
    (["--router.route_scale", "2.0"], "route_scale = 1.0 only"),
    (["--router.route_scale", "0.5"], "route_scale = 1.0 only"),
    (["--router.score_func", "sigmoid"], "score_func = 'softmax'"),
])
def test_an_export_hf_cannot_express_is_refused_before_training(flags, what, tmp_path, monkeypatch, capsys):
    # The run would train every step and then fail at its last save: refused at once, in one line, nothing written.
    from torchtitan_moe.train import trainer

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")  # recorded, so that what main sets for a run without torchrun is undone after
        monkeypatch.delenv(name)
    dump = tmp_path / "run"
    argv = ["--job.config_file", "configs/debug.toml", "--job.dump_folder", str(dump), "--checkpoint.enable",
            "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", *flags,
            "--training.steps", "1", "--data.workers", "0"]  # short, should it start (in this process)
    assert trainer.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: [checkpoint] last_save_in_hf = true") and what in err[0]
    assert not dump.exists()
