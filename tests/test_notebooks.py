"""The notebooks run top to bottom against the sample incident (as a responder would walk them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_notebooks_are_stored_clean():
    for nb_path in NOTEBOOKS:
        nb = json.loads(nb_path.read_text())
        tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, f"{nb_path.name}: exactly one parameters cell"
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert not cell.get("outputs"), f"{nb_path.name} is stored with outputs"
                assert "def " not in "".join(cell["source"]), f"{nb_path.name} defines functions"


@pytest.mark.slow
def test_notebooks_execute_on_the_sample(tmp_path, sample_incident):
    import papermill

    out_dir = tmp_path / "out"
    for nb_path in NOTEBOOKS:
        papermill.execute_notebook(str(nb_path), str(tmp_path / nb_path.name), kernel_name="python3",
                                   parameters={"incident": str(sample_incident), "out_dir": str(out_dir)},
                                   cwd=str(nb_path.parent), progress_bar=False)
    scope = json.loads((out_dir / "scope.json").read_text())
    assert scope["affected_responses"] > 0
    assert (out_dir / "report.html").exists()
