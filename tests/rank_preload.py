"""What every rank process of the tests would otherwise do again, done once by the fork server the ranks
are forked from (spawn_ranks.PRELOAD, on CPU machines): the imports (~6 s of CPU a fresh interpreter) and
inductor's check of the CPU's vector instructions (a C++ build and a process per instruction set, ~5 s;
cached in the process, so every fork inherits the answer)."""

import torch
import torch._dynamo
import torch.distributed
from torch._inductor import cpu_vec_isa

import torchtitan_moe.train.trainer  # noqa: F401  (torchtitan and the package)

cpu_vec_isa.valid_vec_isa_list()
