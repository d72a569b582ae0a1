"""`finetune runs`: each run directory's state, from a finished run to a killed one (runs.py).

`finetune eval` and `generate` on a trained run are checked in test_train.py, on
its two-step run, and through the Python API in test_api.py.
"""

from conftest import SHORT, invoke, run_with_fault, runner

from finetune.cli import app


def test_runs_lists_each_state(uninterrupted, tmp_path):
    parent = tmp_path / "all"
    parent.mkdir()
    assert run_with_fault(parent / "killed", "SIGKILL", 2).returncode == -9
    invoke("gemma", *SHORT, "--lr", "1e9", "--checkpoint-every", "1", "--output", parent / "diverged")
    result = runner.invoke(app, ["runs", str(parent)])
    assert result.exit_code == 0
    states = {line.split()[0].rsplit("/", 1)[-1]: line.split()[1] for line in result.output.splitlines()[1:]}
    assert states == {"killed": "checkpointed", "diverged": "failed"}
    result = runner.invoke(app, ["runs", str(uninterrupted)])
    assert "finished" in result.output and "8" in result.output
