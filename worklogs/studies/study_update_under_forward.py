"""A study (worklogs/2026-11-27-session9-h200x2.md): can the optimizer's update run under the next step's forward? One GPU, 8 layers of Qwen3-30B-A3B at
EP = 2, local batch 4: per layer a forward proxy (attention forward, q projection, the experts' two grouped GEMMs
on 131,072 rows) and our AdamW over that layer's expert weights (fp32 moments, bf16 grads and working copies).
Serial (update, then forward) against the update on a side stream, layer L's forward waiting for layer L's update.

    python worklogs/studies/study_update_under_forward.py      # 39 GB of GPU memory"""
import statistics

import torch
import torch.nn.functional as F

from torchtitan_moe.ops import adamw_triton

L, E, D, I, ROWS = 8, 64, 2048, 768, 131072
dev = "cuda"
torch.manual_seed(0)
x = torch.randn(ROWS, D, device=dev).to(torch.bfloat16)
h = torch.randn(ROWS, I, device=dev).to(torch.bfloat16)
offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (ROWS // E)
q = torch.randn(4, 32, 4096, 128, device=dev, dtype=torch.bfloat16)
kv = torch.randn(4, 32, 4096, 128, device=dev, dtype=torch.bfloat16)
tok = torch.randn(16384, D, device=dev).to(torch.bfloat16)
wq = torch.randn(D, 4096, device=dev).to(torch.bfloat16)
layers = []
for _ in range(L):
    ws = []
    for shape in ((E, 2 * I, D), (E, D, I)):
        n = E * shape[1] * shape[2]
        ws.append(dict(p=torch.randn(n, device=dev) * 0.02, g=(torch.randn(n, device=dev) * 1e-3).to(torch.bfloat16),
                       m=torch.zeros(n, device=dev), v=torch.zeros(n, device=dev),
                       w=torch.empty(n, device=dev, dtype=torch.bfloat16), shape=shape))
    layers.append(ws)


def update(layer):
    for t in layer:
        adamw_triton.adamw_foreach_triton([t["p"]], [t["g"]], [t["m"]], [t["v"]], 3e-4, 0.9, 0.95, 1e-8, 0.1, 1000.0,
                                          [0], None, [t["w"]])


def forward(layer):
    w13 = layer[0]["w"].view(E, 2 * I, D).transpose(1, 2)
    w2 = layer[1]["w"].view(E, D, I).transpose(1, 2)
    F.scaled_dot_product_attention(q, kv, kv, is_causal=True)
    tok @ wq
    torch._grouped_mm(x, w13, offs=offs)
    torch._grouped_mm(h, w2, offs=offs)


def timed(fn, reps=7):
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[1:])


def serial():
    for layer in layers:
        update(layer)
    for layer in layers:
        forward(layer)


def fwd_only():
    for layer in layers:
        forward(layer)


def upd_only():
    for layer in layers:
        update(layer)


def overlapped(priority):
    side = torch.cuda.Stream(priority=priority)

    def run():
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        events = []
        with torch.cuda.stream(side):
            for layer in layers:
                update(layer)
                events.append(torch.cuda.Event())
                events[-1].record(side)
        for layer, ev in zip(layers, events):
            main.wait_event(ev)
            forward(layer)
        main.wait_stream(side)
    return run


rows = [("forward alone", timed(fwd_only)), ("update alone", timed(upd_only)), ("serial", timed(serial)),
        ("overlapped, side stream low priority", timed(overlapped(0))),
        ("overlapped, side stream high priority", timed(overlapped(-1)))]
base = rows[2][1]
print(f"{torch.cuda.get_device_name()} | 8 layers: forward proxy + AdamW of the experts' weights (2.4 B params)")
print("| schedule | ms | x serial |\n|---|---|---|")
for name, t in rows:
    print(f"| {name} | {t:.2f} | {base / t:.3f} |")
