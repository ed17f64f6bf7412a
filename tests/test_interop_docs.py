"""The examples of docs/interop.md run as written (each where its extra is installed)."""
import os
import re

import pytest

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "interop.md")


def python_blocks():
    with open(DOC) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def needed_packages(block):
    needs = []
    if re.search(r"^import torch", block, flags=re.M):
        needs.append("torch")
    if "qd.save(" in block or "qd.load(" in block:
        needs.append("safetensors")
    if re.search(r"^import gguf", block, flags=re.M):
        needs.append("gguf")
    return needs


@pytest.mark.skipif(not os.path.exists(DOC), reason="docs/interop.md not beside the tests")
def test_doc_has_examples_for_each_section():
    assert len(python_blocks()) >= 4


@pytest.mark.skipif(not os.path.exists(DOC), reason="docs/interop.md not beside the tests")
@pytest.mark.parametrize("index", range(len(python_blocks()) if os.path.exists(DOC) else 0))
def test_doc_block_runs(index, tmp_path, monkeypatch):
    block = python_blocks()[index]
    for package in needed_packages(block):
        pytest.importorskip(package)
    monkeypatch.chdir(tmp_path)  # the examples write files
    exec(compile(block, f"docs/interop.md[block {index}]", "exec"), {})
