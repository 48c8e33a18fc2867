"""The anchor for the attention benchmark: PyTorch's fused scaled_dot_product_attention for
the same decode shapes, on dense contiguous K/V (no block table), timed the same way (CUDA
events, median of 50 after 5 warm-ups) and printed in the same columns, so one run of
`kernels/gpu-check.sh run` shows our paged kernel beside it. Needs torch with CUDA (the GPU
machines' image has it); exits with a SKIPPED line otherwise.
"""

import os
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("torch anchor: SKIPPED: no torch")
    sys.exit(0)

if not torch.cuda.is_available():
    print("torch anchor: SKIPPED: torch sees no GPU")
    sys.exit(0)

PEAK = float(os.environ.get("PEAK_GBPS", "4800"))
SHAPES = [  # (dtype, batch, ctx, heads, kv_heads, head): the rows of benches/attention.rs
    (torch.bfloat16, 64, 2048, 32, 8, 128),
    (torch.float16, 64, 2048, 32, 8, 128),
    (torch.bfloat16, 64, 8192, 32, 8, 128),
    (torch.bfloat16, 256, 1024, 32, 8, 128),
    (torch.bfloat16, 64, 2048, 9, 3, 64),
    (torch.float32, 64, 2048, 32, 8, 128),
]
NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}

print(f"{'dtype':<8} {'shape (decode, torch sdpa, dense K/V)':<44} {'median us':>10} {'GB/s':>10} {'% peak':>8}")
for dtype, batch, ctx, heads, kv_heads, head in SHAPES:
    q = torch.randn(batch, heads, 1, head, device="cuda", dtype=dtype)
    k = torch.randn(batch, kv_heads, ctx, head, device="cuda", dtype=dtype)
    v = torch.randn(batch, kv_heads, ctx, head, device="cuda", dtype=dtype)

    def call():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    for _ in range(5):
        call()
    times = []
    for _ in range(50):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    us = times[len(times) // 2]
    size = 2 * batch * ctx * kv_heads * head * k.element_size()
    gbps = size / (us * 1e-6) / 1e9
    shape = f"batch {batch}, ctx {ctx}, heads {heads}/{kv_heads}, head {head}"
    print(f"{NAMES[dtype]:<8} {shape:<44} {us:>10.1f} {gbps:>10.0f} {100 * gbps / PEAK:>7.1f}%")
