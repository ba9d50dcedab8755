"""docs/troubleshooting.md cites doctor checks and alert rules by id: every cited id must exist in
the code's registries, every registered id must be documented, and every failure
of FAILURES (the OOM, HCCL, loss and expert failures users meet) has a section with symptom, detector and fix."""

import re

from ms_deepseek.cli import doctor  # noqa: F401  (registers every check)
from ms_deepseek.doctor.core import REGISTRY
from ms_deepseek.report.alerts import RULES

from repo_paths import REPO

GUIDE = REPO / "docs" / "troubleshooting.md"

FAILURES = [
    "OOM at start",
    "OOM after N steps",
    "OOM at checkpoint",
    "HCCL init failure",
    "HCCL timeouts",
    "hccn.conf mismatch",
    "MTU",
    "Loss NaN",
    "Loss oscillation",
    "Loss plateau",
    "Steps slowing down from swap",
    "Expert collapse",
    "A hang in gradient sync",
]


def sections():
    text = GUIDE.read_text()
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def cited(text):
    return set(re.findall(r"`(doctor|alert):([a-z0-9_]+)`", text))


def test_every_cited_id_exists():
    refs = cited(GUIDE.read_text())
    assert refs
    unknown = sorted(
        f"{kind}:{name}"
        for kind, name in refs
        if (kind == "doctor" and name not in REGISTRY) or (kind == "alert" and name not in RULES)
    )
    assert unknown == [], f"the guide cites ids the code does not have: {unknown}"


def test_every_registered_id_is_documented():
    refs = cited(GUIDE.read_text())
    missing = sorted({f"doctor:{c}" for c in REGISTRY} - {f"{k}:{n}" for k, n in refs}) + sorted(
        {f"alert:{r}" for r in RULES} - {f"{k}:{n}" for k, n in refs}
    )
    assert missing == [], f"not documented in docs/troubleshooting.md: {missing}"


def test_each_failure_has_symptom_detector_and_fix():
    found = sections()
    for title in FAILURES:
        assert title in found, f"missing section: {title}"
        body = found[title]
        for part in ("**Symptom.**", "**Detected by.**", "**Fix.**"):
            assert part in body, (title, part)
        detector = body.split("**Detected by.**", 1)[1].split("**Fix.**", 1)[0]
        assert cited(detector), f"{title}: names no doctor check or alert id"


def test_no_stray_id_syntax():
    # ids written without backticks would escape the registry check above
    text = GUIDE.read_text()
    bare = re.findall(r"(?<!`)\b(?:doctor|alert):[a-z_]+", text)
    assert bare == [], bare
