"""Host time of one decode-sized call through qdispatch.torch, against torch's own
nn.Linear and nn.Embedding in the same run:

    python benchmarks/torch_host_time.py            # CUDA GPU and the cuda backend: bf16
    python benchmarks/torch_host_time.py --cpu      # the cpu backend: float32, int8 per channel

M = 1 rows keep every kernel short, so each figure (wall time per call over
back-to-back calls, best of three runs of 2,000) is the host's cost of a call:
what a Python decode loop pays per layer when the GPU waits on it.  On the CPU the
kernel runs in the call: at 256^2 it is 2-3 us of the figure, at 4096^2 most of it,
so there the layers rotate over copies past the last-level cache (a 4096^2 int8
weight, 16.8 MB, would otherwise stay in it while float32's 67 MB would not).  At
256^2 one layer serves every call: its time is the host's, as in a decode loop.
A lookup of one id with checked ids copies the id to the host, which waits for
the GPU."""
import itertools
import sys
import time

import torch

import qdispatch as qd
from qdispatch import bench
from qdispatch.torch import QEmbedding, QLinear, from_torch, q_matmul, quantize_linears, to_torch

torch.manual_seed(0)
ON_CPU = "--cpu" in sys.argv[1:]
DEVICE, DTYPE, DTYPE_NAME = ("cpu", torch.float32, "float32") if ON_CPU else ("cuda", torch.bfloat16, "bfloat16")
SCHEME = (qd.QuantScheme("q8s", axis=0) if ON_CPU
          else qd.QuantScheme("q4s", block=128, store="packed_u32", scale_dtype="bf16"))


def synchronize():
    if not ON_CPU:
        torch.cuda.synchronize()


def per_call(fn, n=2000):
    for _ in range(200):
        fn()
    synchronize()
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def copies_of(K, layer_bytes):
    """Layers to rotate over: past the CPU's last-level cache where the kernel is the
    figure (K = 4096 on the CPU), else one (host time; on a GPU the kernels hide behind it)."""
    return bench.weight_copies(layer_bytes) if ON_CPU and K >= 4096 else 1


def rotating(call, args):
    """A call that takes the next of `args` (layers, weights) each time."""
    turn = itertools.cycle(args)
    return lambda: call(next(turn))


for K, N in ((256, 256), (4096, 4096)):
    float_copies, int8_copies = copies_of(K, K * N * torch.finfo(DTYPE).bits // 8), copies_of(K, K * N)
    made = [torch.nn.Linear(K, N, bias=False, dtype=DTYPE, device=DEVICE)
            for _ in range(max(float_copies, int8_copies))]
    lins, qls = made[:float_copies], [QLinear.from_linear(lin, SCHEME) for lin in made[:int8_copies]]
    x = torch.randn(1, K, dtype=DTYPE, device=DEVICE)
    wTs = [ql.weight.T for ql in qls]
    xq = from_torch(x)
    print(f"K={K} N={N}: {len(lins)} nn.Linear and {len(qls)} QLinear copies in turn")
    with torch.inference_mode():
        r = {
            f"torch nn.Linear {DTYPE_NAME}": per_call(rotating(lambda lin: lin(x), lins)),
            "QLinear (inference_mode)": per_call(rotating(lambda ql: ql(x), qls)),
            "qdispatch.torch.q_matmul": per_call(rotating(lambda wT: q_matmul(x, wT), wTs)),
            "from_torch(x)": per_call(lambda: from_torch(x)),
            "to_torch(qd tensor)": per_call(lambda: to_torch(xq)),
            "qd.q_matmul (qd tensors)": per_call(rotating(lambda wT: qd.q_matmul(xq, wT, out_dtype=DTYPE_NAME),
                                                          wTs)),
        }
    with torch.no_grad():
        r["QLinear (no_grad)"] = per_call(rotating(lambda ql: ql(x), qls))
    r["QLinear (grad mode)"] = per_call(rotating(lambda ql: ql(x), qls))
    print(f"M=1 K={K} N={N}: " + "; ".join(f"{k} {v:.1f} us" for k, v in r.items()))

if ON_CPU:  # a small model, eager and under torch.compile (QLinears in its graph); the lookups'
    # host time is a GPU question (the ids' copy)
    def blocks():
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
                                                         torch.nn.LayerNorm(256)) for _ in range(8)])
    quantized, floats = quantize_linears(blocks(), SCHEME), blocks()
    x = torch.randn(1, 256)
    with torch.inference_mode():
        r = {}
        for name, model in (("QLinear", quantized), ("float32 nn.Linear", floats)):
            compiled = torch.compile(model)
            r[f"{name} eager"] = per_call(lambda: model(x))
            r[f"{name} torch.compile"] = per_call(lambda: compiled(x))
    print("M=1, 8 blocks of (Linear 256^2, GELU, LayerNorm): " + "; ".join(f"{k} {v:.1f} us" for k, v in r.items()))
    sys.exit()
emb = torch.nn.Embedding(32000, 4096, dtype=torch.bfloat16, device="cuda")
checked = QEmbedding.from_embedding(emb, qd.QuantScheme("q4s", block=32, store="packed_u32"))
unchecked = QEmbedding(checked.weight, dtype=torch.bfloat16, check_ids=False)
ids = torch.tensor([[7]], device="cuda")
with torch.inference_mode():
    r = {
        "torch nn.Embedding bf16": per_call(lambda: emb(ids)),
        "QEmbedding (ids checked)": per_call(lambda: checked(ids)),
        "QEmbedding (check_ids=False)": per_call(lambda: unchecked(ids)),
    }
print("1 id of a 32000 x 4096 table, int4 block 32: " + "; ".join(f"{k} {v:.1f} us" for k, v in r.items()))
