"""The README's examples run as written, each where its optional extra is installed."""
import contextlib
import io
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "README.md")
pytestmark = pytest.mark.skipif(not os.path.exists(README), reason="README not beside the tests")


def python_blocks():
    if not os.path.exists(README):
        return []
    with open(README) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def needed_packages(block):
    needs = []
    if re.search(r"^import torch", block, flags=re.M):
        needs.append("torch")
    if "qd.save(" in block or "qd.load(" in block:
        needs.append("safetensors")
    if re.search(r"^import gguf", block, flags=re.M):
        needs.append("gguf")
    if re.search(r"^import onnxruntime", block, flags=re.M):
        needs += ["onnx", "onnxruntime"]
    return needs


def test_readme_has_the_tour_and_each_interop_section():
    blocks = python_blocks()
    assert any("except qd.BackendMismatchError as err:\n    print(err)" in b for b in blocks)
    assert any("qdispatch.torch" in b for b in blocks)
    assert any("qd.save(" in b for b in blocks)
    assert any("qdispatch.gguf" in b or "gguf" in b for b in blocks)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_block_runs(index, tmp_path, monkeypatch):
    block = python_blocks()[index]
    for package in needed_packages(block):
        pytest.importorskip(package)
    monkeypatch.chdir(tmp_path)  # some examples write files
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, f"README.md[python block {index}]", "exec"), {})
    if "except qd.BackendMismatchError as err:\n    print(err)" in block:  # the tour
        assert "q_matmul inputs are on different backends" in out.getvalue()
