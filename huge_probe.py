import numpy as np, qdispatch as qd, resource
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
def t(name, fn):
    for d in ("cpu", "reference"):
        try:
            r = fn(d); print(name, d, "ok", getattr(r, "shape", r))
        except BaseException as e:
            print(name, d, type(e).__name__, isinstance(e, qd.QDispatchError), str(e)[:150])
a = np.broadcast_to(np.int8(1), (1 << 40, 2))
b = np.ones((2, 3), np.int8)
t("int_matmul 2^40 rows", lambda d: qd.int_matmul(qd.tensor(a, device=d), qd.tensor(b, device=d)))
x = np.broadcast_to(np.float32(1), (1 << 40, 32))
w = np.ones((4, 32), np.float32)
t("fq 2^40 rows", lambda d: qd.q_matmul(qd.tensor(x, device=d), qd.quantize(w, "q8s", device=d).T))
t("quantize 2^40 rows", lambda d: qd.quantize(qd.tensor(x, device=d), "q8s"))
t("qtensor_zeros huge", lambda d: qd.QTensor.__name__ and __import__("qdispatch").tensor_api.qtensor_zeros((1 << 40, 1 << 40), "q8s", device=d))
