"""Backends register their kernels into the dispatch table of `qdispatch._core`."""
