"""Float tensors: numpy memory sharing, DLPack, devices and reprs."""
import numpy as np
import pytest

import qdispatch as qd


def test_host_tensor_shares_memory_with_numpy(device):
    if device == "cuda":
        pytest.skip("device memory")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = qd.tensor(a, device=device)
    assert np.shares_memory(np.asarray(t), a)
    a[0, 0] = 42
    assert np.asarray(t)[0, 0] == 42


def test_dlpack_round_trip_without_copy():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = qd.from_dlpack(a)
    back = np.from_dlpack(t)
    assert np.shares_memory(back, a)
    np.testing.assert_array_equal(back, a)


def test_device_parsing_and_repr(rng):
    assert qd.Device.parse("cuda:1").index == 1 and str(qd.Device.parse("cuda")) == "cuda:0"
    assert qd.Device.parse("cpu") == "cpu" and repr(qd.Device.parse("cpu")) == "Device('cpu')"
    with pytest.raises(ValueError, match="Unknown device"):
        qd.Device.parse("gpu")
    with pytest.raises(ValueError, match="Bad device index"):
        qd.Device.parse("cuda:x")
    q = qd.quantize(rng.standard_normal((4, 64)).astype(np.float32), qd.QuantScheme("q8s", block=32),
                    device="reference")
    assert repr(q) == "QTensor(shape=(4, 64), scheme=QuantScheme('q8s', block=(32,)), device='reference', nbytes=288)"
    assert q.backend == "reference" and q.device.kind == qd.BackendKind.REFERENCE


def test_nbytes_counts_values_and_scales_in_their_dtype(rng):
    x = rng.standard_normal((64, 128)).astype(np.float32)
    assert qd.quantize(x, qd.QuantScheme("q8s", axis=0), device="reference").nbytes == 64 * 128 + 64 * 4
    q4 = qd.quantize(x, qd.QuantScheme("q4s", block=32, store="packed_u32", scale_dtype="f16"), device="reference")
    assert q4.nbytes == 64 * 128 // 2 + 64 * 4 * 2


def test_bfloat16_tensor_round_trip():
    x = np.array([[1.0, -2.5, 3.140625]], np.float32)
    t = qd.tensor(x, dtype="bfloat16", device="reference")
    assert t.dtype == "bfloat16"
    np.testing.assert_array_equal(t.numpy(), x)


def test_scales_shape_per_granularity(rng):
    x = rng.standard_normal((8, 64)).astype(np.float32)
    assert qd.quantize(x, "q8s", device="reference").scales.shape == ()
    assert qd.quantize(x, qd.QuantScheme("q8s", axis=0), device="reference").scales.shape == (8,)
    assert qd.quantize(x, qd.QuantScheme("q8s", block=32), device="reference").scales.shape == (8, 2)


def test_qtensor_from_parts_checks_the_range():
    with pytest.raises(qd.QDispatchError, match="outside q4s's range"):
        qd.qtensor_from_parts(np.full((2, 8), 8, np.int8), np.ones(()), qd.QuantScheme("q4s", store="packed_u32"))
    q = qd.qtensor_from_parts(np.full((2, 8), 7, np.int8), np.float32(0.5), qd.QuantScheme("q4s", store="packed_u32"))
    np.testing.assert_array_equal(q.dequantize().numpy(), 3.5)


def test_qtensor_says_it_has_no_gradient():
    q = qd.quantize(np.ones((2, 4), np.float32), "q8s", device="reference")
    assert q.requires_grad is False
    with pytest.raises(AttributeError, match="gradients flow to the float operand only"):
        q.grad


def test_host_bfloat16_refuses_a_dlpack_export_it_cannot_type():
    t = qd.tensor(np.ones((2, 2), np.float32), dtype="bfloat16", device="reference")
    with pytest.raises(TypeError, match="bfloat16"):
        np.from_dlpack(t)
