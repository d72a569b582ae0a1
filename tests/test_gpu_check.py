"""tools/gpu_check.sh, the GPU device check, end to end on a CPU (--dry-run): its first bench at the tiny arch,
the rows merged into one JSON table beside the log, the plan of the long-context rows."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_backend  # a shell script that runs bench processes of both backends itself

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(sys.platform == "win32", reason="a bash script")
def test_the_gpu_check_runs_its_benches_and_writes_one_table(tmp_path):
    pytest.importorskip("jax")
    env = dict(
        os.environ,
        OUT=str(tmp_path),
        FINETUNE_BENCH_PEAK_SIZE="512",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), "--dry-run"], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {(row["bench"], row["backend"], row["recipe"]) for row in table["rows"] if "error" not in row}
    assert {("gemma-2b", "jax", "finetune"), ("gemma-2b", "torch", "finetune")} <= rows, table["rows"]
    assert ("gemma-2b", "torch", "hf") in rows  # the peer, on the torch process
    assert all(row["arch"] == "tiny" for row in table["rows"] if "error" not in row)  # a CPU: the tiny arch
    assert {"float32"} <= set(table["peaks"]) and all(p["device"].startswith("cpu") for p in table["peaks"].values())
    log = (tmp_path / "gpu_check.log").read_text()
    assert "fits:" in log and "gpu_check: done in" in log  # the plan beside the long-context rows
    assert "routed" in log and "dense" in log  # the expert bank timed both ways
