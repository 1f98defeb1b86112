"""A study: would AdamW's update of the experts pay for itself if it ran beside the next step's forward?

One rank of Qwen3-30B-A3B at 8 layers at EP = 2 holds 2.42B expert parameters; their update (ops.adamw_foreach_,
fp32 moments, bf16 working copies) reads and writes ~28 bytes each: ~16 ms on an H200, at its copy bandwidth,
between the backward and the next forward, with the tensor cores idle. Layer l's forward needs only layer l's
update, so the updates could run on a side stream, layer by layer, each waited for by its layer's forward.
Whether that pays depends on what the GPU can do at once: a persistent GEMM holds every SM, and a
power-capped GPU (sessions 10-11: 94-99% of samples at the cap) may just clock lower. This times, on one GPU:

    forward   per layer, the experts' GEMMs at local batch 4 (131,072 rows, [2048 -> 1536] and [768 -> 2048])
              and a dense [16384, 2048] x [2048, 8192] standing in for attention: ~70% of a layer's forward
    update    ops.adamw_foreach_ of one layer's experts (64 x [1536, 2048] + 64 x [2048, 768])
    serial    8 updates, then 8 layers' forward: the step as it runs
    overlap   updates on a side stream, layer l's forward waiting on update l's event

    python scripts/study_optimizer_overlap.py            # one GPU, ~45 GB
    python scripts/study_optimizer_overlap.py --smoke    # small shapes on the CPU (Triton's interpreter)
"""
import os
import statistics
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch

from torchtitan_moe.ops.adamw import adamw_foreach_

L, E, D, I, ROWS, TOK, Q = (2, 4, 64, 32, 256, 64, 128) if SMOKE else (8, 64, 2048, 768, 131072, 16384, 8192)
DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.bfloat16
torch.manual_seed(0)


def layer_state():
    shapes = [(E, 2 * I, D), (E, D, I)]
    params = [torch.randn(s, device=DEVICE) * 0.02 for s in shapes]
    return dict(params=params, grads=[torch.randn_like(p, dtype=DTYPE) * 1e-3 for p in params],
                m=[torch.zeros_like(p) for p in params], v=[torch.zeros_like(p) for p in params],
                working=[p.to(DTYPE) for p in params])


layers = [layer_state() for _ in range(L)]
x = torch.randn(ROWS, D, device=DEVICE, dtype=DTYPE)
a = torch.randn(ROWS, I, device=DEVICE, dtype=DTYPE)
h = torch.randn(TOK, D, device=DEVICE, dtype=DTYPE)
w_dense = torch.randn(D, Q, device=DEVICE, dtype=DTYPE) * 0.02
scale = torch.ones((), device=DEVICE)


def update(s, step=1):
    adamw_foreach_(s["params"], s["grads"], s["m"], s["v"], lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8,
                   weight_decay=0.1, step=step, seeds=[0, 1], grad_scale=scale, workings=s["working"])


def forward(s):
    w13, w2 = s["working"]
    # One expert's rows stand in for all: the same FLOPs as the grouped GEMM at even loads.
    x @ w13[0].t()
    a @ w2[0].t()
    h @ w_dense


def serial():
    for s in layers:
        update(s)
    for s in layers:
        forward(s)


side = torch.cuda.Stream() if DEVICE == "cuda" else None


def overlap():
    main = torch.cuda.current_stream()
    side.wait_stream(main)  # the gradients are ready
    done = []
    with torch.cuda.stream(side):
        for s in layers:
            update(s)
            done.append(torch.cuda.Event())
            done[-1].record(side)
    for s, event in zip(layers, done):
        main.wait_event(event)
        forward(s)
    main.wait_stream(side)


def time_ms(fn, reps=15):
    if SMOKE:
        fn()
        return float("nan")
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


rows = [(f"update x {L}", lambda: [update(s) for s in layers]), (f"forward x {L}", lambda: [forward(s) for s in layers]),
        ("serial", serial)]
if side is not None:
    rows.append(("overlap", overlap))
results = {name: time_ms(fn) for name, fn in rows}
if side is not None:  # and serial again, in case the clocks moved
    results["serial (again)"] = time_ms(serial)
print(f"device: {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu (smoke)'}; {L} layers, "
      f"{sum(p.numel() for s in layers for p in s['params']) / 1e9:.2f}B expert parameters")
print("| schedule | median ms |\n|---|---|")
for name, ms in results.items():
    print(f"| {name} | {ms:.2f} |")
if "overlap" in results:
    saved = results["serial"] - results["overlap"]
    print(f"overlap saves {saved:.2f} ms of the update's {results[rows[0][0]]:.2f} ms")
