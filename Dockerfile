# The training container for Vertex AI custom jobs (README: Scale out). It runs `finetune ARGS`:
#
#   docker build -t REGION-docker.pkg.dev/PROJECT/finetune/finetune .                          # JAX on CPU
#   docker build --build-arg ACCELERATOR=jax-cuda -t REGION-docker.pkg.dev/PROJECT/finetune/finetune .  # NVIDIA GPUs
#   docker build --build-arg ACCELERATOR=tpu -t REGION-docker.pkg.dev/PROJECT/finetune/finetune .       # Cloud TPUs
#   docker push REGION-docker.pkg.dev/PROJECT/finetune/finetune
#   docker run --rm REGION-docker.pkg.dev/PROJECT/finetune/finetune gemma --recipe tiny      # a smoke test
#
# jax[cuda12] brings CUDA and cuDNN as pip wheels, so a slim Python base serves GPUs too: the host (a Vertex
# AI GPU machine) provides only the driver. This project's CI cannot reach Docker Hub and has never built
# this file: keep it plain, one base and one pip install, so that it stays easy to check by eye.

FROM python:3.11-slim

# The image trains on JAX, the backend of the distribution API; PyTorch or TensorFlow would need an image of
# their own. Unbuffered output puts each log line in Cloud Logging as it is printed.
ENV KERAS_BACKEND=jax \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The package alone: recipes, the sample data and the tiny model ship inside it (pyproject's package-data).
WORKDIR /opt/finetune
COPY pyproject.toml README.md ./
COPY finetune ./finetune

# Empty: JAX for the CPU. jax-cuda for NVIDIA GPUs, tpu for Cloud TPUs: pyproject's own extras, whose pins
# name the accelerator builds (jax[cuda12], jax[tpu]).
ARG ACCELERATOR=""
# gcs: --output gs://... (gcsfs); vertex: the tuning metric (cloudml-hypertune); eval: ROUGE-L for eval --generate;
# hf: export --format hf and peft. The trackers (mlflow, wandb) are left to an image that reports to them.
RUN pip install ".[jax,gcs,vertex,eval,hf]" \
 && if [ -n "$ACCELERATOR" ]; then pip install ".[$ACCELERATOR]"; fi

# Runs without --output land here, inside the container, and are lost with it: give --output gs://BUCKET/PATH
# (finetune vertex-spec does), or let Vertex AI's AIP_MODEL_DIR choose.
WORKDIR /workspace
ENTRYPOINT ["finetune"]
CMD ["--help"]
