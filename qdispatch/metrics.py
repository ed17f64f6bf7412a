"""How close an approximation is to its float reference: the figures a scheme is
chosen by (signal-to-quantization-noise ratio, relative error, cosine similarity and
the worst element), computed in float64 on the host."""
import math
import sys
from dataclasses import dataclass

import numpy as np

from ._core import QTensor, Tensor
from .errors import ArgumentTypeError, NonFiniteError, ShapeError
from .tensor_api import from_dlpack, numpy_of


@dataclass(frozen=True)
class ErrorReport:
    """What `error_report(reference, approx)` measured.

    sqnr_db: 10 log10(sum(reference^2) / sum((approx - reference)^2)); inf when they agree.
    relative_error: ||approx - reference|| / ||reference|| (Frobenius norms).
    cosine: the cosine of the angle between the two, flattened; 1 for two all-zero arrays.
    max_abs_error: the largest |approx - reference| of any element.
    size: how many elements were compared."""
    sqnr_db: float
    relative_error: float
    cosine: float
    max_abs_error: float
    size: int

    def __str__(self):
        return (f"SQNR {self.sqnr_db:.2f} dB, relative error {self.relative_error:.3e}, cosine {self.cosine:.6f}, "
                f"max abs error {self.max_abs_error:.3e} over {self.size} values")


def error_report(reference, approx):
    """Compare `approx` with `reference`, element by element, in float64.

    Either may be a numpy array (or anything numpy reads), a Tensor on any device, a
    torch tensor, or a QTensor, which is compared by its dequantized values: so
    `error_report(w, qd.quantize(w, scheme))` is the scheme's round-trip error on w, and
    `error_report(x @ w.T, qd.linear(x, qw))` a layer's.  The two must have the same
    shape and hold only finite numbers."""
    want = _float64_values(reference, "reference")
    got = _float64_values(approx, "approx")
    if want.shape != got.shape:
        raise ShapeError(f"error_report compares arrays of one shape, got reference {want.shape} and approx "
                         f"{got.shape}: pass the approximation of exactly the reference's values")
    if want.size == 0:
        raise ShapeError(f"error_report has nothing to compare: both arrays are empty (shape {want.shape})")
    with np.errstate(over="ignore"):
        diff = got - want
    # a difference past float64's range is taken at half size (its max_abs_error is inf)
    diff_scale = 1.0 if np.isfinite(diff).all() else 2.0
    if diff_scale != 1:
        diff = got * 0.5 - want * 0.5
    max_abs_error = float(np.max(np.abs(diff))) * diff_scale
    # Each norm as its largest element times the root of a sum of squares of at most 1:
    # no square overflows or underflows on the way, whatever the values' size.
    (noise_max, noise_sum), (signal_max, signal_sum) = _norm_parts(diff), _norm_parts(want)
    return ErrorReport(
        sqnr_db=_ratio_db(signal_max, signal_sum, noise_max, noise_sum) - 20 * math.log10(diff_scale),
        relative_error=(noise_max / signal_max) * diff_scale * math.sqrt(noise_sum / signal_sum) if signal_max
        else (0.0 if noise_max == 0 else math.inf),
        cosine=_cosine(want.ravel(), got.ravel()),
        max_abs_error=max_abs_error,
        size=int(want.size),
    )


def _norm_parts(v):
    """(m, s) with ||v|| = m * sqrt(s): m the largest |v|, s the sum of (v / m)^2."""
    m = float(np.max(np.abs(v)))
    if m == 0:
        return 0.0, 0.0
    scaled = v.ravel() / m
    return m, float(np.dot(scaled, scaled))


def _ratio_db(signal_max, signal_sum, noise_max, noise_sum):
    """10 log10(||signal||^2 / ||noise||^2), in logs: the ratio itself may pass float64's range."""
    if noise_max == 0:
        return math.inf
    if signal_max == 0:
        return -math.inf
    return 20 * (math.log10(signal_max) - math.log10(noise_max)) + 10 * math.log10(signal_sum / noise_sum)


def _cosine(a, b):
    (a_max, a_sum), (b_max, b_sum) = _norm_parts(a), _norm_parts(b)
    if a_max == 0 or b_max == 0:  # an all-zero array agrees only with another
        return 1.0 if a_max == b_max else 0.0
    return min(1.0, max(-1.0, float(np.dot(a / a_max, b / b_max)) / math.sqrt(a_sum * b_sum)))


def _float64_values(obj, role):
    """obj's values as a float64 numpy array; `role` names it in errors."""
    given = type(obj).__name__
    torch = sys.modules.get("torch")
    if isinstance(obj, QTensor):
        obj = obj.dequantize()
    elif torch is not None and isinstance(obj, torch.Tensor):  # on any device: its values on the host
        obj = obj.detach().cpu().resolve_conj().resolve_neg()
        obj = (obj.double() if obj.is_floating_point() else obj).numpy()  # numpy lacks bfloat16 and float8
    elif not isinstance(obj, (Tensor, np.ndarray)) and hasattr(obj, "__dlpack__") \
            and hasattr(obj, "__dlpack_device__"):  # CuPy and others: read where it lives
        host = numpy_of(obj)
        obj = host if host is not None else from_dlpack(obj)
    if isinstance(obj, Tensor):
        arr = obj.numpy()  # a device's values come to the host; bfloat16 as float32
    else:
        try:
            arr = np.asarray(obj)
        except ValueError as exc:  # a ragged list
            raise ShapeError(f"error_report's {role} must be an array of numbers: {exc}") from None
    if arr.dtype.kind not in "iufb" and arr.dtype.name != "bfloat16":  # ml_dtypes' bfloat16 is kind V
        raise ArgumentTypeError(f"error_report's {role} must hold real numbers, got {arr.dtype} "
                                f"({given}): convert it to floats first")
    arr = arr.astype(np.float64)
    finite = np.isfinite(arr)
    if not finite.all():
        at = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise NonFiniteError(f"error_report's {role} holds {float(arr[at])} at position {at}: the error of a "
                             f"non-finite value has no size; find where it came from (an overflow to inf in "
                             f"float16 output, a NaN input) or compare the finite part")
    return arr
