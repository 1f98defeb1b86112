#!/usr/bin/env bash
# The GPU tier: bash scripts/gpu_tests.sh [OUT] [all | kernels | e2e | TEST_PATH ...]
#
# `kernels` (tests/ops, test_moe_layer, test_output_loss) and `e2e` (the files with `gpu` tests)
# split it in two for machines lent a few minutes at a time: on 2 H200s the kernel half takes about 6
# minutes and the e2e half over 10 (its one-GPU tests ~4.5 minutes, its two-GPU tests past 5): two calls.
# Test paths instead of a part run just those (pytest's node ids too), e.g. the e2e half's files a few
# at a time.
#
# Runs, on the GPU, the op and layer tests and every file with tests marked `gpu` (what the CPU
# tier cannot do):
#   tests/ops            kernels compiled (not interpreted), at Qwen3-30B-A3B sizes, against float64
#   test_moe_layer       the layer with Triton kernels against the torch reference
#   test_output_loss     the model's output layer computes torchtitan's loss with the Triton kernel
#   test_overlap         2 GPUs: [dispatch] overlap = "chunks" against one chunk, NCCL all-to-all and DeepEP
#   test_sharded_init    2 GPUs (NCCL): init equals 1 GPU's, gradients of FSDP and EP = 2 equal 1 GPU's
#   test_gpu_e2e         the debug model trains on 1 GPU with Triton kernels; a zero gate stops the run;
#                        two runs are bitwise identical; EP = 2 (all-to-all + Triton) matches EP = 1
#                        from one seed checkpoint, and activation checkpointing under EP = 2 changes nothing;
#                        EP = 2 in bf16 with the experts' working copies trains as the experts under FSDP2;
#                        a train step never makes the host wait for the GPU (CUDA's sync debug mode)
#   test_offload         [activation_checkpoint] offload_inputs and offload_attention: the copies to host and back,
#                        the memory freed, what the recompute takes the bits its forward made
#   test_causal_attention  ops.causal_attention (cuDNN) against F.scaled_dot_product_attention and float64
#   test_allocator       [training] expandable_segments reaches CUDA's caching allocator
# On a 1-GPU machine the 2-GPU tests are skipped, each with its reason in the log and the summary.
# Uses the image's torch, triton and torchtitan (no install, no network): PYTHON picks the interpreter.
# OUT (default outputs/gpu_tests) gets the log and junit XML. The last line is the summary;
# the exit status is pytest's (0: all passed).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-outputs/gpu_tests}}
part=${2:-all}
py=${PYTHON:-python3}
kernels="tests/ops tests/test_moe_layer.py tests/test_output_loss.py"
e2e=$(grep -l "pytest.mark.gpu" tests/*.py)
case "$part" in
    all) selected="$kernels $e2e" ;;
    kernels) selected=$kernels ;;
    e2e) selected=$e2e ;;
    tests/*)
        selected="${*:2}"
        for path in $selected; do
            [ -e "${path%%::*}" ] || { echo "gpu tier: test path '$path': no such file or directory"; exit 2; }
        done
        part="${selected// /, }" ;;
    *) echo "gpu tier: part '$part': expected all, kernels, e2e or test paths under tests/"; exit 2 ;;
esac
# NVLink SHARP / multicast stay off on the lent machines.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out"

if ! gpus=$("$py" -c "import torch, triton, torchtitan, pytest; n = torch.cuda.device_count(); assert n, 'no CUDA GPU visible'; print(n, 'x', torch.cuda.get_device_name(0), '| torch', torch.__version__, '| triton', triton.__version__)" 2>&1); then
    echo "gpu tier: not run: $(echo "$gpus" | tail -n 1)"
    exit 2
fi
echo "gpu tier: $gpus"

start=$SECONDS
# -v names each test as it starts, and FAILURES_LOG keeps each failure as it happens: a run stopped
# by a time limit still shows where it was and what had failed.
rm -f "$out/failures.log"
FAILURES_LOG="$out/failures.log" "$py" -m pytest -v -rs --durations 15 -p no:cacheprovider \
    --junitxml "$out/gpu_tests.xml" $selected > "$out/gpu_tests.log" 2>&1
code=$?
# Failures (with their assertion text) and skip reasons, then the one summary line.
[ -s "$out/failures.log" ] && grep -E "^FAILED|^E  " "$out/failures.log" | head -n 60
grep -E "^SKIPPED" "$out/gpu_tests.log" | head -n 30
result=$(tail -n 1 "$out/gpu_tests.log" | tr -d '=' | sed 's/^ *//; s/ *$//')
skips=$(grep -E "^SKIPPED" "$out/gpu_tests.log" | sed -E 's/^SKIPPED \[[0-9]+\] [^:]+(:[0-9]+)?: //' | sort -u | paste -sd '|' - | sed 's/|/; /g')
verdict=$([ "$code" -eq 0 ] && echo PASS || echo FAIL)
echo "gpu tier ($part): $verdict on ${gpus%% |*}: $result${skips:+ (skipped: $skips)}; $((SECONDS - start)) s; log $out/gpu_tests.log"
exit "$code"
