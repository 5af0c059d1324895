"""The README's example runs as written: its python block, run offline in a fresh interpreter."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_offline():
    blocks = re.findall(r"^```python\n(.*?)^```$", README.read_text(), flags=re.M | re.S)
    assert len(blocks) == 1, (
        f"{README} should hold one python block (the example), has {len(blocks)}"
    )
    # no hub, no download: the example must not need the network
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, "-c", blocks[0]], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr
    # it prints the generated JSON first (the example itself parses it and checks determinism)
    value, _ = json.JSONDecoder().raw_decode(run.stdout)
    assert isinstance(value, dict) and set(value) == {"name", "age"}, run.stdout
