"""The cuda backend against the reference backend (the executable spec):
int_matmul and quantization bit-identical, qq/fq within named tolerances, on
shapes that hit the kernels' tiles and tails; transfers, dispatch errors,
out-of-memory, several GPUs and DLPack."""
import functools
import json

import numpy as np
import pytest

import qdispatch as qd
from helpers import QUANTIZE_SCHEMES, rel_err
from qdispatch._core import get_backend

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif("cuda" not in qd.available_backends(), reason="needs the cuda backend and a GPU"),
]

QQ_TOL = 1e-6   # relative (Frobenius) error of qq against the reference: same group sums
FQ_TOL = 1e-5   # fq: float32 accumulation in another order than numpy's BLAS

TAIL_SHAPES = [(1, 1, 1), (1, 16, 8), (3, 17, 5), (16, 32, 16), (17, 31, 33), (31, 33, 63),
               (33, 64, 65), (63, 65, 31), (64, 128, 64), (65, 63, 129), (127, 97, 131),
               (128, 256, 128), (129, 257, 255), (1, 4096, 1000), (200, 1000, 7)]


def ref(x):
    return x.to("reference")


def cuda_rng_int8(rng, shape, lo=-128, hi=127):
    return rng.integers(lo, hi + 1, size=shape, dtype=np.int8)


def assert_rounded_once(float32_result, half, dtype):
    """`half` is the float32 result rounded once to `dtype` (to nearest even):
    the kernel wrote it from the same float32 sums, not rounded them twice."""
    assert half.dtype == dtype
    once = qd.tensor(np.asarray(float32_result, np.float32), device="reference", dtype=dtype).numpy()
    np.testing.assert_array_equal(half.numpy(), once)


# ---- int_matmul: exact ---------------------------------------------------------

@pytest.mark.parametrize("M,K,N", TAIL_SHAPES)
def test_int_matmul_bit_identical(rng, M, K, N):
    a, b = cuda_rng_int8(rng, (M, K)), cuda_rng_int8(rng, (K, N))
    out = qd.int_matmul(qd.tensor(a, device="cuda"), qd.tensor(b, device="cuda"))
    assert out.dtype == "int32" and out.device == "cuda:0"
    np.testing.assert_array_equal(out.numpy(), a.astype(np.int64) @ b.astype(np.int64))


@pytest.mark.parametrize("fill", ["all_min", "alternating"])
@pytest.mark.parametrize("M,K,N", [(1, 4096, 64), (65, 1024, 33), (128, 8192, 128)])
def test_int_matmul_adversarial(M, K, N, fill):
    if fill == "all_min":
        a, b = np.full((M, K), -128, np.int8), np.full((K, N), -128, np.int8)
    else:
        a = np.where(np.arange(M * K).reshape(M, K) % 2, 127, -128).astype(np.int8)
        b = np.where(np.arange(K * N).reshape(K, N) % 2, -128, 127).astype(np.int8)
    out = qd.int_matmul(qd.tensor(a, device="cuda"), qd.tensor(b, device="cuda")).numpy()
    np.testing.assert_array_equal(out, a.astype(np.int64) @ b.astype(np.int64))


def test_int_matmul_vector_and_batch(rng):
    a, b = cuda_rng_int8(rng, (3, 5, 40)), cuda_rng_int8(rng, (40, 9))
    out = qd.int_matmul(qd.tensor(a, device="cuda"), qd.tensor(b, device="cuda"))
    np.testing.assert_array_equal(out.numpy(), a.astype(np.int64) @ b.astype(np.int64))
    v = cuda_rng_int8(rng, (40,))
    out = qd.int_matmul(qd.tensor(v, device="cuda"), qd.tensor(b, device="cuda"))
    np.testing.assert_array_equal(out.numpy(), v.astype(np.int64) @ b.astype(np.int64))


# ---- quantize / dequantize: bit-identical --------------------------------------

SCHEMES = QUANTIZE_SCHEMES


@pytest.mark.parametrize("scheme", SCHEMES, ids=repr)
# and narrow rows, and more rows (of narrow ones) than the grid's 65535 blocks along y hold
@pytest.mark.parametrize("shape", [(8, 128), (4, 8, 256), (1, 4096), (300, 12), (77, 36), (530000, 2)])
def test_quantize_bit_identical(rng, scheme, shape):
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 100, size=shape[-1])).astype(np.float32)
    if shape[-1] > 32:
        x[..., :32] = 0.0  # an all-zero block (scale 1.0) where blocks are 32 wide
    x.reshape(-1)[7] = 0.5 * float(np.abs(x).max())  # ties to even happen at .5 steps
    try:
        spec = qd.quantize(x, scheme, device="reference")
    except qd.QDispatchError as exc:  # the scheme does not fit this shape: same error on cuda
        with pytest.raises(type(exc)):
            qd.quantize(x, scheme, device="cuda")
        return
    on_gpu = qd.quantize(x, scheme, device="cuda")
    np.testing.assert_array_equal(on_gpu.values, spec.values)
    np.testing.assert_array_equal(on_gpu.scales, spec.scales)
    for dtype in ("float32", "bfloat16", "float16"):  # the float32 products, rounded once as the host casts
        for got, want in ((on_gpu, spec), (on_gpu.T, spec.T)):
            out = got.dequantize(dtype)
            assert out.dtype == dtype and out.device == "cuda:0"
            np.testing.assert_array_equal(out.numpy(), want.dequantize(dtype).numpy())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("scheme", SCHEMES, ids=repr)
def test_quantize_16bit_data_in_place_bit_identical(monkeypatch, rng, dtype, scheme):
    """16-bit data is read as it is (a float32 copy took twice its bytes: a 40 GB bf16
    weight needed 76 GiB more), with the bits of quantizing its float32 values."""
    x32 = (rng.standard_normal((4, 8, 256)) * rng.uniform(0.01, 100, size=256)).astype(np.float32)
    x32.reshape(-1)[7] = 0.5 * float(np.abs(x32).max())
    x = qd.tensor(x32, device="cuda", dtype=dtype)
    try:
        spec = qd.quantize(x.to("reference"), scheme)
    except qd.QDispatchError as exc:  # the scheme does not fit this shape: same error on cuda
        with pytest.raises(type(exc)):
            qd.quantize(x, scheme)
        return
    backend = get_backend("cuda")

    def cast(*args):
        raise AssertionError(f"quantize copied {dtype} data: cast{args[1:]}")
    monkeypatch.setattr(backend, "cast", cast)
    on_gpu = qd.quantize(x, scheme)
    monkeypatch.undo()
    assert on_gpu.device == "cuda:0"
    np.testing.assert_array_equal(on_gpu.values, spec.values)
    np.testing.assert_array_equal(on_gpu.scales, spec.scales)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_16bit_non_finite_names_value_and_position(dtype, bad):
    x = np.ones((4, 64), np.float32)
    x[2, 17] = bad
    x[3, 1] = bad
    with pytest.raises(qd.NonFiniteError, match=rf"holding {float(bad)!r} at position \(2, 17\)"):
        qd.quantize(qd.tensor(x, device="cuda", dtype=dtype), qd.QuantScheme("q8s", block=32))


def test_quantize_bfloat16_scale_overflow_names_the_block():
    x = np.ones((4, 64), np.float32)
    x[3, 40:] = 1e10  # bf16 holds it; an f16 scale of 1e10 / 127 does not
    scheme = qd.QuantScheme("q8s", block=32, scale_dtype="f16")
    with pytest.raises(qd.ScaleOverflowError, match=r"block \(3, 1\)") as exc:
        qd.quantize(qd.tensor(x, device="cuda", dtype="bfloat16"), scheme)
    with pytest.raises(qd.ScaleOverflowError) as spec:
        qd.quantize(qd.tensor(x, device="reference", dtype="bfloat16"), scheme)
    assert str(exc.value) == str(spec.value)  # the same scale, from the block's values


def test_quantize_takes_names_read_from_numpy(rng):
    """A scheme built from np.str_ names (read out of an array) quantizes on cuda
    as written with str."""
    names = np.array(["q4s", "packed_u32", "f16"])
    scheme = qd.QuantScheme(names[0], block=32, store=names[1], scale_dtype=names[2])
    x = rng.standard_normal((16, 64)).astype(np.float32)
    on_gpu = qd.quantize(x, scheme, device="cuda")
    np.testing.assert_array_equal(on_gpu.values, qd.quantize(x, scheme, device="reference").values)

def test_quantize_tiny_scales_round_half_even():
    x = np.array([[0.5, 1.5, 2.5, -0.5, -2.5, 127.0, 0.0, 3.5]], np.float32)
    on_gpu = qd.quantize(x, "q8s", device="cuda")
    np.testing.assert_array_equal(on_gpu.values, qd.quantize(x, "q8s", device="reference").values)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_non_finite_names_position(bad):
    x = np.ones((4, 64), np.float32)
    x[2, 17] = bad
    x[3, 1] = bad
    with pytest.raises(qd.NonFiniteError, match=r"\(2, 17\)"):
        qd.quantize(x, qd.QuantScheme("q8s", block=32), device="cuda")


def test_quantize_scale_overflow():
    x = np.full((2, 32), 1e10, np.float32)
    with pytest.raises(qd.ScaleOverflowError):
        qd.quantize(x, qd.QuantScheme("q8s", scale_dtype="f16"), device="cuda")
    # the process and the device keep working
    assert qd.quantize(np.ones((2, 32), np.float32), "q8s", device="cuda").values.sum() == 64 * 127


@pytest.mark.parametrize("n", [1, 31, 1024, 1025, 5000, 352256])
def test_largest_magnitude_of_a_scale_grid(rng, n):
    """What quantize's check of the scales against float32's range reads on a GPU
    (4 bytes, not the grid): the largest |value|, of either sign, anywhere."""
    from qdispatch import _cuda
    x = rng.standard_normal(n).astype(np.float32)
    for where, sign in ((0, -1), (n - 1, 1), (n // 2, -1)):
        y = x.copy()
        y[where] = sign * 3.0e38
        assert _cuda.largest_magnitude(_cuda.from_host(y, "float32", 0)) == float(np.float32(3.0e38))
    got = _cuda.largest_magnitude(_cuda.from_host(x.reshape(1, n), "float32", 0))
    assert got == float(np.abs(x).max())
    assert _cuda.largest_magnitude(_cuda.from_host(np.zeros(n, np.float32), "float32", 0)) == 0.0
    bad = x.copy()
    bad[n - 1] = np.nan
    with pytest.raises(qd.NonFiniteError):
        _cuda.largest_magnitude(_cuda.from_host(bad, "float32", 0))


# ---- qq: fused scale epilogue --------------------------------------------------

QQ_PAIRS = [  # (lhs scheme for [M, K], rhs scheme for w [N, K])
    (qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8s", axis=0)),   # per-row x per-column
    (qd.QuantScheme("q8f"), qd.QuantScheme("q8s")),                   # per-tensor
    (qd.QuantScheme("q8s", block=32), qd.QuantScheme("q8s", block=32)),
    (qd.QuantScheme("q8s", block=64), qd.QuantScheme("q8f", block=128)),  # G = 64
    (qd.QuantScheme("q8s", block=128), qd.QuantScheme("q8s", block=32, scale_dtype="bf16")),
    (qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q4s", block=32, store="packed_u32")),
    (qd.QuantScheme("q8s", block=16), qd.QuantScheme("q8s", axis=0)),   # G = 16: spread to whole mma steps
]


@pytest.mark.parametrize("a_scheme,w_scheme", QQ_PAIRS, ids=repr)
@pytest.mark.parametrize("M,N", [(1, 64), (17, 65), (64, 128), (130, 33)])
def test_qq_matches_reference(rng, a_scheme, w_scheme, M, N):
    K = 256
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    xq, wq = qd.quantize(x, a_scheme, device="cuda"), qd.quantize(w, w_scheme, device="cuda")
    out = qd.q_matmul(xq, wq.T)
    expect = qd.q_matmul(ref(xq), ref(wq).T).numpy()
    assert out.shape == (M, N) and out.device == "cuda:0"
    assert rel_err(expect, out.numpy()) < QQ_TOL


def assert_qq_bits_match_reference(xq, wq):
    """x @ w.T on the GPU gives the reference's float32 bits."""
    np.testing.assert_array_equal(qd.q_matmul(xq, wq.T).numpy(), qd.q_matmul(ref(xq), ref(wq).T).numpy())


QQ_BLOCK_PAIRS = [  # scale blocks along K, for x [M, K] and w [N, K]; N
    (qd.QuantScheme("q8s", block=32), qd.QuantScheme("q8s", block=32), 320),     # a block ends every step
    (qd.QuantScheme("q8s", block=(4, 128)), qd.QuantScheme("q8s", block=32), 320),  # a row scale spans 4 blocks
    (qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8s", block=(64, 128)), 320),   # 64 columns to a scale
    (qd.QuantScheme("q8s", block=128), qd.QuantScheme("q8s", block=(128, 128)), 384),  # a tile's columns share one
    (qd.QuantScheme("q8s", block=256), qd.QuantScheme("q8f", block=512), 320),    # blocks over two k tiles
    (qd.QuantScheme("q8s", block=512), qd.QuantScheme("q8s", block=(128, 512)), 384),  # sums past 2^22
    (qd.QuantScheme("q8s", block=64), qd.QuantScheme("q4s", block=32, store="packed_u32"), 320),
]


@pytest.mark.parametrize("a_scheme,w_scheme,N", QQ_BLOCK_PAIRS, ids=repr)
def test_qq_blocks_along_k_over_many_tiles(rng, a_scheme, w_scheme, N):
    """Blocks of K over several output tiles each way, with tails in M (and N where
    the weight's blocks allow): each block's int32 sums, scaled by its pair of
    scales, are added in order of K, as the reference adds them, bit for bit."""
    M, K = 260, 1024
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    if a_scheme.block == (512,):  # out[i, i]: each block sums 512 * 127^2, the most a block of 512 can
        x, w = np.sign(x), np.sign(w)
        w[:M] = x
    assert_qq_bits_match_reference(qd.quantize(x, a_scheme, device="cuda"), qd.quantize(w, w_scheme, device="cuda"))


@pytest.mark.parametrize("w_scheme", [qd.QuantScheme("q8s", block=96), qd.QuantScheme("q8s", block=(64, 480)),
                                      qd.QuantScheme("q8s", block=(128, 480))], ids=repr)
def test_qq_blocks_that_straddle_k_tiles(rng, w_scheme):
    """Blocks of 96 values end inside the kernels' 128-byte k tiles, and K = 960 ends
    half way through the last one: each block still takes its own pair of scales
    (a weight scale spans five of them with blocks of 480)."""
    M, K, N = 130, 960, 256
    xq = qd.quantize(rng.standard_normal((M, K)).astype(np.float32), qd.QuantScheme("q8s", block=96), device="cuda")
    assert_qq_bits_match_reference(xq, qd.quantize(rng.standard_normal((N, K)).astype(np.float32), w_scheme,
                                                   device="cuda"))


QQ_OFF_STEP_PAIRS = [  # K blocks of x [M, K] and w [N, K] whose common divisor G is no multiple of 32
    (qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8s", block=16)),          # G = 16: 32-byte slots
    (qd.QuantScheme("q8s", block=48), qd.QuantScheme("q8s", block=(8, 48))),   # G = 48: 64-byte slots
    (qd.QuantScheme("q8s", block=48), qd.QuantScheme("q8s", block=32)),        # G = 16, blocks of 3 and 2 slots
    (qd.QuantScheme("q8s", block=40), qd.QuantScheme("q8f", block=24)),        # G = 8: 4x the bytes
    (qd.QuantScheme("q8s", block=(2, 8)), qd.QuantScheme("q8s", axis=0)),      # G = 8, two rows to a scale
]


@pytest.mark.parametrize("a_scheme,w_scheme", QQ_OFF_STEP_PAIRS, ids=repr)
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_qq_blocks_off_the_mma_steps(rng, a_scheme, w_scheme, out_dtype):
    """K blocks that end inside the tensor cores' 32-value steps: each piece of G
    values of both operands is spread to whole steps, zeros after it, so every
    block's int32 sums, scaled and added in order of K, give the reference's bits.
    K = 960 ends inside a k tile; M and N have tails."""
    M, K, N = 130, 960, 200
    xq = qd.quantize(rng.standard_normal((M, K)).astype(np.float32), a_scheme, device="cuda")
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), w_scheme, device="cuda")
    out = qd.q_matmul(xq, wq.T, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (M, N)
    np.testing.assert_array_equal(out.numpy(), qd.q_matmul(ref(xq), ref(wq).T, out_dtype=out_dtype).numpy())


QQ_FINE_GROUP_CASES = [  # x [M, K] and w [N, K] whose K blocks share fewer than 8 values; M, K
    (qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8s", axis=1), 130, 1000),  # w per input channel: G = 1
    (qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8s", axis=1), 1, 4096),     # ... one row (decode)
    (qd.QuantScheme("q8f", axis=1), qd.QuantScheme("q8s", axis=0), 130, 960),    # x per input channel
    (qd.QuantScheme("q8s", block=(2, 6)), qd.QuantScheme("q8s", block=10), 130, 960),  # G = 2, two rows a scale
    (qd.QuantScheme("q8s", block=3), qd.QuantScheme("q8f", block=(8, 9)), 130, 963),   # G = 3, 8 rows a scale
    (qd.QuantScheme("q8s", block=4), qd.QuantScheme("q8s", block=32), 130, 960),       # G = 4
    (qd.QuantScheme("q8s", block=5), qd.QuantScheme("q8s", axis=0), 65, 960),          # G = 5
    (qd.QuantScheme("q8s", block=12), qd.QuantScheme("q8s", block=18), 130, 1008),     # G = 6
    (qd.QuantScheme("q8s", block=7), qd.QuantScheme("q8s", axis=0), 17, 1001),         # G = 7
]


@pytest.mark.parametrize("a_scheme,w_scheme,M,K", QQ_FINE_GROUP_CASES, ids=repr)
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_qq_groups_finer_than_8_values(rng, a_scheme, w_scheme, M, K, out_dtype):
    """K blocks whose common divisor G is below 8 (a weight scaled per input
    channel): each group's products are summed exactly on the float units, scaled
    and added in order of K as the reference does, bit for bit. Tiles of 64 have
    tails in M and N, and K ends part way through a slice of groups (G = 1, 3, 7)."""
    N = 200
    xq = qd.quantize(rng.standard_normal((M, K)).astype(np.float32), a_scheme, device="cuda")
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), w_scheme, device="cuda")
    out = qd.q_matmul(xq, wq.T, out_dtype=out_dtype)
    assert out.dtype == out_dtype and out.shape == (M, N)
    np.testing.assert_array_equal(out.numpy(), qd.q_matmul(ref(xq), ref(wq).T, out_dtype=out_dtype).numpy())


def test_qq_per_input_channel_at_the_extremes(rng):
    """Products at their largest, -128 * -128, and the largest negative ones, with a
    scale of its own for each K on both sides: the group sums and their running
    total, bit for bit."""
    M, K, N = 70, 777, 90
    scheme = qd.QuantScheme("q8f", axis=1)
    a = np.where(np.arange(M * K).reshape(M, K) % 3 == 0, 127, -128).astype(np.int8)
    b = np.full((N, K), -128, np.int8)
    b[1::2, ::2] = 127
    xq = qd.qtensor_from_parts(a, rng.uniform(0.5, 2.0, K).astype(np.float32), scheme, device="cuda")
    wq = qd.qtensor_from_parts(b, rng.uniform(0.5, 2.0, K).astype(np.float32), scheme, device="cuda")
    np.testing.assert_array_equal(qd.q_matmul(xq, wq.T).numpy(), qd.q_matmul(ref(xq), ref(wq).T).numpy())


@pytest.mark.parametrize("K", [262080, 140000], ids=["whole-parts", "a-part-left-over"])
def test_qq_longer_k_than_int32_holds(K):
    """One scale over a K whose sums overflow int32 (127 * 127 * K > 2^31): K is
    cut into exact parts, whether or not they divide it."""
    x = np.ones((3, K), np.float32)
    x[1] = -1.0
    w = np.ones((5, K), np.float32)
    xq = qd.quantize(x, qd.QuantScheme("q8s", axis=0), device="cuda")
    wq = qd.quantize(w, qd.QuantScheme("q8s", axis=0), device="cuda")
    out = qd.q_matmul(xq, wq.T).numpy()
    assert rel_err(qd.q_matmul(ref(xq), ref(wq).T).numpy(), out) < QQ_TOL
    np.testing.assert_allclose(out, np.float32(K) * np.array([[1.0] * 5, [-1.0] * 5, [1.0] * 5]), rtol=1e-5)


@pytest.mark.parametrize("M,K,N", TAIL_SHAPES)
def test_qq_tails_per_row_per_column(rng, M, K, N):
    xq = qd.quantize(rng.standard_normal((M, K)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cuda")
    wq = qd.quantize(rng.standard_normal((K, N)).astype(np.float32), qd.QuantScheme("q8s", axis=1), device="cuda")
    out = qd.q_matmul(xq, wq).numpy()  # rhs stored [K, N]: transposed on the GPU once
    # one exact group: the same float32 products as the reference, bit for bit
    np.testing.assert_array_equal(out, qd.q_matmul(ref(xq), ref(wq)).numpy())


@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16"])
def test_qq_half_outputs(rng, out_dtype):
    xq = qd.quantize(rng.standard_normal((33, 128)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cuda")
    wq = qd.quantize(rng.standard_normal((40, 128)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cuda")
    out = qd.q_matmul(xq, wq.T, out_dtype=out_dtype)
    expect = qd.q_matmul(ref(xq), ref(wq).T, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    np.testing.assert_array_equal(out.numpy(), expect.numpy())


def test_qq_batched_and_transposed_lhs(rng):
    x = rng.standard_normal((2, 3, 48, 64)).astype(np.float32)
    w = rng.standard_normal((3, 64, 40)).astype(np.float32)
    xq = qd.quantize(x, qd.QuantScheme("q8s", block=32), device="cuda")
    wq = qd.quantize(w, qd.QuantScheme("q8s", block=(32, 8)), device="cuda")
    out = qd.q_matmul(xq, wq).numpy()
    assert rel_err(qd.q_matmul(ref(xq), ref(wq)).numpy(), out) < QQ_TOL
    xt = qd.quantize(rng.standard_normal((64, 20)).astype(np.float32), "q8s", device="cuda")
    w2 = qd.quantize(rng.standard_normal((64, 24)).astype(np.float32), "q8s", device="cuda")
    assert rel_err(qd.q_matmul(ref(xt).T, ref(w2)).numpy(), qd.q_matmul(xt.T, w2).numpy()) < QQ_TOL


# ---- fq: weight streaming, dequantized on load ---------------------------------

FQ_SCHEMES = [
    qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8s", block=32), qd.QuantScheme("q8f", block=128),
    qd.QuantScheme("q4s", block=32, store="packed_u32"), qd.QuantScheme("q4f", axis=0, store="packed_u32"),
    qd.QuantScheme("q4s", block=16, store="packed_u32"),  # finer than an int4 chunk: read as int8
    qd.QuantScheme("q2s", block=64, store="packed_u32"), qd.QuantScheme("q8s", block=8),
]


@pytest.mark.parametrize("scheme", FQ_SCHEMES, ids=repr)
@pytest.mark.parametrize("M", [1, 4, 16, 17, 40])
@pytest.mark.parametrize("K,N", [(256, 96), (384, 33)])
def test_fq_matches_reference(rng, scheme, M, K, N):
    x = rng.standard_normal((M, K)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), scheme, device="cuda")
    out = qd.q_matmul(qd.tensor(x, device="cuda"), wq.T)
    expect = qd.q_matmul(qd.tensor(x, device="reference"), ref(wq).T).numpy()
    assert out.shape == (M, N)
    assert rel_err(expect, out.numpy()) < FQ_TOL


def _bf16_valued(x):
    """float32 values that bf16 holds exactly (the tensor-core path's one-part case)."""
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


@pytest.mark.parametrize("scheme", [qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q4s", block=32, store="packed_u32"),
                                    qd.QuantScheme("q2s", block=64, store="packed_u32")], ids=repr)
@pytest.mark.parametrize("M", [1, 9, 16])
@pytest.mark.parametrize("bf16_x", [True, False])
@pytest.mark.parametrize("K", [2048, 12288])
def test_fq_split_k_is_deterministic(rng, scheme, M, bf16_x, K):
    # Enough K to split it over blocks (many splits at M = 16, K = 12288), N not a
    # multiple of a block's rows.
    N = 600
    x = rng.standard_normal((M, K)).astype(np.float32)
    x = _bf16_valued(x) if bf16_x else x
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), scheme, device="cuda")
    xt = qd.tensor(x, device="cuda")
    first, second = qd.q_matmul(xt, wq.T).numpy(), qd.q_matmul(xt, wq.T).numpy()
    expect = qd.q_matmul(qd.tensor(x, device="reference"), ref(wq).T).numpy()
    assert np.array_equal(first, second)
    assert rel_err(expect, first) < FQ_TOL


@pytest.mark.parametrize("scheme", [qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q4s", block=128, store="packed_u32")],
                         ids=repr)
@pytest.mark.parametrize("M", [4, 8, 16, 32])
def test_fq_split_k_in_clusters(rng, scheme, M):
    # 256 bands of 16 weight rows on a GPU of 64-191 SMs (an H100 or H200 has 132):
    # at M = 8 K is cut in two, and the two splits add their sums in each other's
    # shared memory; at M = 16 and 32 (one launch of four n8 tiles of x) it is cut
    # in eight, one warp per band, and the splits' sums meet in device memory; at
    # M = 4 eight warps share each band.
    K = N = 4096
    x = _bf16_valued(rng.standard_normal((M, K)).astype(np.float32))
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), scheme, device="cuda")
    xt = qd.tensor(x, device="cuda", dtype="bfloat16")
    first, second = qd.q_matmul(xt, wq.T).numpy(), qd.q_matmul(xt, wq.T).numpy()
    expect = qd.q_matmul(qd.tensor(x, device="reference"), ref(wq).T).numpy()
    assert np.array_equal(first, second)
    assert rel_err(expect, first) < FQ_TOL


def test_fq_from_python_threads(rng):
    # Threads on one GPU: decode calls whose K is cut over blocks (their sums meet in
    # the device's scratch, which a larger call may grow meanwhile) and calls with
    # no split, interleaved; each thread's results equal its single-threaded ones.
    import threading
    schemes = [qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q4s", block=128, store="packed_u32")]
    cases = []
    for i, (M, K, N) in enumerate([(16, 4096, 512), (1, 1024, 256), (16, 12288, 600), (9, 8192, 1040),
                                   (4, 2048, 96), (16, 4096, 2064)]):
        wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), schemes[i % 2], device="cuda")
        x = qd.tensor(_bf16_valued(rng.standard_normal((M, K)).astype(np.float32)), device="cuda", dtype="bfloat16")
        cases.append((x, wq, qd.q_matmul(x, wq.T).numpy()))
    errors = []

    def work(x, wq, expected):
        try:
            for _ in range(25):
                np.testing.assert_array_equal(qd.q_matmul(x, wq.T).numpy(), expected)
        except Exception as exc:  # reported below
            errors.append(exc)

    pool = [threading.Thread(target=work, args=case) for case in cases]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors[0]


@functools.lru_cache(maxsize=1)
def _weights_for_batch_tests(K, N):
    return np.random.default_rng(K + N).standard_normal((N, K), dtype=np.float32)


@pytest.fixture
def batch_invariant():
    qd.set_batch_invariant(True)
    yield
    qd.set_batch_invariant(False)


@pytest.mark.parametrize("scheme", [qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q4s", block=128, store="packed_u32"),
                                    qd.QuantScheme("q4s", block=32, store="packed_u32"),
                                    qd.QuantScheme("q2s", block=64, store="packed_u32")], ids=repr)
@pytest.mark.parametrize("x_dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("K,N", [(4096, 4096), (4096, 11008), (12288, 600)])
def test_fq_batch_invariant(rng, batch_invariant, scheme, x_dtype, K, N):
    # A row's result is the same whatever batch it comes in.  M decides how the
    # parts of K are dealt out (4096 x 4096: eight parts, one block's eight warps
    # per band at M <= 4, two splits of four warps at M = 5-8, eight splits at
    # M = 9-16; 4096 x 11008: three splits; 12288 x 600: 48 parts in six or twelve
    # splits of several warps), and rows past 16 go in further launches, but the
    # parts and the order their sums are added in stay the same.
    xs = rng.standard_normal((40, K)).astype(np.float32)
    wq = qd.quantize(_weights_for_batch_tests(K, N), scheme, device="cuda")

    def rows(lo, hi):
        return qd.q_matmul(qd.tensor(xs[lo:hi], device="cuda", dtype=x_dtype), wq.T).numpy()

    full = rows(0, 40)
    for M in list(range(1, 17)) + [23, 33]:
        np.testing.assert_array_equal(rows(0, M), full[:M], err_msg=f"rows 0..{M - 1}")
        np.testing.assert_array_equal(rows(40 - M, 40), full[40 - M:], err_msg=f"rows {40 - M}..39")
    expect = qd.q_matmul(qd.tensor(xs[:4], device="reference", dtype=x_dtype), ref(wq).T).numpy()
    assert rel_err(expect, full[:4]) < FQ_TOL  # float32 out, from the same x values


FQ_VALUES_SCHEMES = [  # weight blockings along K that the decode tiles can't take (no multiple of 16)
    qd.QuantScheme("q8f", block=8),
    qd.QuantScheme("q8s", block=(4, 24)),                   # four rows to a scale
    qd.QuantScheme("q4s", block=8, store="packed_u32"),
    qd.QuantScheme("q2f", block=(2, 40), store="packed_u32"),
]


@pytest.mark.parametrize("scheme", FQ_VALUES_SCHEMES, ids=repr)
@pytest.mark.parametrize("M", [1, 16, 65, 300])
def test_fq_blockings_too_fine_for_the_tiles_run_on_the_gpu(monkeypatch, rng, scheme, M):
    """They went to the host: every call copied the weight there, dequantized it and
    multiplied in numpy. Now the float units multiply the weight's int8 values,
    each dequantized as it loads: within fq's tolerance for every x dtype, and with
    batch invariance on a row's result the same bits whatever rows come with it.
    K = 960 and N = 200 leave tails in the 64 x 64 output tiles (past 64 rows), the
    few-rows kernel's 512-value chunks and its blocks of 32 weight rows."""
    from qdispatch.backends import cuda as cuda_backend
    K, N = 960, 200
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), scheme, device="cuda")
    w_ref = ref(wq)
    x = rng.standard_normal((M, K)).astype(np.float32)
    monkeypatch.setattr(cuda_backend.CudaBackend, "qstorage_to_host",
                        lambda *a: pytest.fail("the weight went to the host"))
    for dtype in ("float32", "float16", "bfloat16"):
        xt = qd.tensor(x, device="cuda", dtype=dtype)
        out = qd.q_matmul(xt, wq.T)
        expect = qd.q_matmul(qd.tensor(x, device="reference", dtype=dtype), w_ref.T).numpy()
        assert out.shape == (M, N) and out.dtype == "float32" and out.device == "cuda:0"
        assert rel_err(expect, out.numpy()) < FQ_TOL
        assert_rounded_once(out.numpy(), qd.q_matmul(xt, wq.T, out_dtype=dtype), dtype)
        qd.set_batch_invariant(True)  # past 64 rows the tiles would run: a row's bits could differ
        try:
            whole = qd.q_matmul(xt, wq.T).numpy()
            np.testing.assert_array_equal(qd.q_matmul(xt[M - 1:], wq.T).numpy(), whole[M - 1:])
        finally:
            qd.set_batch_invariant(False)
        if M <= 64:
            np.testing.assert_array_equal(whole, out.numpy())


@pytest.mark.parametrize("scheme,stored_kn", [
    (qd.QuantScheme("q8s", axis=1), False),                                    # [N, K], a scale per k
    (qd.QuantScheme("q4f", axis=1, store="packed_u32", scale_dtype="f16"), False),
    (qd.QuantScheme("q2s", axis=0, store="packed_u32"), True),                 # [K, N], a scale per k
    (qd.QuantScheme("q8f", block=(200, 8)), False),                            # blocks of 8 along K only
], ids=repr)
@pytest.mark.parametrize("M,K", [(1, 960), (16, 960), (17, 37), (65, 960), (300, 960)])
def test_fq_weight_scaled_per_input_channel_scales_x_for_the_decode_kernel(monkeypatch, rng, scheme,
                                                                          stored_kn, M, K):
    """A scale per input channel is too fine for the decode tiles (a block of one value
    along K), but it is one scale for all of N at each k: x takes it (float32, each
    product rounded once) and the decode kernel, or from its threshold of rows the
    GEMM, multiplies the weight's values at one scale. Within fq's tolerance of the
    reference for every x dtype, never through the float units' kernel or the host,
    and with batch invariance on a row's bits do not depend on its batch. K = 37
    leaves x's scaled rows a tail past a 16-byte piece."""
    from qdispatch.backends import cuda as cuda_backend
    N = 200
    if scheme.block and K % scheme.block[-1]:
        pytest.skip("K is no multiple of the block")
    w = rng.standard_normal((K, N) if stored_kn else (N, K)).astype(np.float32)
    w *= np.exp(rng.uniform(-4, 4, K)).astype(np.float32)[:, None] if stored_kn else \
        np.exp(rng.uniform(-4, 4, K)).astype(np.float32)  # scales apart by up to e^8
    wq = qd.quantize(w, scheme, device="cuda")
    w_ref = ref(wq)
    operand, w_ref = (wq, w_ref) if stored_kn else (wq.T, w_ref.T)  # [K, N]
    x = rng.standard_normal((M, K)).astype(np.float32)
    monkeypatch.setattr(cuda_backend.CudaBackend, "qstorage_to_host",
                        lambda *a: pytest.fail("the weight went to the host"))
    monkeypatch.setattr(cuda_backend._cuda, "fq_values", lambda *a: pytest.fail("the float units' kernel ran"))
    for dtype in ("float32", "float16", "bfloat16"):
        xt = qd.tensor(x, device="cuda", dtype=dtype)
        out = qd.q_matmul(xt, operand)
        expect = qd.q_matmul(qd.tensor(x, device="reference", dtype=dtype), w_ref).numpy()
        assert out.shape == (M, N) and out.dtype == "float32" and out.device == "cuda:0"
        assert rel_err(expect, out.numpy()) < FQ_TOL
        assert_rounded_once(out.numpy(), qd.q_matmul(xt, operand, out_dtype=dtype), dtype)
        qd.set_batch_invariant(True)
        try:
            whole = qd.q_matmul(xt, operand).numpy()
            np.testing.assert_array_equal(qd.q_matmul(xt[M - 1:], operand).numpy(), whole[M - 1:])
        finally:
            qd.set_batch_invariant(False)
        assert rel_err(expect, whole) < FQ_TOL


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fq_with_x_taking_the_scales_stays_finite_where_the_reference_does(rng, dtype):
    """Where every weight value at k is 0, x[k] of 2^120 times a scale of 2^15 would
    overflow (x * s * 0: NaN) though the reference's terms there are 0: x takes s * 2^-e
    (2^e above every scale) and the tiles' one scale is 2^e, so every such product
    stays finite (as qd_fq_matmul_f32 folds them on the cpu). Scales from 2^93 down to
    2^-72 are not folded (the small ones would be 0): the float units take them."""
    M, K, N = 3, 64, 40
    q = rng.integers(-127, 128, (N, K)).astype(np.int8)
    q[:, ::3] = 0
    scales = np.ldexp(np.float32(1), rng.integers(-20, 16, (1, K))).astype(np.float32)
    scales[0, ::3] = 2.0 ** 15
    wq = qd.qtensor_from_parts(q, scales, qd.QuantScheme("q8s", axis=1), device="cuda")
    x = rng.standard_normal((M, K)).astype(np.float32)
    x[:, ::3] = np.ldexp(x[:, ::3], 120)
    xt = qd.tensor(x, device="cuda", dtype=dtype)
    out = qd.q_matmul(xt, wq.T).numpy()
    expect = qd.q_matmul(xt.to("reference"), ref(wq).T).numpy()
    assert np.isfinite(expect).all() and np.isfinite(out).all()
    assert rel_err(expect, out) < FQ_TOL
    far = qd.quantize(np.array([[1e30, 1e-20, 2e-20], [1e30, 3e-20, -1e-20]], np.float32),
                      qd.QuantScheme("q8s", axis=1), device="cuda")
    x_far = qd.tensor(np.array([[0.0, 1.0, 1.0]], np.float32), device="cuda", dtype=dtype)
    got, want = qd.q_matmul(x_far, far.T).numpy(), qd.q_matmul(x_far.to("reference"), ref(far).T).numpy()
    assert (want != 0).all()
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("scheme,transposed", [
    (qd.QuantScheme("q8s", axis=0), True), (qd.QuantScheme("q4f", block=32, store="packed_u32"), True),
    (qd.QuantScheme("q2s", block=16, store="packed_u32"), True),
    (qd.QuantScheme("q8s", axis=1), False), (qd.QuantScheme("q4s", block=(32, 1), store="packed_u32"), False),
], ids=repr)
def test_fq_weight_store_given_to_its_tiles(rng, scheme, transposed):
    # The decode tiles hold every value, so the first decode product frees the
    # store: the weight takes its size once on the GPU.  Whatever reads the values
    # afterwards (values, moves, dequantize, the other orientation, qq) gets them back.
    # transposed: stored [N, K] and used as w.T, else stored [K, N].
    K, N = 96, 64
    w = rng.standard_normal((N, K) if transposed else (K, N)).astype(np.float32)
    wq = qd.quantize(w, scheme, device="cuda")
    expect = ref(wq)
    values = wq.values
    operand, other = (wq.T, wq) if transposed else (wq, wq.T)  # [K, N], [N, K]
    x = rng.standard_normal((3, K)).astype(np.float32)
    out = qd.q_matmul(qd.tensor(x, device="cuda"), operand).numpy()
    assert not wq.storage.holds_values
    assert rel_err(qd.q_matmul(qd.tensor(x, device="reference"), ref(operand)).numpy(), out) < FQ_TOL
    np.testing.assert_array_equal(wq.values, values)
    np.testing.assert_array_equal(wq.to("cpu").values, values)
    np.testing.assert_array_equal(wq.dequantize().numpy(), expect.dequantize().numpy())
    x_other = rng.standard_normal((2, N)).astype(np.float32)
    assert rel_err(qd.q_matmul(qd.tensor(x_other, device="reference"), ref(other)).numpy(),
                   qd.q_matmul(qd.tensor(x_other, device="cuda"), other).numpy()) < FQ_TOL
    a8 = qd.quantize(rng.standard_normal((5, K)).astype(np.float32), "q8s", device="cuda")
    assert rel_err(qd.q_matmul(ref(a8), ref(operand)).numpy(), qd.q_matmul(a8, operand).numpy()) < QQ_TOL
    assert not wq.storage.holds_values
    np.testing.assert_array_equal(qd.q_matmul(qd.tensor(x, device="cuda"), operand).numpy(), out)


@pytest.mark.parametrize("K", [1, 17, 63, 65, 100])
def test_fq_odd_k_and_storage_orientation(rng, K):
    x = rng.standard_normal((3, K)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((K, 29)).astype(np.float32), "q8s", device="cuda")  # [K, N]
    out = qd.q_matmul(qd.tensor(x, device="cuda"), wq)
    expect = qd.q_matmul(qd.tensor(x, device="reference"), ref(wq)).numpy()
    assert rel_err(expect, out.numpy()) < FQ_TOL


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fq_half_activations_and_linear(rng, dtype):
    x = rng.standard_normal((4, 128)).astype(np.float32)
    w = qd.quantize(rng.standard_normal((64, 128)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cuda")
    bias = rng.standard_normal(64).astype(np.float32)
    xt = qd.tensor(x, device="cuda", dtype=dtype)
    out = qd.linear(xt, w, qd.tensor(bias, device="cuda"), out_dtype=dtype)
    full = qd.linear(xt, w, qd.tensor(bias, device="cuda")).numpy()
    expect = qd.linear(qd.tensor(x, device="reference", dtype=dtype), ref(w), bias).numpy()
    assert rel_err(expect, full) < FQ_TOL
    assert_rounded_once(full, out, dtype)  # the bias added before the one rounding


DECODE_SCHEMES = [qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q4s", block=128, store="packed_u32"),
                  qd.QuantScheme("q4s", block=32, store="packed_u32"), qd.QuantScheme("q2f", block=64, store="packed_u32")]


@pytest.mark.parametrize("scheme", DECODE_SCHEMES, ids=repr)
@pytest.mark.parametrize("x_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("M,K,N", [(1, 1024, 520), (5, 512, 96), (16, 2048, 33), (17, 256, 64), (3, 17, 40),
                                   (32, 2048, 33), (41, 384, 130)])
def test_fq_half_activations_read_directly(rng, scheme, x_dtype, out_dtype, M, K, N):
    """16-bit x goes to the kernel as it is and the kernel writes out_dtype: the
    same values as the reference converting around a float32 product."""
    if K % 32 and scheme.block is not None:
        pytest.skip("blocks along K must divide K")
    x = rng.standard_normal((M, K)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), scheme, device="cuda")
    xt = qd.tensor(x, device="cuda", dtype=x_dtype)
    out = qd.q_matmul(xt, wq.T, out_dtype=out_dtype)
    full = qd.q_matmul(xt, wq.T).numpy()
    expect = qd.q_matmul(qd.tensor(x, device="reference", dtype=x_dtype), ref(wq).T).numpy()
    assert out.shape == (M, N)
    assert rel_err(expect, full) < FQ_TOL
    assert_rounded_once(full, out, out_dtype)


@pytest.fixture
def fq_gemm_calls(monkeypatch):
    """Counts the calls of the many-rows (GEMM) path of fq."""
    from qdispatch import _cuda
    calls = []
    gemm = _cuda.fq_gemm_into
    monkeypatch.setattr(_cuda, "fq_gemm_into", lambda *args: calls.append(args) or gemm(*args))
    return calls


def _gemm_from_one_row(monkeypatch):
    """fq runs as a GEMM at any rows for weights first used from here on."""
    from qdispatch.backends import cuda as cuda_backend
    for table in ("FQ_GEMM_MIN_ROWS", "FQ_GEMM_MIN_ROWS_WIDE"):
        monkeypatch.setattr(cuda_backend, table, dict.fromkeys(getattr(cuda_backend, table), 1))


@pytest.fixture
def gemm_from_one_row(monkeypatch):
    _gemm_from_one_row(monkeypatch)


GEMM_SCHEMES = [qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q8s"), qd.QuantScheme("q8f", block=(4, 32)),
                qd.QuantScheme("q4s", block=128, store="packed_u32"),
                qd.QuantScheme("q4f", block=32, store="packed_u32", scale_dtype="f16"),
                qd.QuantScheme("q4s", axis=0, store="packed_u32"), qd.QuantScheme("q2s", block=64, store="packed_u32")]


@pytest.mark.parametrize("scheme", GEMM_SCHEMES, ids=repr)
@pytest.mark.parametrize("x_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("M,K,N", [(64, 256, 96), (130, 768, 77), (257, 1024, 300), (300, 100, 260),
                                   (200, 4096, 300)])
def test_fq_gemm_matches_reference(rng, gemm_from_one_row, fq_gemm_calls, scheme, x_dtype, M, K, N):
    """fq as a GEMM on the weight's values, for every blocking: tails in M, N and K
    (K = 100 is no whole 16-byte row), scales per block of K kept exact per block.
    These few tiles fill few SMs, so from K = 768 on K is cut into splits (eight
    at K = 4096), each of whole scale blocks, whose sums are added in order."""
    block = scheme.block or ()  # over the trailing dims of the weight [N, K]
    if any(dim % b for dim, b in zip((N, K)[2 - len(block):], block)):
        pytest.skip("blocks must divide the weight")
    x = rng.standard_normal((M, K)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), scheme, device="cuda")
    xt = qd.tensor(x, device="cuda", dtype=x_dtype)
    out = qd.q_matmul(xt, wq.T)
    expect = qd.q_matmul(qd.tensor(x, device="reference", dtype=x_dtype), ref(wq).T).numpy()
    assert len(fq_gemm_calls) == 1
    assert out.shape == (M, N) and out.dtype == "float32"
    assert rel_err(expect, out.numpy()) < FQ_TOL
    np.testing.assert_array_equal(qd.q_matmul(xt, wq.T).numpy(), out.numpy())  # deterministic
    assert_rounded_once(out.numpy(), qd.q_matmul(xt, wq.T, out_dtype=x_dtype), x_dtype)  # written by the kernel
    np.testing.assert_array_equal(wq.values, ref(wq).values)  # the weight is intact


@pytest.mark.parametrize("scheme", [GEMM_SCHEMES[0], GEMM_SCHEMES[3]], ids=repr)
@pytest.mark.parametrize("M", [1, 5, 16, 63])
def test_fq_gemm_at_few_rows(rng, monkeypatch, fq_gemm_calls, scheme, M):
    # The GEMM at rows the decode kernel takes (a tile mostly past M) agrees with it.
    K, N = 512, 136
    x = qd.tensor(_bf16_valued(rng.standard_normal((M, K)).astype(np.float32)), device="cuda", dtype="bfloat16")
    w = rng.standard_normal((N, K)).astype(np.float32)
    decode = qd.q_matmul(x, qd.quantize(w, scheme, device="cuda").T).numpy()
    assert not fq_gemm_calls
    _gemm_from_one_row(monkeypatch)
    gemm = qd.q_matmul(x, qd.quantize(w, scheme, device="cuda").T).numpy()
    assert len(fq_gemm_calls) == 1
    assert rel_err(decode, gemm) < FQ_TOL


@pytest.mark.parametrize("scheme,block_k,kind", [
    (GEMM_SCHEMES[0], 1024, "whole_k"), (GEMM_SCHEMES[5], 1024, "whole_k_packed"),
    (qd.QuantScheme("q8s", block=128), 128, "blocks_128"), (GEMM_SCHEMES[3], 128, "blocks_128_packed"),
    (qd.QuantScheme("q8s", block=64), 64, "blocks_64"), (GEMM_SCHEMES[6], 64, "blocks_64_packed"),
    (GEMM_SCHEMES[4], 32, "fine_blocks_packed")],
    ids=["whole-K", "whole-K-4-bit", "block-128", "block-128-4-bit", "block-64", "block-64-2-bit", "block-32-4-bit"])
def test_fq_many_rows_take_the_gemm(rng, fq_gemm_calls, scheme, block_k, kind):
    """A prefill-sized bf16 x takes the GEMM from the backend's threshold of rows
    for its weight's blocks along K and bits on: FQ_GEMM_MIN_ROWS (144 rows over
    all of K, 384 with blocks of 64 or more), or on an H100/H200, whose one-launch
    kernel for many rows leads further, FQ_GEMM_MIN_ROWS_WIDE (over all of K, 257
    rows of 8-bit weights and 640 of 4-bit ones; with blocks of 128, 384 and 1536;
    with blocks of 64, 1024 rows of 8-bit weights, never 4- or 2-bit ones).  Blocks of
    32 never take it."""
    from qdispatch import _cuda
    from qdispatch.backends import cuda as cuda_backend
    K, N = 1024, 200
    wide = _cuda.fq_wide_supported()
    assert cuda_backend.fq_gemm_kind(block_k, K, scheme.bits) == kind
    rows = cuda_backend.fq_gemm_min_rows(block_k, K, scheme.bits, wide)
    assert rows == (cuda_backend.FQ_GEMM_MIN_ROWS_WIDE if wide else cuda_backend.FQ_GEMM_MIN_ROWS)[kind]
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), scheme, device="cuda")
    for M in (rows - 1, rows) if rows else (600,):
        x = rng.standard_normal((M, K)).astype(np.float32)
        out = qd.q_matmul(qd.tensor(x, device="cuda", dtype="bfloat16"), wq.T)
        expect = qd.q_matmul(qd.tensor(x, device="reference", dtype="bfloat16"), ref(wq).T).numpy()
        assert rel_err(expect, out.numpy()) < FQ_TOL
        assert len(fq_gemm_calls) == (M == rows)


@pytest.mark.parametrize("scheme", [GEMM_SCHEMES[0], GEMM_SCHEMES[3], GEMM_SCHEMES[4]], ids=repr)
@pytest.mark.parametrize("out_dtype", ["float32", "bfloat16"])
def test_fq_gemm_float32_rows(rng, gemm_from_one_row, fq_gemm_calls, scheme, out_dtype):
    """float32 x is not rounded to 16 bits: the GEMM multiplies its three bf16 parts,
    stacked as rows, and adds their products.  Values bf16 cannot hold, values
    beyond float16's range and an inf and a NaN come out as the reference's."""
    M, K, N = 70, 256, 72
    x = rng.standard_normal((M, K)).astype(np.float32) * np.float32(1 + 2 ** -20)
    x[3] *= np.float32(1e6)
    x[5, 9], x[6, 200] = np.inf, np.nan
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), scheme, device="cuda")
    xt = qd.tensor(x, device="cuda")
    out = qd.q_matmul(xt, wq.T, out_dtype=out_dtype)
    assert len(fq_gemm_calls) == 1 and fq_gemm_calls[0][3] == 3 * M  # hi, mid, lo rows
    got = qd.q_matmul(xt, wq.T).numpy()
    with np.errstate(invalid="ignore"):  # inf * 0 in the reference's matmul
        expect = qd.q_matmul(qd.tensor(x, device="reference"), ref(wq).T).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expect))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expect))
    finite = np.isfinite(expect)
    assert rel_err(expect[finite], got[finite]) < FQ_TOL
    assert_rounded_once(got, out, out_dtype)  # the parts' products added in float32 first


@pytest.mark.parametrize("M", [1, 16, 64, 300])  # decode launches; 300 rows: the GEMM
def test_fq_float32_x_exact_down_to_2_to_the_110(rng, M):
    """float32 x in three bf16 parts holds every value of magnitude 2**-110 or more
    exactly (the README's bound); tinier values lose the bits under bf16's smallest
    step, 2**-133, at most 2**-134 per value, so the error stays within K of those."""
    K, N = 256, 72
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cuda")
    w64 = ref(wq).dequantize().numpy().astype(np.float64)
    mantissas = rng.uniform(1, 2, (M, K)) * np.where(rng.random((M, K)) < 0.5, -1, 1)
    small = (mantissas * 2.0 ** rng.integers(-110, -90, (M, K))).astype(np.float32)
    got = qd.q_matmul(qd.tensor(small, device="cuda"), wq.T).numpy()
    assert rel_err(small.astype(np.float64) @ w64.T, got) < FQ_TOL
    tiny = (mantissas * 2.0 ** -132).astype(np.float32)  # float32 subnormals
    got = qd.q_matmul(qd.tensor(tiny, device="cuda"), wq.T).numpy()
    bound = K * 2.0 ** -134 * np.abs(w64).max() + K * 2.0 ** -149  # the parts, then the float32 sums
    assert np.abs(got - tiny.astype(np.float64) @ w64.T).max() <= bound

def test_fq_float32_rows_take_the_gemm(rng, fq_gemm_calls):
    # float32 x takes the GEMM from FQ_GEMM_MIN_ROWS on every GPU: it runs as decode
    # launches of 16 rows below (cut into three parts there too).
    from qdispatch.backends import cuda as cuda_backend
    rows = cuda_backend.FQ_GEMM_MIN_ROWS["whole_k"]
    wq = qd.quantize(rng.standard_normal((40, 256)).astype(np.float32), GEMM_SCHEMES[0], device="cuda")
    for M in (rows - 1, rows):
        x = rng.standard_normal((M, 256)).astype(np.float32)
        out = qd.q_matmul(qd.tensor(x, device="cuda"), wq.T).numpy()
        assert len(fq_gemm_calls) == (M == rows)
        assert rel_err(qd.q_matmul(qd.tensor(x, device="reference"), ref(wq).T).numpy(), out) < FQ_TOL


def test_fq_wide_runs_on_hopper():
    """More than 40 rows of 16-bit x go in one launch exactly where the sm_90a kernels
    run: an H100/H200 and a build with sm_90a code."""
    from qdispatch import _cuda
    capability = qd.info()["backends"]["cuda"]["devices"][0]["capability"]
    archs = qd.info()["build"]["cuda"]["archs"]
    assert _cuda.fq_wide_supported() == (capability == "9.0" and "90a" in archs)


@pytest.mark.parametrize("scheme", DECODE_SCHEMES + [qd.QuantScheme("q8s", block=48),
                                                     qd.QuantScheme("q4s", block=16, store="packed_u32")], ids=repr)
@pytest.mark.parametrize("x_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("M,K,N", [(33, 256, 96), (130, 1024, 300), (300, 2048, 40), (70, 960, 130), (45, 1000, 70),
                                   (97, 333, 50), (100, 1024, 5504)])
def test_fq_many_rows_in_one_launch(rng, scheme, x_dtype, M, K, N):
    """Rows past 32 of 16-bit x, below the GEMM's threshold (on an H100/H200, from
    41 rows, one launch, 64 rows of x a block, K cut into splits when the blocks are
    few; otherwise launches of 32): tails in M, N and K, every blocking, against the
    reference, the same values on a second call.  On an H200 the splits meet in
    clusters of 2 to 8 blocks, except at (100, 1024, 5504), whose 86 blocks of
    three splits do not fit as clusters at once and meet in device memory."""
    if scheme.block is not None and K % scheme.block[-1]:
        pytest.skip("blocks along K must divide K")
    x = rng.standard_normal((M, K)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), scheme, device="cuda")
    xt = qd.tensor(x, device="cuda", dtype=x_dtype)
    out = qd.q_matmul(xt, wq.T, out_dtype="float32").numpy()
    expect = qd.q_matmul(qd.tensor(x, device="reference", dtype=x_dtype), ref(wq).T).numpy()
    assert rel_err(expect, out) < FQ_TOL
    np.testing.assert_array_equal(qd.q_matmul(xt, wq.T, out_dtype="float32").numpy(), out)


def test_fq_batch_invariant_keeps_many_rows_off_the_gemm(rng, batch_invariant, fq_gemm_calls):
    # Batch-invariant, any number of rows goes in decode launches of 16 rows: the
    # GEMM's sums (and its split of K) would follow the batch's size.
    K, N = 512, 96
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cuda")
    x = rng.standard_normal((300, K)).astype(np.float32)
    full = qd.q_matmul(qd.tensor(x, device="cuda", dtype="bfloat16"), wq.T).numpy()
    for lo, hi in [(0, 1), (0, 40), (137, 300)]:
        part = qd.q_matmul(qd.tensor(x[lo:hi], device="cuda", dtype="bfloat16"), wq.T).numpy()
        np.testing.assert_array_equal(part, full[lo:hi])
    assert not fq_gemm_calls


@pytest.mark.parametrize("scheme", DECODE_SCHEMES[:3], ids=repr)
@pytest.mark.parametrize("M,K,N", [(1, 4096, 4096), (4, 4096, 4096), (16, 4096, 4096), (16, 4096, 11008),
                                   (32, 4096, 11008), (64, 4096, 4096)])
def test_fq_decode_shapes_match_reference(rng, scheme, M, K, N):
    """The benchmark's decode shapes, whose launches cut the work into warps per
    band and splits of K by the GPU's size: the values the benchmark times."""
    x = rng.standard_normal((M, K)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32) * 0.05, scheme, device="cuda")
    xt = qd.tensor(x, device="cuda", dtype="bfloat16")
    out = qd.q_matmul(xt, wq.T, out_dtype="float32").numpy()
    expect = qd.q_matmul(qd.tensor(x, device="reference", dtype="bfloat16"), ref(wq).T).numpy()
    assert rel_err(expect, out) < FQ_TOL
    assert np.array_equal(out, qd.q_matmul(xt, wq.T, out_dtype="float32").numpy())  # split sums in a fixed order


@pytest.mark.parametrize("scheme", [qd.QuantScheme("q8s", block=48), qd.QuantScheme("q4s", block=16, store="packed_u32"),
                                    qd.QuantScheme("q2s", block=80, store="packed_u32")], ids=repr)
@pytest.mark.parametrize("M", [1, 12])
def test_fq_scale_blocks_ending_inside_a_weight_tile(rng, scheme, M):
    K, N = 480, 40  # tiles hold 32 (int8), 64 (int4) or 128 (int2) values of K
    x = rng.standard_normal((M, K)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), scheme, device="cuda")
    for dtype in ("float32", "bfloat16"):
        out = qd.q_matmul(qd.tensor(x, device="cuda", dtype=dtype), wq.T).numpy()
        expect = qd.q_matmul(qd.tensor(x, device="reference", dtype=dtype), ref(wq).T).numpy()
        assert rel_err(expect, out) < FQ_TOL


@pytest.mark.parametrize("scheme", [qd.QuantScheme("q8s"), qd.QuantScheme("q8s", block=(4, 32)),
                                    qd.QuantScheme("q4s", block=(8, 64), store="packed_u32")], ids=repr)
@pytest.mark.parametrize("M", [1, 16])
def test_fq_scales_shared_by_rows(rng, scheme, M):
    """One scale for many weight rows (per tensor, 2-D blocks): the kernel's scale
    tiles give every row of a 16-row band its own copy."""
    K, N = 512, 200  # 12.5 bands of 16 rows
    x = rng.standard_normal((M, K)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), scheme, device="cuda")
    xt = qd.tensor(x, device="cuda", dtype="bfloat16")
    out = qd.q_matmul(xt, wq.T).numpy()
    expect = qd.q_matmul(qd.tensor(x, device="reference", dtype="bfloat16"), ref(wq).T).numpy()
    assert rel_err(expect, out) < FQ_TOL


@pytest.mark.parametrize("scale", [1e6, 1e-7])
def test_fq_bf16_activations_beyond_f16(rng, scale):
    """bf16 x that f16 can't hold (huge or tiny values) keeps full accuracy: bf16
    activations multiply as bf16, never through f16."""
    x = rng.standard_normal((4, 512)).astype(np.float32)
    x[1] *= scale
    wq = qd.quantize(rng.standard_normal((64, 512)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cuda")
    out = qd.q_matmul(qd.tensor(x, device="cuda", dtype="bfloat16"), wq.T).numpy()
    expect = qd.q_matmul(qd.tensor(x, device="reference", dtype="bfloat16"), ref(wq).T).numpy()
    for row in range(4):
        assert rel_err(expect[row], out[row]) < FQ_TOL


@pytest.mark.parametrize("x_dtype", ["bfloat16", "float32"])
def test_fq_non_finite_activations_propagate(rng, x_dtype):
    x = rng.standard_normal((4, 256)).astype(np.float32)
    x[1, 7], x[2, 100] = np.inf, np.nan
    wq = qd.quantize(rng.standard_normal((48, 256)).astype(np.float32), qd.QuantScheme("q4s", block=32, store="packed_u32"))
    got = qd.q_matmul(qd.tensor(x, device="cuda", dtype=x_dtype), wq.to("cuda").T).numpy()
    expect = qd.q_matmul(qd.tensor(x, device="reference", dtype=x_dtype), wq.to("reference").T).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expect))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expect))
    finite = np.isfinite(expect)
    assert rel_err(expect[finite], got[finite]) < FQ_TOL


@pytest.mark.parametrize("scheme", [qd.QuantScheme("q8s", axis=0), qd.QuantScheme("q4s", block=128, store="packed_u32")],
                         ids=repr)
@pytest.mark.parametrize("M", [1, 16, 64, 130])
def test_fq_decode_chain_reads_each_steps_result(rng, scheme, M):
    """Back-to-back steps, each reading the step before's output (the kernels may
    start while the previous one runs): every step sees its input complete, with
    intermediate results freed and their memory reused on the way.  On Hopper 64 rows
    run as one launch whose splits meet in clusters, and 130 rows of K = 2048 as one
    launch whose splits meet in device memory and a second kernel."""
    K = 2048 if M > 64 else 1024
    weights = [qd.quantize(rng.standard_normal((K, K)).astype(np.float32) / np.sqrt(K), scheme, device="cuda")
               for _ in range(6)]
    x0 = rng.standard_normal((M, K)).astype(np.float32)
    y = qd.tensor(x0, device="cuda", dtype="bfloat16")
    for _ in range(3):
        for w in weights:
            y = qd.q_matmul(y, w.T, out_dtype="bfloat16")  # the previous y is freed here
    got = y.numpy().astype(np.float32)
    want = qd.tensor(x0, device="reference", dtype="bfloat16")
    for _ in range(3):
        for w in weights:
            want = qd.q_matmul(want, ref(w).T, out_dtype="bfloat16")
    assert rel_err(want.numpy().astype(np.float32), got) < 2e-2  # 18 bf16 roundings


def test_fq_sees_a_torch_write_just_before(rng):
    """A torch kernel writing x right before the decode kernel on the same stream."""
    torch = pytest.importorskip("torch")
    K, N = 2048, 4096
    wq = qd.quantize(rng.standard_normal((N, K)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cuda")
    xt = torch.zeros(1, K, device="cuda", dtype=torch.bfloat16)
    x = qd.from_dlpack(xt)
    qd.q_matmul(x, wq.T)  # the weights' tiles are laid out
    for step in range(1, 6):
        xt.fill_(step)  # a torch kernel, then ours
        got = qd.q_matmul(x, wq.T, out_dtype="bfloat16").numpy().astype(np.float32)
        want = qd.q_matmul(qd.tensor(np.full((1, K), step, np.float32), device="reference"), ref(wq).T).numpy()
        assert rel_err(want, got) < 4e-3


def test_qf_arm(rng):
    wq = qd.quantize(rng.standard_normal((16, 64)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cuda")
    x = rng.standard_normal((64, 3)).astype(np.float32)
    out = qd.q_matmul(wq, qd.tensor(x, device="cuda"))
    expect = qd.q_matmul(ref(wq), qd.tensor(x, device="reference"))
    assert rel_err(expect.numpy(), out.numpy()) < FQ_TOL


# ---- data movement and dispatch ------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "int32"])
def test_tensor_round_trip(rng, dtype):
    data = rng.standard_normal((7, 5)) * 10
    if dtype == "int32":  # an integer dtype takes whole numbers only
        data = np.rint(data) * 1000
    t = qd.tensor(data.astype(np.int8 if dtype == "int8" else np.float32), device="cpu",
                  dtype=dtype)
    back = t.to("cuda").to("cpu")
    assert back.dtype == dtype
    np.testing.assert_array_equal(back.numpy(), t.numpy())


@pytest.mark.parametrize("dtype", ["int8", "float16", "float32"])
def test_transpose_of_more_row_tiles_than_a_grid_holds(dtype):
    """.T of a matrix of more than 65535 tiles of 32 rows: the grid's y dimension
    stops there, and the launch used to fail with a KernelError."""
    rows = 65535 * 32 + 37
    a = (np.arange(rows * 3) % 251 - 125).astype(dtype).reshape(rows, 3)
    np.testing.assert_array_equal(qd.tensor(a, device="cuda").T.numpy(), a.T)


@pytest.mark.parametrize("scheme", [qd.QuantScheme("q8s", block=32), qd.QuantScheme("q4f", block=32, store="packed_u32")],
                         ids=repr)
def test_qtensor_reference_cpu_cuda_cpu(rng, scheme):
    q0 = qd.quantize(rng.standard_normal((24, 96)).astype(np.float32), scheme, device="reference")
    q3 = q0.to("cpu").to("cuda").to("cpu")
    np.testing.assert_array_equal(q3.values, q0.values)
    np.testing.assert_array_equal(q3.scales, q0.scales)
    np.testing.assert_array_equal(q0.to("cuda").T.values, q0.T.values)


def test_mixed_backends_raise(rng):
    xq = qd.quantize(rng.standard_normal((4, 32)).astype(np.float32), "q8s", device="cuda")
    wq = qd.quantize(rng.standard_normal((32, 8)).astype(np.float32), "q8s", device="cpu")
    with pytest.raises(qd.BackendMismatchError, match="cuda:0"):
        qd.q_matmul(xq, wq)
    out = qd.q_matmul(xq, wq, transfer="to_lhs")
    assert out.device == "cuda:0"


def test_two_gpus_device_mismatch(rng):
    if get_backend("cuda").device_count() < 2:
        pytest.skip("needs two GPUs")
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w = rng.standard_normal((64, 8)).astype(np.float32)
    q0, q1 = qd.quantize(x, "q8s", device="cuda:0"), qd.quantize(w, "q8s", device="cuda:1")
    with pytest.raises(qd.DeviceMismatchError):
        qd.q_matmul(q0, q1)
    out = qd.q_matmul(q0, q1.to("cuda:0")).numpy()
    assert rel_err(qd.q_matmul(ref(q0), ref(q1)).numpy(), out) < QQ_TOL
    on1 = qd.q_matmul(q0.to("cuda:1"), q1)
    assert on1.device == "cuda:1"
    np.testing.assert_array_equal(on1.numpy(), out)
    # The decode kernel plans per device and keeps split-K scratch per device: both in turn.
    xs = rng.standard_normal((16, 4096)).astype(np.float32)
    w0 = qd.quantize(rng.standard_normal((600, 4096)).astype(np.float32),
                     qd.QuantScheme("q4s", block=128, store="packed_u32"), device="cuda:0")
    w1 = w0.to("cuda:1")
    d0 = qd.q_matmul(qd.tensor(xs, device="cuda:0", dtype="bfloat16"), w0.T, out_dtype="float32")
    d1 = qd.q_matmul(qd.tensor(xs, device="cuda:1", dtype="bfloat16"), w1.T, out_dtype="float32")
    assert d1.device == "cuda:1"
    np.testing.assert_array_equal(d0.numpy(), d1.numpy())
    expect = qd.q_matmul(qd.tensor(xs, device="reference", dtype="bfloat16"), ref(w0).T).numpy()
    assert rel_err(expect, d1.numpy()) < FQ_TOL
    # The one launch for many rows caches its cluster fits per device: clusters (64 rows)
    # and splits through device memory (130 rows of 2048 x 2048), each GPU in turn.
    for M, K in [(64, 4096), (130, 2048)]:
        x = rng.standard_normal((M, K)).astype(np.float32)
        w0 = qd.quantize(rng.standard_normal((K, K)).astype(np.float32), qd.QuantScheme("q8s", axis=0),
                         device="cuda:0")
        w1 = w0.to("cuda:1")
        runs = [qd.q_matmul(qd.tensor(x, device=dev, dtype="bfloat16"), w.T, out_dtype="float32")
                for dev, w in (("cuda:1", w1), ("cuda:0", w0), ("cuda:1", w1))]
        assert [r.device for r in runs] == ["cuda:1", "cuda:0", "cuda:1"]
        for r in runs[1:]:
            np.testing.assert_array_equal(r.numpy(), runs[0].numpy())
        expect = qd.q_matmul(qd.tensor(x, device="reference", dtype="bfloat16"), ref(w0).T).numpy()
        assert rel_err(expect, runs[0].numpy()) < FQ_TOL


def test_out_of_memory_is_recoverable():
    from qdispatch import _cuda
    with pytest.raises(MemoryError, match="out of memory") as info:
        _cuda.empty((1 << 46,), "int8", 0)  # 64 TiB
    assert isinstance(info.value, qd.KernelError)
    a = np.ones((3, 40), np.int8)
    out = qd.int_matmul(qd.tensor(a, device="cuda"), qd.tensor(a.T.copy(), device="cuda"))
    assert (out.numpy() == 40).all()


def test_synchronize_waits_for_queued_work(rng):
    a = cuda_rng_int8(rng, (512, 4096))
    out = qd.int_matmul(qd.tensor(a, device="cuda"), qd.tensor(a.T.copy(), device="cuda"))
    assert qd.synchronize() is None and qd.synchronize("cuda:0") is None
    np.testing.assert_array_equal(out.numpy(), a.astype(np.int64) @ a.T.astype(np.int64))
    missing = len(qd.info()["backends"]["cuda"]["devices"])
    with pytest.raises(qd.BackendUnavailableError, match=f"no cuda:{missing}"):
        qd.synchronize(f"cuda:{missing}")


def test_freed_memory_is_cached_until_empty_cache():
    qd.empty_cache()
    before = qd.memory_info("cuda:0")
    assert before["cached"] == 0 and 0 < before["free"] <= before["total"]
    t = qd.tensor(np.ones((1 << 20,), np.float32), device="cuda")  # 4 MiB
    del t
    assert qd.memory_info("cuda")["cached"] >= 4 << 20
    again = qd.tensor(np.full((1 << 20,), 2, np.float32), device="cuda")  # reuses the block
    assert qd.memory_info("cuda")["cached"] < 4 << 20
    del again
    qd.empty_cache("cuda:0")
    assert qd.memory_info("cuda:0")["cached"] == 0
    out = qd.int_matmul(qd.tensor(np.ones((2, 8), np.int8), device="cuda"),
                        qd.tensor(np.ones((8, 3), np.int8), device="cuda"))
    assert (out.numpy() == 8).all()  # allocation goes on after the cache is emptied


def test_empty_cache_gives_back_what_the_pool_keeps_of_temporaries(rng):
    """The kernels' temporaries come from the device's stream-ordered pool, which
    keeps what is freed up to its release threshold; libraries such as CuPy raise
    it.  empty_cache (and an out-of-memory retry) trims the pool too."""
    import ctypes
    from qdispatch import _cuda
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        pytest.skip("needs the driver library libcuda.so.1 to raise the pool's threshold")
    device, pool = ctypes.c_int(), ctypes.c_void_p()
    assert libcuda.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert libcuda.cuDeviceGetDefaultMemPool(ctypes.byref(pool), device) == 0
    RELEASE_THRESHOLD = 4  # CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
    assert libcuda.cuMemPoolSetAttribute(pool, RELEASE_THRESHOLD, ctypes.byref(ctypes.c_uint64(1 << 62))) == 0
    try:
        # blocks of 16 along K: both operands spread to whole tensor-core steps in temporaries
        xq = qd.quantize(rng.standard_normal((256, 4096)).astype(np.float32), qd.QuantScheme("q8s", axis=0),
                         device="cuda")
        wq = qd.quantize(rng.standard_normal((512, 4096)).astype(np.float32), qd.QuantScheme("q8s", block=16),
                         device="cuda")
        out = qd.q_matmul(xq, wq.T).numpy()  # waits for the kernels: the temporaries are freed
        assert _cuda.pool_reserved_bytes(0) >= (256 + 512) * 4096 * 2  # each piece of 16 in 32 bytes
        qd.empty_cache()
        assert _cuda.pool_reserved_bytes(0) == 0
        np.testing.assert_array_equal(out, qd.q_matmul(ref(xq), ref(wq).T).numpy())
    finally:
        libcuda.cuMemPoolSetAttribute(pool, RELEASE_THRESHOLD, ctypes.byref(ctypes.c_uint64(0)))


def test_a_block_past_the_cache_freed_inside_a_torch_capture_goes_back(tmp_path):
    """A block the cache can't keep is given to the driver at once.  Freed while torch
    captured a graph, the free (unasked for in that mode) broke the capture, and the
    8 GiB were lost; now the capture holds, and the block goes back."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or qd.memory_info("cuda:0")["free"] < 12 << 30:
        pytest.skip("needs torch with CUDA and 12 GiB free")
    from helpers import run_python
    script = tmp_path / "free_in_capture.py"
    script.write_text(FREE_IN_A_CAPTURE)
    out = run_python(str(script))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split() == ["replayed", "back"], out.stdout


FREE_IN_A_CAPTURE = """
import numpy as np, torch, qdispatch as qd
from qdispatch import _cuda
big = _cuda.empty(((8 << 30) + (64 << 20),), "int8", 0)  # device memory past the cache's 8 GiB
a = torch.randn(4096, device="cuda")
b = torch.empty_like(a)
torch.cuda.synchronize()
free = torch.cuda.mem_get_info()[0]
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    b.copy_(a * 2)
    del big
g.replay()
torch.cuda.synchronize()
print("replayed" if torch.equal(b, a * 2) else "other values")
qd.empty_cache()
print("back" if torch.cuda.mem_get_info()[0] >= free + (7 << 30) else "lost")  # torch's graph pool took some
"""


def test_numpy_view_of_cuda_tensor_is_refused():
    t = qd.tensor(np.ones(3, np.float32), device="cuda")
    with pytest.raises(qd.WrongBackendError):
        np.asarray(t)
    np.testing.assert_array_equal(t.numpy(), np.ones(3, np.float32))


# ---- DLPack --------------------------------------------------------------------

def test_dlpack_torch_zero_copy():
    torch = pytest.importorskip("torch")
    src = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    t = qd.from_dlpack(src)
    assert t.device == "cuda:0" and t.shape == (3, 4) and t.dtype == "float32"
    assert t.payload.ptr == src.data_ptr()  # the same memory
    src.add_(1)
    np.testing.assert_array_equal(t.numpy(), src.cpu().numpy())
    back = torch.from_dlpack(t)
    assert back.data_ptr() == src.data_ptr()
    rows = torch.from_dlpack(t[1:3])  # a view exports as a view: row 1 on
    assert rows.data_ptr() == src.data_ptr() + 4 * 4 and torch.equal(rows, src[1:3])
    bf = torch.randn(5, 7, device="cuda").to(torch.bfloat16)
    np.testing.assert_array_equal(qd.from_dlpack(bf).numpy(), bf.float().cpu().numpy())


class _Producer:
    """A DLPack producer that is not a torch.Tensor (as a CuPy array is not): it takes
    the protocol's path, not qdispatch.torch's."""

    def __init__(self, t):
        self.t = t

    def __dlpack__(self, stream=None, **_):
        return self.t.__dlpack__(stream=stream)

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


def test_empty_cuda_tensors_cross_and_convert():
    """torch gives an empty CUDA tensor no address: converting its view failed ("cast
    rejected its arguments"), and the protocol's path took a dense empty array for a
    strided one."""
    torch = pytest.importorskip("torch")
    for shape in [(0,), (0, 8), (3, 0), (2, 0, 5)]:
        for src, dst in [(torch.float16, "float32"), (torch.float32, "bfloat16"), (torch.bfloat16, "float16")]:
            x = torch.empty(shape, dtype=src, device="cuda")
            for got in (qd.tensor(x, dtype=dst), qd.from_dlpack(_Producer(x)).to("cuda:0")):
                assert (got.shape, got.device) == (shape, "cuda:0")
                assert got.numpy().shape == shape
            assert qd.tensor(x, dtype=dst).dtype == dst


def test_torch_cuda_tensors_of_other_dtypes_convert_as_host_data():
    """from_torch converts a dtype qdispatch does not hold as qdispatch.tensor converts
    numpy data; a CUDA tensor raised "unsupported dtype (code 2, 64 bits)" instead.
    Other producers' such tensors are refused by name."""
    torch = pytest.importorskip("torch")
    from qdispatch.torch import from_torch
    data = (np.arange(12, dtype=np.float64).reshape(3, 4) - 5) / 8
    ints = np.array([[-3, 0, 100]], np.int64)
    for host in (data, ints):
        want = qd.tensor(host, device="reference")
        for make in (qd.tensor, qd.from_dlpack, from_torch):
            got = make(torch.from_numpy(host).cuda())
            assert (got.dtype, got.device) == (want.dtype, "cuda:0")
            np.testing.assert_array_equal(got.numpy(), want.numpy())
    np.testing.assert_array_equal(qd.quantize(torch.from_numpy(data).cuda(), "q8s").dequantize().numpy(),
                                  qd.quantize(data, "q8s", device="reference").dequantize().numpy())
    with pytest.raises(qd.NonFiniteError, match=r"position \(1,\)"):
        qd.tensor(torch.tensor([1.0, 1e39], dtype=torch.float64, device="cuda"))
    for dtype, name in ((torch.float64, "float64"), (torch.int64, "int64"), (torch.uint8, "uint8")):
        with pytest.raises(TypeError, match=f"a CUDA tensor of {name} data; qdispatch's CUDA tensors hold "
                                            f"float32, float16, bfloat16, int8 or int32"):
            qd.from_dlpack(_Producer(torch.zeros(3, dtype=dtype, device="cuda")))
    if hasattr(torch, "uint32"):  # uint32 words are a QTensor's packed store, no Tensor's dtype
        with pytest.raises(TypeError, match="a CUDA tensor of uint32 data"):
            qd.from_dlpack(_Producer(torch.zeros(3, dtype=torch.uint32, device="cuda")))


def test_int_matmul_of_views_off_16_byte_bounds(rng):
    """A view starting off a 16-byte bound (t[1:33] of an int8 vector, a torch view at
    an odd offset) went to the GEMM as it was, which refused it."""
    torch = pytest.importorskip("torch")
    for K, N in [(32, 24), (64, 130)]:
        b = cuda_rng_int8(rng, (K, N))
        v = cuda_rng_int8(rng, (K + 16,))
        dv, db = qd.tensor(v, device="cuda"), qd.tensor(b, device="cuda")
        for off in (1, 3, 8, 16):
            np.testing.assert_array_equal(qd.int_matmul(dv[off:off + K], db).numpy(),
                                          v[off:off + K].astype(np.int64) @ b.astype(np.int64))
    a = cuda_rng_int8(rng, (8, 32))
    b = cuda_rng_int8(rng, (32, 24))
    base = torch.zeros(8 * 32 + 64, dtype=torch.int8, device="cuda")
    for off in (1, 5):
        view = base[off:off + 8 * 32].view(8, 32)
        view.copy_(torch.from_numpy(a).cuda())
        np.testing.assert_array_equal(qd.int_matmul(qd.from_dlpack(view), qd.tensor(b, device="cuda")).numpy(),
                                      a.astype(np.int64) @ b.astype(np.int64))


def test_dlpack_export_to_the_cpu_is_a_host_copy():
    """Asked for the CPU (dl_device=(1, 0), as numpy's from_dlpack(x, device="cpu")
    asks), the export gave CUDA memory."""
    t = qd.tensor(np.arange(6, dtype=np.float32).reshape(2, 3), device="cuda")

    class Host:
        def __dlpack__(self, **_):
            return t.__dlpack__(dl_device=(1, 0))

        def __dlpack_device__(self):
            return (1, 0)
    np.testing.assert_array_equal(np.from_dlpack(Host()), np.arange(6, dtype=np.float32).reshape(2, 3))
    with pytest.raises(BufferError, match="reaches the CPU by a copy only"):
        t.__dlpack__(dl_device=(1, 0), copy=False)
    with pytest.raises(BufferError, match=r"to DLPack device \(2, 7\): move it there first"):
        t.__dlpack__(dl_device=(2, 7))
    t.__dlpack__(dl_device=(2, 0))  # its own device: as without


def test_dlpack_out_on_torch_side_stream(rng):
    torch = pytest.importorskip("torch")
    x = rng.standard_normal((64, 256)).astype(np.float32)
    wq = qd.quantize(rng.standard_normal((128, 256)).astype(np.float32), qd.QuantScheme("q8s", axis=0), device="cuda")
    out = qd.q_matmul(qd.tensor(x, device="cuda"), wq.T)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        tt = torch.from_dlpack(out)  # waits for our stream on `stream`
        doubled = tt * 2
    stream.synchronize()
    np.testing.assert_allclose(doubled.cpu().numpy(), out.numpy() * 2)
    # and in: a torch tensor used directly as the float operand
    xt = torch.from_numpy(x).cuda()
    out2 = qd.q_matmul(qd.from_dlpack(xt), wq.T)
    np.testing.assert_array_equal(out2.numpy(), out.numpy())


# A kernel that holds its stream for `cycles` clock ticks: work queued after it runs late.
_SPIN = r"""extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}"""


def test_dlpack_cupy_zero_copy(rng):
    cp = pytest.importorskip("cupy")
    src = cp.arange(12, dtype=cp.float32).reshape(3, 4)
    t = qd.from_dlpack(src)
    assert t.device == "cuda:0" and t.shape == (3, 4) and t.dtype == "float32"
    assert t.payload.ptr == src.data.ptr  # the same memory
    src += 1
    np.testing.assert_array_equal(t.numpy(), cp.asnumpy(src))
    back = cp.from_dlpack(t)
    assert back.data.ptr == src.data.ptr and back.dtype == cp.float32
    for dtype in (np.float16, np.int8):
        a = cp.asarray(rng.integers(-100, 100, (5, 7)).astype(dtype))
        np.testing.assert_array_equal(qd.from_dlpack(a).numpy(), cp.asnumpy(a))
    wq = qd.quantize(rng.standard_normal((128, 256)).astype(np.float32), qd.QuantScheme("q8s", axis=0),
                     device="cuda")
    x = rng.standard_normal((4, 256)).astype(np.float32)
    out = qd.q_matmul(qd.from_dlpack(cp.asarray(x)), wq.T)
    np.testing.assert_array_equal(out.numpy(), qd.q_matmul(qd.tensor(x, device="cuda"), wq.T).numpy())
    np.testing.assert_array_equal(cp.asnumpy(cp.from_dlpack(out)), out.numpy())


@pytest.mark.parametrize("stream", ["non_blocking", "null", "ptds"])
def test_dlpack_cupy_stream_contract(rng, stream):
    """x written on CuPy's current stream after a long spin there: our kernel waits
    for the write, and CuPy's read of the product waits for our kernel."""
    cp = pytest.importorskip("cupy")
    spin = cp.RawKernel(_SPIN, "spin")
    wq = qd.quantize(rng.standard_normal((128, 256)).astype(np.float32), qd.QuantScheme("q8s", axis=0),
                     device="cuda")
    x_host = rng.standard_normal((4, 256)).astype(np.float32)
    want = qd.q_matmul(qd.tensor(x_host, device="cuda"), wq.T).numpy()
    s = {"non_blocking": lambda: cp.cuda.Stream(non_blocking=True), "null": lambda: cp.cuda.Stream.null,
         "ptds": lambda: cp.cuda.Stream.ptds}[stream]()
    x_dev = cp.asarray(x_host)
    cp.cuda.Device().synchronize()
    with s:
        x = cp.zeros((4, 256), cp.float32)
        spin((1,), (1,), (cp.int64(50_000_000),))  # about 25 ms on `s`
        x[...] = x_dev  # the write, after the spin
        out = qd.q_matmul(qd.from_dlpack(x), wq.T)
        y = cp.from_dlpack(out) * 1  # the read, on `s`
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(y), want)


def test_cupy_input_freed_on_its_stream_waits_for_our_kernel(rng):
    """x made on a CuPy stream and freed right after the call: CuPy's pool must not
    give its memory to the next array on that stream while our kernel, queued behind
    a long spin on our stream, has yet to read x; afterwards it does go back."""
    cp = pytest.importorskip("cupy")
    spin = cp.RawKernel(_SPIN, "spin")
    wq = qd.quantize(rng.standard_normal((128, 256)).astype(np.float32), qd.QuantScheme("q8s", axis=0),
                     device="cuda")
    want = qd.q_matmul(qd.tensor(np.ones((8, 256), np.float32), device="cuda"), wq.T).numpy()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.ones((8, 256), cp.float32)
    spin((1,), (1,), (cp.int64(50_000_000),))  # about 25 ms on the legacy default stream, ours
    with s:
        out = qd.q_matmul(qd.from_dlpack(x), wq.T)
        del x
        cp.full((8, 256), 7, cp.float32)  # a write that would take x's block at once
    np.testing.assert_array_equal(out.numpy(), want)
    qd.synchronize("cuda:0")
    from qdispatch import _cuda
    assert _cuda.lent_count() == 0  # x went back to CuPy


def test_cuda_graph_capture_is_refused_and_left_intact(rng):
    """Only qdispatch.torch's products run on torch's capturing stream (see
    test_torch_interop).  Inside torch.cuda.graph the crossings (a wait between
    torch's capturing stream and ours) would invalidate the capture, and a call on
    qdispatch tensors alone would run at once, outside the graph: they raise first
    and leave the capture as it was."""
    torch = pytest.importorskip("torch")
    from qdispatch.torch import from_torch, q_matmul
    wq = qd.quantize(rng.standard_normal((64, 32)).astype(np.float32), qd.QuantScheme("q8s", axis=1), device="cuda")
    x = torch.randn(4, 64, device="cuda")
    want = q_matmul(x, wq)
    out = qd.from_dlpack(want)
    xq = qd.tensor(x.cpu().numpy(), device="cuda")
    graph, doubled = torch.cuda.CUDAGraph(), torch.empty_like(x)
    for call, says in ((lambda: qd.q_matmul(xq, wq),    # qdispatch tensors alone: would run eagerly
                        "would run now, outside the graph.*qdispatch.torch"),
                       (lambda: from_torch(x),         # a torch tensor in by its pointer
                        "capturing a CUDA graph.*outside the captured region"),
                       (lambda: qd.from_dlpack(x),     # a torch tensor in by DLPack
                        "capturing a CUDA graph.*outside the captured region"),
                       (lambda: torch.from_dlpack(out),  # out
                        "capturing a CUDA graph.*outside the captured region")):
        with pytest.raises(qd.KernelError, match=says):
            with torch.cuda.graph(graph):
                doubled.copy_(x * 2)
                call()
        doubled.zero_()
        graph.replay()  # the capture ended cleanly: what torch recorded runs
        torch.testing.assert_close(doubled, x * 2)
        graph.reset()
    torch.testing.assert_close(q_matmul(x, wq), want, rtol=0, atol=0)  # and qdispatch goes on


@pytest.mark.cuda
@pytest.mark.parametrize("value,block,K", [("q8s", 16, 32), ("q8s", 16, 96), ("q4f", 32, 32),
                                           ("q4f", 32, 96), ("q2f", 64, 192)])
def test_fq_padded_chunks_past_k_stay_finite(rng, value, block, K):
    """Rows are zero padded past K; the padding must never pick up a scale from
    beyond the last row's scale grid (a NaN there turned 0 * scale into NaN)."""
    store = "native" if value == "q8s" else "packed_u32"
    scheme = qd.QuantScheme(value, block=block, store=store)
    w = rng.standard_normal((1, K)).astype(np.float32)
    x = rng.standard_normal((3, K)).astype(np.float32)
    for _ in range(3):  # fresh allocations each time, whatever lies past them
        got = qd.q_matmul(x, qd.quantize(w, scheme, device="cuda").T).numpy()
        want = qd.q_matmul(x, qd.quantize(w, scheme, device="reference").T).numpy()
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_save_and_gguf_export_fetch_gpu_tensors(tmp_path, rng):
    """qd.save and gguf export fetch GPU tensors one at a time; what they wrote
    loads back onto the GPU bit for bit."""
    x = rng.standard_normal((64, 256)).astype(np.float32)
    q8 = qd.quantize(x, qd.QuantScheme("q8s", block=32, scale_dtype="f16"), device="cuda")
    q4 = qd.quantize(x, qd.QuantScheme("q4s", axis=0, store="packed_u32"), device="cuda")
    half = qd.tensor(x, device="cuda", dtype="bfloat16")
    qd.save(tmp_path / "m.st", {"q8": q8, "q4t": q4.T, "half": half})
    back = qd.load(tmp_path / "m.st", device="cuda")
    for name, want in (("q8", q8), ("q4t", q4.T)):
        got = back[name]
        assert got.device == "cuda:0" and got.shape == want.shape and got.scheme == want.scheme
        np.testing.assert_array_equal(got.dequantize().numpy(), ref(want).dequantize().numpy())
    np.testing.assert_array_equal(back["half"].numpy(), half.numpy())

    gguf = pytest.importorskip("gguf")
    from qdispatch import gguf as qgguf
    qgguf.export(tmp_path / "m.gguf", {"q8": q8, "half": half})
    stored = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}
    np.testing.assert_array_equal(gguf.quants.dequantize(stored["q8"].data, stored["q8"].tensor_type),
                                  ref(q8).dequantize().numpy())
    np.testing.assert_array_equal(qgguf.load(tmp_path / "m.gguf", device="cuda")["q8"].dequantize().numpy(),
                                  ref(q8).dequantize().numpy())


def test_save_of_a_decode_weight_beside_its_transpose(tmp_path, rng):
    """A decode weight whose store the kernel's tiles replaced, saved with its .T: one
    store is written (read back from the tiles), and load on the GPU gives the weight
    and its transpose over one store, with the reference's values."""
    x = rng.standard_normal((96, 128)).astype(np.float32)
    w = qd.quantize(x, qd.QuantScheme("q4s", block=32, store="packed_u32"), device="cuda")
    want = ref(w)
    qd.q_matmul(qd.tensor(rng.standard_normal((2, 128)).astype(np.float32), device="cuda"), w.T)  # lays out the tiles
    path = tmp_path / "w.st"
    qd.save(path, {"w": w, "wt": w.T})
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert sorted(k for k in header if k != "__metadata__") == ["w.qscales", "w.qvalues"]
    back = qd.load(path, device="cuda")
    assert back["wt"].storage is back["w"].storage and back["wt"].transposed and back["w"].device == "cuda:0"
    for name, expected in (("w", want), ("wt", want.T)):
        np.testing.assert_array_equal(back[name].values, expected.values)
        np.testing.assert_array_equal(back[name].dequantize().numpy(), expected.dequantize().numpy())


CUDA_IN_A_FORKED_WORKER = """
import multiprocessing as mp, sys
import numpy as np, qdispatch as qd

x = np.arange(256, dtype=np.float32).reshape(4, 64)
used = sys.argv[1] == "used"
if used:
    w = qd.quantize(x, "q8s", device="cuda")  # the parent uses the GPU
    qd.tensor(x, device="cuda")  # freed at once: its block stays in the parent's cache
elif sys.argv[1] == "asked":
    assert "cuda" in qd.available_backends()  # asks CUDA for its devices, which starts it
elif sys.argv[1] == "torch":
    import torch
    torch.zeros(1, device="cuda")  # another library starts CUDA; qdispatch never did
else:
    qd.quantize(x, "q8s")  # on the host: CUDA never started


def work(_):
    qd.empty_cache()  # the parent's cached blocks are not the child's to free: nothing to do
    try:
        got = qd.quantize(x, "q8s", device="cuda").dequantize().numpy()
    except qd.QDispatchError as exc:
        return type(exc).__name__, str(exc), "cuda" in qd.available_backends()
    try:
        w.dequantize()  # the parent's GPU memory
    except qd.QDispatchError as exc:
        return type(exc).__name__, str(exc), "cuda" in qd.available_backends()
    except NameError:
        pass
    return "same" if np.array_equal(got, qd.quantize(x, "q8s").dequantize().numpy()) else "other", "", True


if __name__ == "__main__":
    with mp.get_context("fork").Pool(1) as pool:
        print(repr(pool.map_async(work, [0]).get(timeout=120)[0]))
    if used:  # the parent keeps its GPU
        np.testing.assert_array_equal(w.dequantize().numpy(), qd.quantize(x, "q8s").dequantize().numpy())
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_worker_forked_after_the_parent_used_the_gpu_refuses_it_up_front(tmp_path):
    """CUDA does not survive fork: a worker forked after its parent started CUDA (used
    the GPU, only asked for its devices, or let torch start it: that said "install the
    NVIDIA driver") gets BackendUnavailableError saying to
    start GPU workers by 'spawn', before any CUDA call (which would fail, or wait
    forever), and cuda is not among its backends; the parent keeps its GPU.  A parent
    that never started CUDA leaves its workers the GPU."""
    import ast
    from helpers import run_python
    script = tmp_path / "cuda_in_a_forked_worker.py"
    script.write_text(CUDA_IN_A_FORKED_WORKER)
    try:
        import torch
        torch_cuda = ["torch"] if torch.cuda.is_available() else []
    except ImportError:
        torch_cuda = []
    for parent in ["used", "asked"] + torch_cuda:
        out = run_python(str(script), parent)
        assert out.returncode == 0, out.stderr
        kind, message, listed = ast.literal_eval(out.stdout.strip())
        assert kind == "BackendUnavailableError" and not listed, out.stdout
        assert message.startswith("The cuda backend is unavailable in this process: this process was forked from "
                                  "one that had started CUDA") and "'spawn'" in message, message
    out = run_python(str(script), "host")
    assert out.returncode == 0, out.stderr
    assert ast.literal_eval(out.stdout.strip()) == ("same", "", True), out.stdout
