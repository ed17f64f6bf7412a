"""The suite's own marks: `pytest -m cuda` selects every CUDA case."""
from pathlib import Path

from helpers import run_python

OWN_BACKENDS = "BACKENDS = qd.available_backends()\n"


def test_minus_m_cuda_selects_the_device_fixtures_cuda_cases(tmp_path):
    """The device fixture marked its cuda case as the test started, after `-m cuda`
    had left it out: that run skipped every test parametrized by the fixture (and
    `-m "not cuda"` ran them).  Run with this suite's conftest, cuda taken as present."""
    conftest = Path(__file__).with_name("conftest.py").read_text()
    assert OWN_BACKENDS in conftest
    (tmp_path / "conftest.py").write_text(conftest.replace(OWN_BACKENDS, "BACKENDS = ['reference', 'cuda']\n"))
    (tmp_path / "test_cases.py").write_text("def test_on(device):\n    pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: needs a GPU\n")
    for marks, selected, left_out in (("cuda", "test_on[cuda]", "test_on[reference]"),
                                      ("not cuda", "test_on[reference]", "test_on[cuda]")):
        out = run_python("-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "-m", marks,
                         str(tmp_path))
        assert out.returncode == 0, out.stdout + out.stderr
        assert selected in out.stdout and left_out not in out.stdout, out.stdout
