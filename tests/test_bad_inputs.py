"""Every bad input a user can give is refused before launch in exactly one line that names the key
and what is allowed, with exit status 2 and no traceback: the same line whether the value comes
from the TOML file or a command-line flag. In-process through check_config.main (about
0.15 s a case); test_train_cpu runs the launcher end to end."""

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_moe.tools import check_config, plan

from test_config import debug_with

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "configs" / "debug.toml")

# (section, key, bad value, what the one line must say). Each runs twice: in the TOML and as a flag.
VALUES = [
    ("optimizer", "lr", -1.0, "[optimizer] lr = -1.0: must be a number >= 0"),
    ("optimizer", "lr", float("inf"), "[optimizer] lr = inf: must be a number >= 0"),
    ("optimizer", "beta1", 1.0, "[optimizer] beta1 = 1.0: must be in [0, 1)"),
    ("optimizer", "beta2", -0.5, "[optimizer] beta2 = -0.5: must be in [0, 1)"),
    ("optimizer", "eps", 0.0, "[optimizer] eps = 0.0: must be > 0"),
    ("optimizer", "weight_decay", -0.1, "[optimizer] weight_decay = -0.1: must be >= 0"),
    ("training", "steps", 0, "[training] steps = 0: must be >= 1"),
    ("training", "steps", -5, "[training] steps = -5: must be >= 1"),
    ("lr_scheduler", "warmup_steps", -1, "[lr_scheduler] warmup_steps = -1: must be >= 0"),
    ("lr_scheduler", "decay_ratio", 1.5, "[lr_scheduler] decay_ratio = 1.5: must be in [0, 1]"),
    ("lr_scheduler", "total_steps", 0, "[lr_scheduler] total_steps = 0: must be >= 1"),
    ("lr_scheduler", "min_lr_factor", 2.0, "[lr_scheduler] min_lr_factor = 2.0: must be in [0, 1]"),
    ("training", "max_norm", 0.0, "[training] max_norm = 0.0: must be > 0"),
    ("training", "max_norm", -1.0, "[training] max_norm = -1.0: must be > 0"),
    ("training", "local_batch_size", 0, "[training] local_batch_size = 0: must be >= 1"),
    ("training", "seq_len", 1, "[training] seq_len = 1: must be >= 2"),
    ("training", "global_batch_size", 0, "[training] global_batch_size = 0: must be -1"),
    ("training", "dataset", "c4", "[training] dataset = 'c4': expected 'synthetic' or 'text'"),
    ("metrics", "log_freq", 0, "[metrics] log_freq = 0: must be >= 1"),
    ("metrics", "peak_tflops", -1.0, "[metrics] peak_tflops = -1.0: must be >= 0"),
    ("data", "tokenizer", "missing.json", "[data] tokenizer = 'missing.json': expected 'bytes' or the path"),
    ("data", "tokenizer", DEBUG, "[data] tokenizer = '" + DEBUG + "': not a tokenizers tokenizer.json"),
    ("data", "synthetic_successors", 0, "[data] synthetic_successors = 0: must be >= 1"),
    ("model", "name", "llama3", "[model] name = 'llama3': expected 'qwen3_moe'"),
    ("model", "flavor", "huge", "[model] flavor = 'huge': expected one of"),
    ("moe", "num_experts", 0, "[moe] num_experts = 0: must be >= 1"),
    ("moe", "top_k", 9, "[moe] top_k = 9: must be in 1..num_experts (8)"),
    ("moe", "top_k", 0, "[moe] top_k = 0: must be in 1..num_experts"),
    ("moe", "inter_dim", 0, "[moe] inter_dim = 0: must be >= 1"),
    ("moe", "align", 7, "[moe] align = 7: must be one of 8, 16, 32"),
    ("router", "init_std", -0.1, "[router] init_std = -0.1: must be >= 0"),
    ("router", "route_scale", 0.0, "[router] route_scale = 0.0: must be > 0"),
    ("router", "bias_update_rate", -1.0, "[router] bias_update_rate = -1.0: must be >= 0"),
    ("router", "balance_loss_coeff", -1.0, "[router] balance_loss_coeff = -1.0: must be >= 0"),
    ("router", "z_loss_coeff", -1.0, "[router] z_loss_coeff = -1.0: must be >= 0"),
    ("router", "n_groups", 3, "[router] n_groups = 3: must divide [moe] num_experts (8)"),
    ("router", "n_groups", 0, "[router] n_groups = 0: must be >= 1"),
    ("router", "topk_groups", 2, "[router] topk_groups = 2: must be in 1..n_groups (1)"),
    ("checks", "monitor_freq", -1, "[checks] monitor_freq = -1: must be >= 0"),
    ("parallelism", "expert_parallel_degree", 3, "[parallelism] expert_parallel_degree = 3: must divide [moe] num_experts"),
    ("parallelism", "expert_parallel_degree", 0, "[parallelism] expert_parallel_degree = 0: must be >= 1"),
    ("parallelism", "tensor_parallel_degree", 2, "[parallelism] tensor_parallel_degree = 2: qwen3_moe supports FSDP and EP only"),
    ("parallelism", "pipeline_parallel_degree", 2, "[parallelism] pipeline_parallel_degree = 2"),
    ("parallelism", "context_parallel_degree", 2, "[parallelism] context_parallel_degree = 2"),
    ("parallelism", "expert_tensor_parallel_degree", 2, "[parallelism] expert_tensor_parallel_degree = 2: only 1"),
    ("parallelism", "data_parallel_shard_degree", 0, "[parallelism] data_parallel_shard_degree = 0: must be -1"),
    ("dispatch", "num_sms", 7, "[dispatch] num_sms = 7: must be 0"),
    ("dispatch", "tuned_file", "typo.json", "[dispatch] tuned_file = 'typo.json': no such file"),
    ("dispatch", "tuned_file", DEBUG, "[dispatch] tuned_file = '" + DEBUG + "': cannot read it as JSON"),
    ("kernels", "backend", "triton", "[kernels] backend = 'triton' needs a CUDA GPU"),
]

# Values of the wrong type or outside a key's choices: TOML and flag each say what the key takes.
TYPES = [
    ("training", "steps", "abc", "[training] steps", "int"),
    ("optimizer", "lr", "fast", "[optimizer] lr", "float"),
    ("moe", "top_k", "two", "[moe] top_k", "int"),
    ("router", "score_func", "relu", "[router] score_func", "'softmax' | 'sigmoid'"),
    ("dispatch", "backend", "nvshmem", "[dispatch] backend", "'auto' | 'local' | 'all_to_all' | 'deepep'"),
    ("dispatch", "buffers", "huge", "[dispatch] buffers", "'exact' | 'worst_case'"),
    ("dispatch", "overlap", "both", "[dispatch] overlap", "'none' | 'chunks'"),
    ("kernels", "backend", "cuda", "[kernels] backend", "'auto' | 'torch' | 'triton'"),
    ("moe", "padding", "sometimes", "[moe] padding", "'none' | 'auto' | 'always'"),
    ("router", "balance_loss", "batch", "[router] balance_loss", "'none'"),
    ("checks", "router_init", "maybe", "[checks] router_init", "'error'"),
    ("activation_checkpoint", "mode", "some", "[activation_checkpoint] mode", "'selective'"),
    ("training", "mixed_precision_param", "float16", "[training] mixed_precision_param", "'bfloat16'"),
    ("optimizer", "moments_dtype", "float16", "[optimizer] moments_dtype", "'float32' | 'bfloat16'"),
    ("optimizer", "update", "cuda", "[optimizer] update", "'auto' | 'torch' | 'triton'"),
    ("optimizer", "expert_grad_dtype", "float16", "[optimizer] expert_grad_dtype", "'auto' | 'float32' | 'bfloat16'"),
]

# Everything else that names a key: unknown sections and keys, replaced keys, and combinations.
OTHERS = [
    (["--trainig.steps", "3"], "unknown section 'trainig'"),
    (["--training.stepz", "3"], "unknown key 'stepz' in [training]"),
    (["--router.aux_loss_coeff", "0.1"], "[router] aux_loss_coeff was replaced by"),
    (["--checkpoint.enable", "--checkpoint.interval", "0"], "[checkpoint] interval = 0: must be >= 1"),
    (["--checkpoint.enable", "--checkpoint.keep_latest_k", "1"], "[checkpoint] keep_latest_k = 1: must be 0"),
    (["--checkpoint.enable", "--checkpoint.load_step", "-2"], "[checkpoint] load_step = -2: must be -1"),
    (["--checkpoint.last_save_in_hf"], "[checkpoint] last_save_in_hf = true saves the last step as weights only"),
    (["--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", "--router.bias_update_rate", "1e-3"],
     "[checkpoint] last_save_in_hf = true with [router] bias_update_rate"),
    (["--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only", "--router.n_groups", "2"],
     "[checkpoint] last_save_in_hf = true with [router] n_groups = 2, topk_groups = 1"),
    (["--router.balance_loss_coeff", "0"], "[router] balance_loss = 'global_batch' needs balance_loss_coeff > 0"),
    (["--router.balance_loss", "none"], "[router] balance_loss_coeff = 0.1 has no loss to weigh"),
    (["--router.n_groups", "4", "--router.topk_groups", "1", "--moe.top_k", "3"], "[moe] top_k = 3: more than topk_groups"),
    (["--router.n_groups", "2", "--router.topk_groups", "2", "--router.force_balance"], "[router] force_balance"),
    (["--dispatch.backend", "local", "--parallelism.expert_parallel_degree", "2"], "[dispatch] backend = 'local' needs"),
    (["--dispatch.backend", "all_to_all"], "[dispatch] backend = 'all_to_all' needs [parallelism] expert_parallel_degree > 1"),
    (["--dispatch.backend", "deepep"], "[dispatch] backend = 'deepep' needs [parallelism] expert_parallel_degree 2, 4 or 8"),
    (["--dispatch.backend", "deepep", "--parallelism.expert_parallel_degree", "2"],
     "[dispatch] backend = 'deepep' needs [training] mixed_precision_param = 'bfloat16'"),
    (["--dispatch.backend", "deepep", "--parallelism.expert_parallel_degree", "2", "--training.mixed_precision_param",
      "bfloat16", "--nproc", "2"], "[dispatch] backend = 'deepep': the deep_ep package cannot be imported"),
    (["--dispatch.backend", "deepep", "--parallelism.expert_parallel_degree", "4", "--training.mixed_precision_param",
      "bfloat16", "--nproc", "4", "--nproc-per-node", "2"], "EP would span nodes (2 processes per node)"),
    (["--dispatch.backend", "all_gather"], "[dispatch] backend = 'all_gather' needs [parallelism] "
     "expert_parallel_degree = 2 (every token goes to every EP rank), got 1"),
    (["--dispatch.backend", "all_gather", "--parallelism.expert_parallel_degree", "2", "--dispatch.overlap", "chunks"],
     "[dispatch] backend = 'all_gather' needs [dispatch] overlap = 'none' (its exchanges finish where they start)"),
    (["--dispatch.num_sms", "32", "--dispatch.backend", "all_to_all", "--parallelism.expert_parallel_degree", "2"],
     "[dispatch] num_sms = 32 sets DeepEP's SMs"),
    (["--dispatch.overlap", "chunks"], "[dispatch] overlap = 'chunks' overlaps the exchanges between EP ranks: it needs "
     "[parallelism] expert_parallel_degree > 1 (got 1)"),
    (["--parallelism.expert_parallel_degree", "4", "--nproc", "2"], "must divide the FSDP group size (2 of 2 processes)"),
    (["--parallelism.data_parallel_replicate_degree", "3", "--nproc", "2"],
     "[parallelism] data_parallel_replicate_degree = 3: must divide the number of processes (2)"),
    (["--parallelism.data_parallel_replicate_degree", "3", "--parallelism.data_parallel_shard_degree", "2", "--nproc", "4"],
     "must equal the number of processes (4)"),
    (["--parallelism.data_parallel_replicate_degree", "0"], "[parallelism] data_parallel_replicate_degree = 0: must be >= 1"),
    (["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.expert_parallel_degree", "4", "--nproc", "4"],
     "EP splits one replica's FSDP group (2 of 4 processes; torchtitan's mesh is dp_replicate x efsdp x ep)"),
    (["--dispatch.backend", "deepep", "--parallelism.expert_parallel_degree", "4", "--training.mixed_precision_param",
      "bfloat16", "--nproc", "12", "--nproc-per-node", "6"], "EP would span nodes (6 processes per node)"),
    (["--dispatch.backend", "deepep", "--parallelism.expert_parallel_degree", "4", "--training.mixed_precision_param",
      "bfloat16", "--parallelism.data_parallel_replicate_degree", "2", "--nproc", "8", "--nproc-per-node", "2"],
     "EP would span nodes (2 processes per node); use 'all_to_all' or 'auto'"),
    (["--training.global_batch_size", "24", "--nproc", "2"], "[training] global_batch_size = 24: must be a multiple"),
    (["--training.dataset", "text", "--training.dataset_path", "/nonexistent"], "[training] dataset_path = '/nonexistent'"),
    (["--nproc", "0"], "--nproc '0': must be a number of processes >= 1"),
    (["--model.init_from", "qwen3_moe"], "[model] init_from = 'qwen3_moe' is for the torchtitan_qwen3_moe baseline"),
    (["--router.gate_precision", "bf16"], "[router] gate_precision"),
    (["--optimizer.moments_dtype", "bfloat16", "--optimizer.name", "Adam"],
     "[optimizer] moments_dtype = 'bfloat16' is for name = 'AdamW' (got 'Adam')"),
    (["--optimizer.moments_dtype", "bfloat16", "--optimizer.early_step_in_backward"],
     "[optimizer] moments_dtype = 'bfloat16' with early_step_in_backward = true"),
    (["--optimizer.moments_dtype", "bfloat16", "--optimizer.update", "torch"],
     "[optimizer] update = 'torch' with moments_dtype = 'bfloat16': torch's AdamW keeps fp32 moments"),
    (["--optimizer.update", "triton", "--optimizer.name", "Adam"], "[optimizer] update = 'triton' is for name = 'AdamW'"),
    (["--optimizer.update", "triton", "--optimizer.early_step_in_backward"],
     "[optimizer] update = 'triton' with early_step_in_backward = true"),
    (["--optimizer.expert_grad_dtype", "bfloat16"],
     "[optimizer] expert_grad_dtype = 'bfloat16' keeps the experts' gradients on their bf16 working copies: needs "
     "[training] mixed_precision_param = 'bfloat16'"),
    (["--optimizer.expert_grad_dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16", "--optimizer.update",
      "torch"], "[optimizer] expert_grad_dtype = 'bfloat16' is read by our AdamW"),
    (["--optimizer.expert_grad_dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16",
      "--training.global_batch_size", "32", "--nproc", "2"],
     "[optimizer] expert_grad_dtype = 'bfloat16' keeps one backward's gradients: global_batch_size = 32 accumulates 2"),
    (["--parallelism.embedding", "rows", "--parallelism.data_parallel_replicate_degree", "2"],
     "[parallelism] embedding = 'rows' shards the embedding over the FSDP ranks of one replica"),
    (["--parallelism.router", "rows", "--parallelism.data_parallel_replicate_degree", "2"],
     "[parallelism] router = 'rows' shards each router's gate over the FSDP ranks of one replica"),
    (["--job.custom_config_module", "my.module"], "[job] custom_config_module = 'my.module'"),
]

# python -m torchtitan_moe.tools.plan's flags (after the config file).
PLAN = [
    ([], "--nodes is missing: a number of nodes >= 1"),
    (["--nodes", "0", "--gpus-per-node", "8"], "--nodes '0': must be a number of nodes >= 1"),
    (["--nodes", "2"], "--gpus-per-node is missing: a number of GPUs per node >= 1"),
    (["--nodes", "2", "--gpus-per-node", "eight"], "--gpus-per-node 'eight': must be a number of GPUs per node >= 1"),
    (["--nodes", "1", "--gpus-per-node", "8", "--gpu", "a100"], "--gpu 'a100': expected one of h200, h100, b200"),
    (["--nodes", "1", "--gpus-per-node", "8", "--global-batch", "-4096"], "--global-batch '-4096': must be a number of tokens >= 1"),
    (["--nodes", "1", "--gpus-per-node", "2", "--global-batch", "1000"],
     "--global-batch 1000: must be a multiple of GPUs x seq_len x local_batch_size (2 x 128 x 8 = 2048 tokens)"),
    (["--nodes", "1", "--gpus-per-node", "2", "--training.seq_len", "1"], "[training] seq_len = 1: must be >= 2"),
]


def run_check(argv: list[str], tool=check_config) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tool.main(argv)
    return code, out.getvalue(), err.getvalue()


def assert_one_line(argv: list[str], expected: str, tool=check_config) -> None:
    code, out, err = run_check(argv, tool)
    assert code == 2, (argv, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: "), (argv, err)
    assert expected in lines[0], (argv, lines[0])
    assert "Traceback" not in err + out


@pytest.mark.parametrize("section, key, value, expected", VALUES, ids=[f"{s}.{k}={v}" for s, k, v, _ in VALUES])
def test_a_bad_value_is_one_line_in_toml_and_as_a_flag(tmp_path, section, key, value, expected, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a machine without a GPU, as users have
    assert_one_line([debug_with(tmp_path, **{f"{section}__{key}": value})], expected)
    assert_one_line([DEBUG, f"--{section}.{key}", str(value)], expected)


@pytest.mark.parametrize("section, key, value, name, allowed", TYPES, ids=[f"{s}.{k}={v}" for s, k, v, _, _ in TYPES])
def test_a_value_of_the_wrong_type_is_one_line_in_toml_and_as_a_flag(tmp_path, section, key, value, name, allowed):
    assert_one_line([debug_with(tmp_path, **{f"{section}__{key}": value})], f"{name} = {value!r}: expected")
    assert_one_line([DEBUG, f"--{section}.{key}", value], f"--{section}.{key} {value}: {name} must be")
    for argv in ([debug_with(tmp_path, **{f"{section}__{key}": value})], [DEBUG, f"--{section}.{key}", value]):
        assert allowed in run_check(argv)[2]


@pytest.mark.parametrize("overrides, expected", OTHERS, ids=[" ".join(o)[:60] for o, _ in OTHERS])
def test_other_refusals_are_one_line(overrides, expected, monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # this machine has no DeepEP, whatever is installed
    assert_one_line([DEBUG, *overrides], expected)


@pytest.mark.parametrize("flags, expected", PLAN, ids=[" ".join(f)[:60] for f, _ in PLAN])
def test_a_bad_planner_flag_is_one_line(flags, expected):
    assert_one_line([DEBUG, *flags], expected, tool=plan)


def test_the_table_has_at_least_80_bad_inputs():
    assert 2 * len(VALUES) + 2 * len(TYPES) + len(OTHERS) >= 80


def test_the_launcher_prints_a_refusal_in_one_line_and_launches_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHON=sys.executable, NPROC="2")
    result = subprocess.run(["bash", "scripts/train.sh", DEBUG, "--optimizer.lr", "-1", "--job.dump_folder",
                             str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert (result.stdout + result.stderr).strip().splitlines() == ["config error: [optimizer] lr = -1.0: must be a number >= 0"]
    assert not any(tmp_path.iterdir())  # no worker started


@pytest.mark.parametrize("args, expected", [
    (["bogus"], "gpu tier: part 'bogus': expected all, kernels, e2e or test paths under tests/"),
    (["tests/test_overlap.py", "tests/nope.py::test_x"],
     "gpu tier: test path 'tests/nope.py::test_x': no such file or directory"),
])
def test_the_gpu_tier_refuses_a_bad_selection_in_one_line(tmp_path, args, expected):
    # before it looks for a GPU: the same line on a CPU machine
    result = subprocess.run(["bash", "scripts/gpu_tests.sh", str(tmp_path), *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 2
    assert (result.stdout + result.stderr).strip().splitlines() == [expected]
