"""Error measures shared by the tests."""
import numpy as np


def sqnr_db(reference, approx):
    reference = np.asarray(reference, dtype=np.float64)
    noise = reference - np.asarray(approx, dtype=np.float64)
    return 10 * np.log10(np.sum(reference ** 2) / max(np.sum(noise ** 2), 1e-300))


def rel_err(reference, approx):
    reference = np.asarray(reference, dtype=np.float64)
    return np.linalg.norm(reference - np.asarray(approx, dtype=np.float64)) / max(
        np.linalg.norm(reference), 1e-300)
