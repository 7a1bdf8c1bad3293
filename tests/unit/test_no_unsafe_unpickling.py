"""The package never calls torch.load without weights_only, nor unpickles without a restricted unpickler (a source scan
that sees the allowed uses)."""

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# ---- nothing untrusted is unpickled ----------------------------------------------------------------------------------
ALLOWED_PICKLE = {
    # DCP .metadata through an unpickler that admits only DCP's own classes
    ("xpar_zoo/checkpoint/dcp_io.py", "MetadataUnpickler"),
    # launch.run: rank 0's result, pickled by our own child process
    ("xpar_zoo/testing/launch.py", "pickle.loads(payload)"),
}


def _package_sources() -> list[Path]:
    return sorted(p for d in ("xpar_zoo", "converters", "plans") for p in (REPO_ROOT / d).rglob("*.py"))


def test_no_torch_load_without_weights_only_and_no_unrestricted_unpickling():
    bad = []
    for path in _package_sources():
        rel = str(path.relative_to(REPO_ROOT))
        text = path.read_text()
        for m in re.finditer(r"torch\.load\(([^)]*)\)", text):
            if "weights_only=True" not in m.group(1):
                bad.append(f"{rel}: {m.group(0)}")
        for line in text.splitlines():
            if re.search(r"pickle\.(load|loads|Unpickler)\b|\bUnpickler\(", line):
                allowed = any(rel == f and token in line for f, token in ALLOWED_PICKLE)
                if not allowed and not line.lstrip().startswith(("#", "import", "from")):
                    bad.append(f"{rel}: {line.strip()}")
    assert not bad, "unpickling outside the allowed places:\n" + "\n".join(bad)


def test_the_pickle_check_sees_the_allowed_uses():
    """The grep above is not vacuous: it finds the two allowed uses where they are."""
    found = {(str(p.relative_to(REPO_ROOT)), tok) for p in _package_sources() for f, tok in ALLOWED_PICKLE
             if str(p.relative_to(REPO_ROOT)) == f and tok in p.read_text()}
    assert found == ALLOWED_PICKLE
    assert "weights_only=True" in (REPO_ROOT / "xpar_zoo/checkpoint/dcp_io.py").read_text()
