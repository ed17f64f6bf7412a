"""Whether this Python has the package's build requirements (pyproject.toml's
[build-system] requires), for the scripts that build without isolation: exits
non-zero naming what is missing or too old, rather than letting setuptools fail
deep in the build with a message about pyproject's contents."""
import re
import sys
from importlib import metadata


def version_tuple(text):
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


with open("pyproject.toml") as f:
    build_system = f.read().split("[build-system]", 1)[1]
wanted = re.findall(r'"([^"]+)"', re.search(r"requires\s*=\s*\[(.*?)\]", build_system, re.S).group(1))
lacking = []
for requirement in wanted:
    name, _, least = requirement.partition(">=")
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        lacking.append(f"{name} (not installed)")
        continue
    if least and version_tuple(have) < version_tuple(least):
        lacking.append(f"{name} {have} (the build needs >= {least})")
if lacking:
    sys.exit(f"{sys.executable} lacks the build requirements: {', '.join(lacking)}. Install them "
             f"({sys.executable} -m pip install {' '.join(repr(r) for r in wanted)}) or set PYTHON "
             f"to a Python that has them.")
