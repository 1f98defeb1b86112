"""Every policy that picks by the device, on each device it tells apart: the padding of empty expert
groups by CUDA compute capability (moe/padding.py), the layer's kernels and alignment, our AdamW or
torch's ([optimizer] update), the MFU peak, the tuned-table key and the Triton refusal. CUDA is faked
(torch.cuda's answers patched): each expectation is written out per GPU generation, not derived from
the code under test."""

from types import SimpleNamespace

import pytest
import torch

from torchtitan_moe.components import metrics
from torchtitan_moe.components.optimizer import uses_our_update
from torchtitan_moe.moe.layer import MoE, MoEArgs, resolve_kernels
from torchtitan_moe.moe.padding import needs_padding, resolve_alignment
from torchtitan_moe.parallel import build

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")

# (name, compute capability, grouped_mm gives empty groups wrong weight gradients: pytorch#172439)
GENERATIONS = [
    ("V100", (7, 0), False),
    ("A100", (8, 0), False),
    ("L40S", (8, 9), False),
    ("H100", (9, 0), False),
    ("B200", (10, 0), True),
    ("B300", (10, 3), True),
    ("RTX PRO 6000 Blackwell", (12, 0), True),
]


@pytest.fixture
def gpu(monkeypatch):
    """Make torch.cuda answer as a GPU of the given compute capability and name would."""

    def fake(capability, name="NVIDIA GPU", sms=132):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device=None: SimpleNamespace(multi_processor_count=sms))

    return fake


@pytest.mark.parametrize("name, capability, pads", GENERATIONS, ids=[g[0] for g in GENERATIONS])
@pytest.mark.parametrize("align", [8, 16, 32])
def test_padding_on_each_gpu_generation(gpu, name, capability, pads, align):
    gpu(capability)
    assert needs_padding(CUDA) is pads
    assert resolve_alignment("auto", align, CUDA) == (align if pads else 1)
    assert resolve_alignment("always", align, CUDA) == align
    assert resolve_alignment("none", align, CUDA) == 1  # 'none' is none, even where it would be wrong


@pytest.mark.parametrize("align", [8, 16, 32])
def test_padding_on_the_cpu(align):
    assert needs_padding(CPU) is False
    assert resolve_alignment("auto", align, CPU) == 1
    assert resolve_alignment("always", align, CPU) == align
    assert resolve_alignment("none", align, CPU) == 1


@pytest.mark.parametrize("name, capability, pads", GENERATIONS, ids=[g[0] for g in GENERATIONS])
def test_a_layers_dispatch_settings_on_each_gpu_generation(gpu, name, capability, pads):
    gpu(capability)
    for kernels, expected in (("auto", "triton"), ("torch", "torch"), ("triton", "triton")):
        layer = MoE(MoEArgs(num_experts=4, top_k=2, inter_dim=8, padding="auto", align=16, kernels=kernels), dim=8)
        assert layer.dispatch_settings(CUDA) == (expected, 16 if pads else 1)
    assert MoE(MoEArgs(num_experts=4, top_k=2, inter_dim=8, padding="always", align=32), dim=8).dispatch_settings(
        CPU) == ("torch", 32)


def test_kernels_auto_is_triton_on_cuda_and_torch_elsewhere():
    assert resolve_kernels("auto", CUDA) == "triton"
    assert resolve_kernels("auto", CPU) == "torch"
    assert resolve_kernels("auto", torch.device("meta")) == "torch"
    assert resolve_kernels("triton", CPU) == "triton"  # asked for: the ops refuse it there, loudly
    with pytest.raises(ValueError, match="kernels = 'cuda': expected 'auto', 'torch' or 'triton'"):
        resolve_kernels("cuda", CPU)


def optimizer(update="auto", moments="float32", name="AdamW", early=False):
    return SimpleNamespace(update=update, moments_dtype=moments, name=name, early_step_in_backward=early)


# (optimizer settings, ours on a GPU, ours on the CPU)
UPDATES = [
    (optimizer(), True, False),  # auto, fp32 moments: ours on a GPU (it writes the working copies), torch's on CPU
    (optimizer(moments="bfloat16"), True, True),  # bf16 moments: only ours stores them
    (optimizer(update="torch"), False, False),
    (optimizer(update="triton"), True, True),
    (optimizer(name="Adam"), False, False),  # not AdamW: torchtitan's
    (optimizer(early=True), False, False),  # steps in the backward: torchtitan's container
]


@pytest.mark.parametrize("config, on_gpu, on_cpu", UPDATES)
def test_update_auto_on_a_gpu_and_on_the_cpu(gpu, monkeypatch, config, on_gpu, on_cpu):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert uses_our_update(config) is on_cpu
    gpu((9, 0))
    assert uses_our_update(config) is on_gpu


def test_the_mfu_peak_on_a_gpu_and_on_the_cpu(gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert metrics.peak_flops(0.0, 989e12, "cpu") is None  # no MFU on a CPU
    assert metrics.peak_flops(500.0, 989e12, "cpu") == 500e12  # unless a peak is given
    gpu((9, 0), "NVIDIA H200")
    assert metrics.peak_flops(0.0, 989e12, "NVIDIA H200") == 989e12  # torchtitan's table entry
    assert metrics.peak_flops(700.0, 989e12, "NVIDIA H200") == 700e12  # [metrics] peak_tflops wins


def test_the_tuned_table_key_names_the_gpu(gpu):
    job = SimpleNamespace(training=SimpleNamespace(local_batch_size=2, seq_len=4096))
    layer = MoE(MoEArgs(num_experts=8, top_k=2, inter_dim=8), dim=16)
    assert build.run_shape(layer, job, 2, CPU).gpu == "cpu" and build.device_sms(CPU) is None
    gpu((9, 0), "NVIDIA H200", sms=132)
    shape = build.run_shape(layer, job, 2, CUDA)
    assert (shape.gpu, shape.ep, shape.hidden, shape.top_k, shape.experts, shape.tokens_per_rank) == (
        "NVIDIA H200", 2, 16, 2, 8, 8192)
    assert build.device_sms(CUDA) == 132


def test_triton_kernels_are_refused_on_a_cpu_without_the_interpreter(monkeypatch):
    from torchtitan_moe.config.sections import ConfigError
    from torchtitan_moe.train.job_config import load_job_config
    from torchtitan_moe.train.machine import check_machine

    config = load_job_config(["--job.config_file", "configs/debug.toml", "--kernels.backend", "triton"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=r"\[kernels\] backend = 'triton' needs a CUDA GPU"):
        check_machine(config)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # how CI runs the kernels: allowed
    check_machine(config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    check_machine(config)
