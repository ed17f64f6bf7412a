"""Choices that hold beyond one call: the transfer policy (per thread and asyncio task, a
context variable), and the process-wide default backend and batch invariance."""
import contextlib
import contextvars
import os
import threading

import numpy as np

from ._core import Device, get_backend
from .errors import ArgumentError, ArgumentTypeError, BackendUnavailableError
from .info import available_backends

TRANSFER_MODES = ("error", "to_lhs", "to_rhs", "auto")
_transfer = contextvars.ContextVar("qdispatch_transfer", default="error")
_default_device = None
# Held while the default is chosen or set: a thread's first default lookup must not
# overwrite a set_default_backend that ran while it was choosing.
_default_lock = threading.RLock()


def _check_mode(mode):
    if not isinstance(mode, str) or mode not in TRANSFER_MODES:  # `in` would compare an array elementwise
        raise ArgumentError(f"Unknown transfer policy {mode!r}: expected one of {', '.join(TRANSFER_MODES)}")
    return mode


def resolve(transfer):
    """The mode in force: the call's `transfer=` argument, else the context's."""
    return _check_mode(transfer) if transfer is not None else _transfer.get()


@contextlib.contextmanager
def transfer_policy(mode):
    """Within the block, operands on different devices are moved as `mode` says
    ('error', 'to_lhs', 'to_rhs' or 'auto') instead of raising.  It holds for this
    thread (or asyncio task), and what runs in a copy of its context
    (asyncio.to_thread); a threading.Thread started inside runs with the default, 'error'."""
    token = _transfer.set(_check_mode(mode))
    try:
        yield
    finally:
        _transfer.reset(token)


def set_default_backend(device):
    """Where `quantize` and `tensor` put host data when no device is given."""
    global _default_device
    dev = Device.parse(device)
    reason = get_backend(dev.kind).unavailable_reason(dev.index)
    if reason:
        raise BackendUnavailableError(reason)
    with _default_lock:
        _default_device = dev


def default_device():
    """Where quantize and tensor put host data when no device is given: the one
    set_default_backend named, else QDISPATCH_BACKEND, else 'cpu' ('reference' in a build without it)."""
    global _default_device
    dev = _default_device
    if dev is not None:
        return dev
    with _default_lock:
        if _default_device is None:
            env = os.environ.get("QDISPATCH_BACKEND")
            if env:
                _set_default_from_env(env)
            else:
                _default_device = _best_host()
        return _default_device


def _set_default_from_env(env):
    """set_default_backend(QDISPATCH_BACKEND), its errors naming the variable: they
    surface at some later call that never mentioned a backend."""
    try:
        set_default_backend(env)
    except (ValueError, BackendUnavailableError) as exc:
        raise type(exc)(f"QDISPATCH_BACKEND={env!r} can't be the default backend: {exc} (available here: "
                        f"{', '.join(available_backends())}; set the variable to one of them, or unset it)") from None


def default_host_device():
    """The default device when it is host memory, else the best host backend:
    where data lands that must live on the host."""
    dev = default_device()
    return dev if dev.is_host else _best_host()


def _best_host():
    """'cpu', or 'reference' in a build without it (a cpu backend built but unusable,
    through a bad QDISPATCH_ISA say, stays the default: its calls say why)."""
    return Device.parse("cpu" if get_backend("cpu").built else "reference")


def set_batch_invariant(on=True):
    """Make each row of a product come out the same, bit for bit, whatever batch it
    is in (off by default; `QDISPATCH_BATCH_INVARIANT=1` turns it on at import).

    The cpu backend always is.  Off, the cuda backend's decode kernels (float
    activations of up to 32 rows per launch times quantized weights) cut K the
    fastest way for each batch size, and the reference backend's float products go
    through numpy's BLAS, so a row's last bits may change with the rows it comes
    with.  On, the decode kernels take 16 rows per launch and cut K as for 16 rows
    whatever the batch, and many rows never go to the GEMM (which takes longer on
    large weights at few rows, and from 17 rows on), and the reference multiplies
    one row at a time.  Process-wide: every thread and GPU."""
    if not isinstance(on, (bool, np.bool_)):  # bool("false") is True
        raise ArgumentTypeError(f"set_batch_invariant takes True or False, got {on!r} ({type(on).__name__})")
    get_backend("cuda").set_batch_invariant(bool(on))


def batch_invariant():
    """Whether set_batch_invariant is on."""
    return get_backend("cuda").batch_invariant()
