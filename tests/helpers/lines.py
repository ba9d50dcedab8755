"""What the tests marked ``lines`` found, kept so that two MindSpore lines' results can be compared.

``bash tools/test.sh --full`` runs the full tier on the default line (2.9) and the tests marked ``lines`` on the
other one (2.10), each with ``MS_DEEPSEEK_LINE_RESULTS`` naming its own folder; ``tools/compare_lines.py`` then
compares the two folders and fails on any difference. Without the variable :func:`record` keeps nothing.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

ENV = "MS_DEEPSEEK_LINE_RESULTS"


def record(name: str, result: dict) -> None:
    """Keep ``result`` (JSON-serialisable) as ``name``'s result on this MindSpore line."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    import mindspore

    Path(folder).mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    path = Path(folder) / f"{safe}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"name": name, "mindspore": mindspore.__version__, "result": result}, indent=1))
    os.replace(tmp, path)
