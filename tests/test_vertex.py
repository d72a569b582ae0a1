"""`finetune vertex-spec`: a Vertex AI custom job spec that runs a recipe, and refusals of jobs that could not run.

Pure config and JSON: no keras, no network.
"""

import json

import pytest
from conftest import REPO
from typer.testing import CliRunner

from finetune import config
from finetune.cli import app
from finetune.tools import vertex

runner = CliRunner()
L4 = ["--machine-type", "g2-standard-8", "--accelerator-type", "NVIDIA_L4"]


def spec_of(*args):
    result = runner.invoke(app, ["vertex-spec", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr


def test_the_spec_runs_the_recipes_command(tmp_path):
    spec, notes = spec_of("--recipe", "gemma-2b-dolly", *L4, "--image", "img:1", "--output", "gs://bucket/run")
    (pool,) = spec["workerPoolSpecs"]
    assert pool["replicaCount"] == 1
    assert pool["machineSpec"] == {
        "machineType": "g2-standard-8",
        "acceleratorType": "NVIDIA_L4",
        "acceleratorCount": 1,
    }
    container = pool["containerSpec"]
    assert container["imageUri"] == "img:1"
    command = " ".join(container["command"] + container["args"])
    first_line = (config.RECIPES_DIR / "gemma-2b-dolly.yaml").read_text().splitlines()[0]
    assert command == first_line.removeprefix("# ") + " --output gs://bucket/run"
    assert "gcloud ai custom-jobs create --region=us-central1 --display-name=finetune-gemma-2b-dolly" in notes
    assert "--config=spec.json" in notes and "note:" not in notes  # image and output given: nothing to warn about


def test_several_replicas_make_a_chief_pool_of_one_and_a_pool_of_the_rest():
    spec, notes = spec_of(
        "--recipe", "gemma-2b-dolly", *L4, "--accelerator-count", "2", "--replicas", "4",
        "--set", "distribution.parallel=data", "--region", "europe-west4", "--output", "gs://my-bucket/r",
    )  # fmt: skip
    chief, workers = spec["workerPoolSpecs"]
    assert (chief["replicaCount"], workers["replicaCount"]) == (1, 3)
    assert chief["machineSpec"] == workers["machineSpec"] and chief["machineSpec"]["acceleratorCount"] == 2
    assert chief["containerSpec"] == workers["containerSpec"]
    assert chief["containerSpec"]["args"][3:5] == ["--set", "distribution.parallel=data"]
    assert chief["containerSpec"]["imageUri"].startswith("europe-west4-docker.pkg.dev/PROJECT/")
    assert "--region=europe-west4" in notes and "note: no --image" in notes


def test_a_cpu_machine_has_no_accelerator_fields():
    spec = vertex.job_spec("tiny", vertex.Machine("n2-standard-8"), 1, "img", None, [])
    (pool,) = spec["workerPoolSpecs"]
    assert pool["machineSpec"] == {"machineType": "n2-standard-8"}
    assert pool["containerSpec"]["args"] == ["gemma", "--recipe", "tiny"]  # no --output: AIP_MODEL_DIR decides


@pytest.mark.parametrize(
    "args, message",
    [
        (["--recipe", "nope", *L4], "no recipe 'nope'"),
        (["--recipe", "tiny", *L4, "--replicas", "0"], "--replicas must be at least 1"),
        (["--recipe", "tiny", *L4, "--accelerator-count", "-1"], "must not be negative"),
        (["--recipe", "tiny", "--machine-type", "n2", "--accelerator-count", "1"], "needs --accelerator-type"),
        (["--recipe", "tiny", "--machine-type", "g2", "--accelerator-type", "nvidia-l4"], "not a Vertex AI accelerator"),
        (["--recipe", "tiny", *L4, "--output", "runs/a"], "gs://BUCKET/PATH"),
        (["--recipe", "tiny", *L4, "--replicas", "2"], "distribution.parallel=data"),
        (["--recipe", "tiny", *L4, "--set", "train.epoch=2"], "unknown config key 'train.epoch'"),
        (["--recipe", "tiny", *L4, "--set", "backend=torch"], "has JAX only"),
        (["--recipe", "tiny", *L4, "--set", "output.dir=runs/a"], "would be lost with the job's container"),
        (["--recipe", "tiny", *L4, "--set", "train.method=grpo", "--set", "train.reward=[exact]", "--set",
          "data.packing=on"], "data.packing on: train.method grpo"),
        (["--recipe", "tiny", *L4, "--accelerator-count", "4", "--set", "distribution.parallel=data", "--set",
          "distribution.mesh=1x8"], "the recipe's mesh 1x8 spans 8 devices, and the job has 4 GPUs"),
        (["--recipe", "tiny", *L4, "--output", "gs://"], "--output gs:// names no bucket"),
        (["--recipe", "tiny", *L4, "--output", "/gcs/"], "--output /gcs/ names no bucket"),
        (["--recipe", "tiny", *L4, "--output", "gs://B_A_D!/x"], "'B_A_D!' is not a Cloud Storage bucket name"),
    ],
    ids=["unknown-recipe", "no-replicas", "negative-count", "count-without-type", "bad-type", "local-output",
         "replicas-without-parallel", "bad-key", "torch-recipe", "recipe-local-output", "method-refusal",
         "mesh-of-other-devices", "no-bucket", "no-mounted-bucket", "bad-bucket"],
)  # fmt: skip
def test_a_job_that_could_not_run_exits_2_with_one_line(args, message):
    result = runner.invoke(app, ["vertex-spec", *args])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""  # no spec to submit by mistake
    assert message in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_the_dockerfile_copies_what_pip_install_needs_and_runs_finetune():
    """It cannot be built here (no Docker Hub): check that its COPY sources exist and are not ignored."""
    lines = (REPO / "Dockerfile").read_text().splitlines()
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line[:1] not in "#"}
    copied = [source for line in lines if line.startswith("COPY ") for source in line.split()[1:-1]]
    assert {"pyproject.toml", "README.md", "finetune"} <= set(copied)  # the readme: pyproject names it
    assert all((REPO / source).exists() and source not in ignored for source in copied)
    assert 'ENTRYPOINT ["finetune"]' in lines and any(
        'pip install ".[jax,gcs,vertex,eval,hf]"' in line for line in lines
    )
    assert 'ARG ACCELERATOR=""' in lines and any('pip install ".[$ACCELERATOR]"' in line for line in lines)
