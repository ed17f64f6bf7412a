"""Find the CUDA toolkit and compile the `.cu` sources (filled in with the cuda backend)."""


def configure():
    """The CUDA build configuration, or None when the cuda backend is not built."""
    return None


def skipped_reason():
    """Why the cuda backend was not built (shown by `python -m qdispatch info`)."""
    return "the CUDA backend is not part of this build"
