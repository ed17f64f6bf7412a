"""The README's tour runs as written."""
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "README.md")


def python_blocks():
    with open(README) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


@pytest.mark.skipif(not os.path.exists(README), reason="README not beside the tests")
def test_readme_python_blocks_run(capsys):
    blocks = python_blocks()
    assert blocks, "the README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "q_matmul inputs are on different backends" in out
