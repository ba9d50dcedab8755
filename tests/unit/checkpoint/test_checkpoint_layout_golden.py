"""layout.json against its written spec (docs/layout.md) and the golden files (tests/fixtures/layout)."""

import json
import re
import sys

import pytest

from ms_deepseek.checkpoint.layout import FORMAT, VERSION, VERSION_DISTINCT, read_layout

from repo_paths import FIXTURES, REPO

GOLDEN = FIXTURES / "layout"
sys.path.insert(0, str(GOLDEN))
from make_golden import cases  # noqa: E402

NAMES = ["training_v1.json", "distinct_v2.json", "lora_v1.json"]


def _keys(data, out=None):
    """Every key of the layout file that is not a tensor name."""
    out = set() if out is None else out
    for key, value in data.items():
        if key in ("tensors", "optimizer"):
            for entry in value.values():
                out.update(entry)
            out.add(key)
            continue
        out.add(key)
        if isinstance(value, dict):
            _keys(value, out)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_a_golden_file_reads_back_as_it_is(tmp_path, name):
    data = json.loads((GOLDEN / name).read_text())
    (tmp_path / "layout.json").write_text(json.dumps(data))
    assert read_layout(tmp_path).to_json() == data


@pytest.mark.parametrize("name", NAMES)
def test_the_code_still_writes_the_golden_file(name):
    """A format change is a new version in docs/layout.md and regenerated goldens (make_golden.py)."""
    assert cases()[name].to_json() == json.loads((GOLDEN / name).read_text())


def test_the_spec_names_every_key_and_version():
    spec = (REPO / "docs" / "layout.md").read_text()
    documented = set(re.findall(r"`(\w+)`", spec))  # a table row or a nested key named in one
    used = set().union(*(_keys(json.loads((GOLDEN / n).read_text())) for n in NAMES))
    assert used <= documented, f"keys in the golden files that docs/layout.md does not describe: {used - documented}"
    assert f"| `{FORMAT}` | {VERSION} |" in spec and f"| `{FORMAT}` | {VERSION_DISTINCT} |" in spec
    assert {json.loads((GOLDEN / n).read_text())["version"] for n in NAMES} == {VERSION, VERSION_DISTINCT}
