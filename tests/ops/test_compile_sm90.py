"""Every Triton kernel compiles for the H100 (sm_90), checked on any machine, GPU or not.

The interpreter runs the kernels' Python, not the compiler: a kernel can pass every CPU
test and still fail to compile. Run as a script, this file compiles each kernel ahead of
time (triton.compile with the bundled ptxas, no GPU needed) with pointers specialized to
16-byte alignment as a real launch does, and checks that the bandwidth-bound kernels
move data with 128-bit accesses. The test runs it in a fresh process: this one
interprets the kernels (TRITON_INTERPRET=1 is read at import).
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr


def main() -> None:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    from torchtitan_moe.ops import combine_triton, permute_triton, swiglu_prob_triton

    def compile_sm90(kernel, types: dict, constexprs: dict, vectorized: bool):
        while not isinstance(kernel, triton.runtime.JITFunction):  # unwrap the autotuner
            kernel = kernel.fn
        signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
        aligned = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in types.items() if t[0] == "*"}
        source = triton.compiler.ASTSource(kernel, signature, constexprs, aligned)
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        wide = bool(re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx) and re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx))
        assert wide or not vectorized, f"{kernel.__name__} {constexprs}: no 128-bit loads and stores"
        print(f"{kernel.__name__}: ok")

    p = permute_triton
    compile_sm90(
        p._rank_in_block_kernel,
        dict(experts_ptr="*i64", rank_ptr="*i64", block_counts_ptr="*i32", num_slots="i32", num_experts="i32"),
        dict(BLOCK_S=1024, CHUNK=32, E_PAD=256), False,
    )
    compile_sm90(
        p._scan_blocks_kernel,
        dict(block_counts_ptr="*i32", tokens_per_expert_ptr="*i64", num_blocks="i32", num_experts="i32"),
        dict(BLOCKS_PAD=1024), False,
    )
    compile_sm90(
        p._layout_kernel,
        dict(tokens_per_expert_ptr="*i64", offsets_ptr="*i32", starts_ptr="*i32", num_rows_ptr="*i64", num_experts="i32"),
        dict(ALIGN=16, E_PAD=128), False,
    )
    compile_sm90(
        p._place_kernel,
        dict(experts_ptr="*i64", inv_ptr="*i64", block_counts_ptr="*i32", starts_ptr="*i32", row_slot_ptr="*i64",
             num_slots="i32", num_experts="i32", num_rows_alloc="i32"),
        dict(BLOCK_S=1024), False,
    )

    c = combine_triton
    tile = dict(D=2048, K=8, BLOCK_R=4, BLOCK_D=512, COMPUTE=tl.float32)
    gather = dict(src_ptr="*bf16", inv_ptr="*i64", out_ptr="*bf16", T="i32")
    tile_gather = dict(tile, KP=8)
    compile_sm90(c._gather_kernel, gather, dict(tile_gather, HAS_WEIGHTS=False, HAS_DOTS=False,
                                                weights_ptr=None, dot_src_ptr=None, dots_ptr=None), True)
    compile_sm90(c._gather_kernel, dict(gather, weights_ptr="*fp32", dot_src_ptr="*bf16", dots_ptr="*fp32"),
                 dict(tile_gather, HAS_WEIGHTS=True, HAS_DOTS=True), True)
    # Loads one index per row, stores zeros only into pad rows: not bandwidth-bound.
    compile_sm90(c._zero_pad_rows_kernel, dict(row_slot_ptr="*i64", num_rows_ptr="*i64", out_ptr="*bf16", N="i32"),
                 dict(D=2048, BLOCK_R=16, BLOCK_D=1024), False)
    combine = dict(src_ptr="*bf16", inv_ptr="*i64", out_ptr="*bf16", T="i32")
    compile_sm90(c._combine_kernel, combine, dict(tile, HAS_WEIGHTS=False, weights_ptr=None), True)
    compile_sm90(c._combine_kernel, dict(combine, weights_ptr="*fp32"), dict(tile, HAS_WEIGHTS=True), True)

    s = swiglu_prob_triton
    rows = dict(I=768, BLOCK_R=4, BLOCK_I=256, COMPUTE=tl.float32)
    compile_sm90(s._swiglu_prob_fwd_kernel, dict(ab_ptr="*bf16", probs_ptr="*fp32", h_ptr="*bf16", N="i32"),
                 dict(rows, num_rows_ptr=None), True)
    bwd = dict(dh_ptr="*bf16", ab_ptr="*bf16", probs_ptr="*fp32", dab_ptr="*bf16", dprobs_ptr="*fp32", N="i32")
    compile_sm90(s._swiglu_prob_bwd_kernel, dict(bwd, num_rows_ptr="*i64"), rows, True)
    # float64, as gradcheck runs the kernels on a GPU
    bwd64 = {k: "*fp64" if k != "N" else "i32" for k in bwd}
    compile_sm90(s._swiglu_prob_bwd_kernel, dict(bwd64, num_rows_ptr="*i64"), dict(rows, I=3, COMPUTE=tl.float64), False)


if __name__ == "__main__":
    main()
