"""Vertex AI custom jobs: the job spec that runs a recipe in the training container, and its gcloud command.

Pure: no Google Cloud client and no network. `finetune vertex-spec` prints the
spec for `gcloud ai custom-jobs create --config`, so what a job runs is a file
one can read, diff and keep beside the recipe.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from typing import Optional

from finetune import config
from finetune.platform import storage
from finetune.platform.errors import UserError

DEFAULT_REGION = "us-central1"
# Where README's `docker build` puts the image; PROJECT is the user's to fill in.
DEFAULT_IMAGE = "{region}-docker.pkg.dev/PROJECT/finetune/finetune:latest"
# Vertex AI names accelerators by enum: NVIDIA_TESLA_T4, NVIDIA_L4, NVIDIA_H100_80GB, TPU_V5_LITEPOD, ...
_ACCELERATOR_NAME = re.compile(r"[A-Z][A-Z0-9_]*")


@dataclass(frozen=True)
class Machine:
    machine_type: str
    """A Compute Engine machine type, e.g. g2-standard-8 (one L4) or a2-highgpu-1g (one A100)."""
    accelerator_type: Optional[str] = None
    """Vertex AI's accelerator name, e.g. NVIDIA_L4; None for a CPU-only machine."""
    accelerator_count: int = 0
    """Accelerators per machine; 0 with no accelerator_type."""

    def spec(self) -> dict:
        """The machineSpec: accelerator fields only when the machine has accelerators."""
        spec = {"machineType": self.machine_type}
        if self.accelerator_count:
            spec.update(acceleratorType=self.accelerator_type, acceleratorCount=self.accelerator_count)
        return spec


def check(recipe: str, machine: Machine, replicas: int, output: Optional[str], settings: list[str]) -> config.Config:
    """Refuse, with one line each, a job that could not run; returns the config the job will train with."""
    if not machine.machine_type.strip():
        raise UserError("--machine-type is empty; pass one such as g2-standard-8 (one L4) or a2-highgpu-1g")
    if machine.accelerator_count < 0:
        raise UserError(f"--accelerator-count must not be negative, got {machine.accelerator_count}")
    if machine.accelerator_count and not machine.accelerator_type:
        raise UserError("--accelerator-count needs --accelerator-type, e.g. --accelerator-type NVIDIA_L4")
    if machine.accelerator_type is not None:
        if not _ACCELERATOR_NAME.fullmatch(machine.accelerator_type):
            raise UserError(
                f"--accelerator-type {machine.accelerator_type!r} is not a Vertex AI accelerator name; "
                "use one such as NVIDIA_TESLA_T4, NVIDIA_L4, NVIDIA_H100_80GB or TPU_V5_LITEPOD"
            )
        if machine.accelerator_count == 0:
            raise UserError(f"--accelerator-type {machine.accelerator_type} needs an --accelerator-count of 1 or more")
    if replicas < 1:
        raise UserError(f"--replicas must be at least 1, got {replicas}")
    if output is not None and not output.startswith(("gs://", "/gcs/")):
        raise UserError(
            f"--output {output} would be lost with the job's container; pass a bucket path, gs://BUCKET/PATH"
        )
    if output is not None and storage.bucket_problem(output):
        raise UserError(f"--output {storage.bucket_problem(output)}; pass a bucket path, gs://BUCKET/PATH")
    # The config as the container reads it: its Dockerfile sets KERAS_BACKEND=jax, whatever this shell has.
    shell = os.environ.get("KERAS_BACKEND")
    os.environ["KERAS_BACKEND"] = "jax"
    try:
        cfg = config.load(recipe, dict(config.parse_set(pair) for pair in settings))
    finally:
        if shell is None:
            del os.environ["KERAS_BACKEND"]
        else:
            os.environ["KERAS_BACKEND"] = shell
    if cfg.backend != "jax":
        raise UserError(
            f"this recipe trains on {cfg.backend}, and the training image (the Dockerfile) has JAX only; "
            "add --set backend=jax"
        )
    kept = output or cfg.output.dir
    if kept is not None and not kept.startswith(("gs://", "/gcs/")):
        raise UserError(
            f"the recipe writes to {kept}, which would be lost with the job's container; pass --output gs://BUCKET/PATH"
        )
    if replicas > 1 and cfg.distribution.parallel == "none":
        raise UserError(
            f"--replicas {replicas} starts one process per machine, but this recipe trains on one device "
            "(distribution.parallel none); add --set distribution.parallel=data (or model)"
        )
    gpus = machine.accelerator_count * replicas if (machine.accelerator_type or "").startswith("NVIDIA") else None
    if cfg.distribution.mesh is not None and gpus:  # a TPU's chips hold one or two devices each: not counted here
        data_axis, model_axis = (int(n) for n in cfg.distribution.mesh.lower().split("x"))
        if data_axis * model_axis != gpus:
            raise UserError(
                f"the recipe's mesh {cfg.distribution.mesh} spans {data_axis * model_axis} devices, and the job has "
                f"{gpus} GPUs ({replicas} x {machine.accelerator_count} {machine.accelerator_type}); match "
                "--accelerator-count and --replicas to it, or --set distribution.mesh=DxM"
            )
    from finetune.methods import registry

    registry.check(cfg)  # what the job's run would refuse of these settings, before a machine is paid for
    return cfg


def shipped(recipe: str) -> bool:
    """Whether `recipe` is one of the package's, which every image built from this repository holds."""
    return config.find_recipe(recipe).parent == config.RECIPES_DIR


def recipe_argument(recipe: str) -> str:
    """How the container names the recipe: a shipped one by name, anything else by the path given."""
    return config.find_recipe(recipe).stem if shipped(recipe) else recipe


def container_args(recipe: str, output: Optional[str], settings: list[str]) -> list[str]:
    """`finetune` arguments: the recipe, its --set overrides, then where the run goes."""
    args = ["gemma", "--recipe", recipe_argument(recipe)]
    for pair in settings:
        args += ["--set", pair]
    if output is not None:
        args += ["--output", output]
    return args


def job_spec(
    recipe: str, machine: Machine, replicas: int, image: str, output: Optional[str], settings: list[str]
) -> dict:
    """A CustomJobSpec: one worker pool, or for several replicas a pool of one (the chief) and one of the rest.

    Vertex AI requires the first pool to hold exactly one replica; every
    replica runs the same command, and multi-host training finds its peers
    in the CLUSTER_SPEC variable Vertex sets.
    """
    container = {"imageUri": image, "command": ["finetune"], "args": container_args(recipe, output, settings)}
    pool = {"machineSpec": machine.spec(), "containerSpec": container}
    pools = [{**pool, "replicaCount": 1}]
    if replicas > 1:
        pools.append({**pool, "replicaCount": replicas - 1})
    return {"workerPoolSpecs": pools}


def display_name(recipe: str) -> str:
    """finetune-<recipe>, in the letters a job's display name reads well with."""
    stem = config.find_recipe(recipe).stem
    return "finetune-" + (re.sub(r"[^A-Za-z0-9_-]+", "-", stem).strip("-") or "run")


def gcloud_command(region: str, name: str, spec_file: str = "spec.json") -> str:
    """The command that submits a spec saved as `spec_file`."""
    return shlex.join(
        [
            "gcloud",
            "ai",
            "custom-jobs",
            "create",
            f"--region={region}",
            f"--display-name={name}",
            f"--config={spec_file}",
        ]
    )
