"""ms-deepseek: DeepSeek-V2 training with MindSpore on Ascend (and CPU)."""

import os
from pathlib import Path

from setuptools import find_namespace_packages, setup

HERE = Path(__file__).parent


def read_pins(name):
    """Requirement lines of a pins file (comments and blanks dropped)."""
    lines = (HERE / name).read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def runtime_pins():
    """The pins file of the MindSpore line asked for at install time: ``MS_DEEPSEEK_MINDSPORE`` unset (or the
    line requirements.txt pins) installs requirements.txt, another line its ``requirements-ms<line>.txt``. A pip
    constraints file cannot do this (constraints narrow a requirement, they never replace an exact pin), nor can
    an extra (extras add requirements to the default ones)."""
    line = os.environ.get("MS_DEEPSEEK_MINDSPORE", "").strip()
    default = next(r for r in read_pins("requirements.txt") if r.startswith("mindspore=="))
    if not line or default.split("==")[1].startswith(line + "."):
        return read_pins("requirements.txt")
    name = f"requirements-ms{line}.txt"
    if not (HERE / name).is_file():
        lines = sorted(p.name[len("requirements-ms") : -len(".txt")] for p in HERE.glob("requirements-ms*.txt"))
        supported = ", ".join([default.split("==")[1].rsplit(".", 1)[0], *lines])
        raise SystemExit(f"MS_DEEPSEEK_MINDSPORE={line}: not a supported MindSpore line (supported: {supported})")
    return read_pins(name)


setup(
    name="ms-deepseek",
    version="0.1.0",
    description="DeepSeek-V2 / V2-Lite training with MindSpore: HF-parity model, SEMI_AUTO_PARALLEL plans, converters",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9,<3.12",
    # The kernel sources (ms_deepseek/ops_src, a link to ops/: C++, Ascend C, build scripts) are
    # data, but setuptools treats every folder of shipped files as a (namespace) package: list
    # them as such so it has nothing to warn about, and ship every file in them.
    # package_dir {"": "."}: an editable install is one .pth line naming this folder; without it
    # setuptools picks its import-hook finder, which warns about same-named folders on every install.
    package_dir={"": "."},
    packages=find_namespace_packages(include=["ms_deepseek", "ms_deepseek.*"], exclude=["*.__pycache__"]),
    include_package_data=True,
    package_data={"ms_deepseek.ops_src": ["**/*"]},
    exclude_package_data={"": ["*.so", "*.o", "*.pyc"]},  # kernels built in place on first use stay out
    install_requires=runtime_pins(),
    extras_require={"test": read_pins("requirements-test.txt")},
    entry_points={"console_scripts": ["ms-deepseek=ms_deepseek.cli:main"]},
)
