"""The README's Python example runs as written (on a fresh Minari root and cache)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_the_readme_python_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no Python example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    env = {
        **os.environ,
        "MINARI_DATASETS_PATH": str(tmp_path / "datasets"),
        "OFFAUG_CACHE_DIR": str(tmp_path / "cache"),
    }
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "EvaluationResult" in done.stdout
    assert (tmp_path / "runs" / "demo" / "augmented" / "manifest.json").is_file()
