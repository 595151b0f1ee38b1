"""The repository's text is whole: no merge left half-resolved. (ruff and mypy run as their own step of the test
command, before pytest: README, .ci/run.)"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_merge_conflict_markers_left_in_text_files():
    """A conflict resolved in the code but not in a doc leaves markers that no checker reads."""
    markers = ("<<<<<<< ", ">>>>>>> ")
    suffixes = {".py", ".md", ".toml", ".txt", ".sh", ".json", ".cfg", ".yml", ".yaml"}
    found = [f"{path.relative_to(ROOT)}:{n}" for path in ROOT.rglob("*")
             if path.suffix in suffixes and path.is_file() and not {".git", ".venv", "venv"} & set(path.parts)
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if line.startswith(markers)]
    assert not found, found
