"""Device meshes, layout maps and multi-host start-up, through the Keras distribution API (JAX).

`--parallel data` is keras' DataParallel: the model is replicated and each batch
is split over the devices. `--parallel model` is keras' ModelParallel over a
(batch, model) mesh, with the layouts of layouts.py in a LayoutMap; it is set
before the model is built, so that every weight is created sharded. XLA's SPMD
partitioner does the rest.

A job of several processes (Vertex AI workers, a TPU pod's hosts, a hand-made
cluster) starts with `initialize`, before anything touches the devices. Each
process then feeds its own slice of every global batch (`part`), and only
process 0 writes the run's files.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from finetune.model import layouts
from finetune.platform import documents
from finetune.platform.errors import UserError

# Vertex AI's worker pools: 0 is the chief (one replica), 1 the other workers.
# Pools 2 (reduction servers) and 3 (evaluators) do not train.
VERTEX_POOLS = ("workerpool0", "workerpool1")
# TF_CONFIG's names for them: the chief, then the workers; ps and evaluator do not train.
TF_POOLS = ("chief", "worker")


@dataclass(frozen=True)
class Cluster:
    coordinator: str
    num_processes: int
    process_id: int
    source: str
    """Where the settings came from: flags, CLUSTER_SPEC, TF_CONFIG or KERAS_DISTRIBUTION_*."""


def cluster(dist, environ=os.environ) -> Cluster | None:
    """The multi-process job this process belongs to, or None when it runs alone.

    Flags win; then Vertex AI's CLUSTER_SPEC; then TF_CONFIG; then keras' own
    KERAS_DISTRIBUTION_JOB_ADDRESSES / _NUM_PROCESSES / _PROCESS_ID.
    """
    flags = (dist.coordinator, dist.num_processes, dist.process_id)
    if any(v is not None for v in flags):
        if any(v is None for v in flags):
            raise UserError(
                "a multi-host run needs all three of --coordinator HOST:PORT, --num-processes N and --process-id I"
            )
        found = Cluster(dist.coordinator, dist.num_processes, dist.process_id, "flags")
    elif environ.get("CLUSTER_SPEC"):
        found = _from_cluster_spec(environ["CLUSTER_SPEC"])
    elif environ.get("TF_CONFIG"):
        found = _from_tf_config(environ["TF_CONFIG"])
    elif environ.get("KERAS_DISTRIBUTION_JOB_ADDRESSES") or environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES"):
        try:
            found = Cluster(
                environ.get("KERAS_DISTRIBUTION_JOB_ADDRESSES", "").split(",")[0],
                int(environ.get("KERAS_DISTRIBUTION_NUM_PROCESSES", "1")),
                int(environ.get("KERAS_DISTRIBUTION_PROCESS_ID", "0")),
                "KERAS_DISTRIBUTION_*",
            )
        except ValueError:
            raise UserError(
                "KERAS_DISTRIBUTION_NUM_PROCESSES and KERAS_DISTRIBUTION_PROCESS_ID must be integers"
            ) from None
    else:
        return None
    if found.num_processes == 1:
        return None
    if dist.parallel == "none":
        raise UserError(
            f"this is process {found.process_id} of a {found.num_processes}-process job ({found.source}), and "
            "--parallel is none: each process would train alone; pass --parallel data or --parallel model"
        )
    if not (0 <= found.process_id < found.num_processes):
        raise UserError(
            f"process id {found.process_id} is out of range for {found.num_processes} processes ({found.source})"
        )
    if not found.coordinator or ":" not in found.coordinator:
        raise UserError(f"the coordinator address {found.coordinator!r} ({found.source}) must be HOST:PORT")
    return found


def _from_cluster_spec(text: str) -> Cluster:
    """Vertex AI's CLUSTER_SPEC: workerpool0 replica 0 is process 0 and the coordinator."""
    return _from_cluster_document(text, "CLUSTER_SPEC", VERTEX_POOLS, "cluster.workerpool0")


def _from_tf_config(text: str) -> Cluster:
    """TensorFlow's TF_CONFIG, which Vertex AI and TensorFlow's own launchers write: the chief (or, without one,
    worker 0) is process 0 and the coordinator."""
    return _from_cluster_document(text, "TF_CONFIG", TF_POOLS, "cluster.chief or cluster.worker")


def _from_cluster_document(text: str, name: str, pools: tuple[str, ...], needed: str) -> Cluster:
    """A cluster as CLUSTER_SPEC and TF_CONFIG give it: pools of HOST:PORT addresses, and this task's pool and
    index. The training pools' replicas, in the order of `pools`, are the processes."""
    fix = "unset it, or pass --coordinator, --num-processes and --process-id"
    spec = documents.Document(documents.parse_json(text, name, fix), name, fix)
    cluster, task = spec.section("cluster"), spec.section("task")
    addresses = {pool: cluster.items(pool, str, required=False, check=_host_port) for pool in pools}
    members = [(pool, i) for pool in pools for i in range(len(addresses[pool]))]
    if not members:
        spec.fail(f"cluster lists no training worker ({needed})")
    me = (task.field("type", str), int(task.field("index", (int, str), check=_index)))
    if me not in members:
        raise UserError(f"this worker ({me[0]} #{me[1]}) is not a training worker pool of {name}")
    first = members[0]
    return Cluster(addresses[first[0]][first[1]], len(members), members.index(me), name)


def _host_port(address: str) -> str | None:
    host, _, port = address.rpartition(":")
    return None if host and port.isdigit() else "must be HOST:PORT"


def _index(index) -> str | None:
    if isinstance(index, str) and not (index.isdigit() and len(index) < 10):
        return "must be a whole number"
    return None if int(index) >= 0 else "must not be negative"


def initialize(found: Cluster | None) -> None:
    """Join the job before anything touches the devices (a no-op for a single process)."""
    if found is None:
        return
    import keras

    print(
        f"joining a job of {found.num_processes} processes as process {found.process_id}, "
        f"coordinator {found.coordinator} ({found.source})",
        flush=True,
    )
    try:
        keras.distribution.initialize(
            job_addresses=found.coordinator, num_processes=found.num_processes, process_id=found.process_id
        )
    except Exception as e:  # noqa: BLE001 - JAX raises a bare RuntimeError/XlaRuntimeError here
        raise UserError(
            f"could not join the job through coordinator {found.coordinator} ({found.source}): "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}\nCheck that process 0 runs and that every "
            "process was given the same coordinator and process count"
        ) from e


def process() -> tuple[int, int]:
    """(this process's index, the number of processes); (0, 1) without a multi-process job."""
    import keras

    if keras.config.backend() != "jax":
        return 0, 1
    import jax

    return jax.process_index(), jax.process_count()


def predicted(model, x: dict):
    """`model`'s output on the batch `x`, in inference mode, as numpy: in a job of several processes, the whole
    batch's, on every process.

    x: this process's part of the batch (data_part, batching.Feed.part). keras' predict_on_batch takes x for the
    whole batch, which a process's part is not (train_on_batch and test_on_batch distribute their batch;
    predict_on_batch does not): there each input becomes one global array, split on the batch axis as a training
    step's are, the model runs on the whole batch, and every process gathers its whole output.
    """
    import keras
    import numpy as np

    current = keras.distribution.distribution()
    if current is None or process()[1] == 1:
        return np.asarray(keras.ops.convert_to_numpy(model.predict_on_batch(x)))
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec

    first, end, shards = data_part()
    sharding = NamedSharding(current.device_mesh.backend_mesh, PartitionSpec(current.batch_dim_name))

    def whole(value):
        value = np.asarray(value)
        shape = (len(value) * shards // (end - first), *value.shape[1:])
        return jax.make_array_from_process_local_data(sharding, value, shape)

    if not model.built:  # as predict_on_batch builds it: its variables, nothing assigned
        with keras.StatelessScope():
            model(x, training=False)
    call = getattr(model, "_finetune_predicted", None)
    if call is None:  # compiled once per model, as predict_on_batch's function is
        call = jax.jit(lambda trainable, frozen, inputs: model.stateless_call(trainable, frozen, inputs,
                                                                              training=False)[0])  # fmt: skip
        model._finetune_predicted = call
    out = call([v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables],
               {name: whole(value) for name, value in x.items()})  # fmt: skip
    return np.asarray(multihost_utils.process_allgather(out, tiled=True))


def fit_to_data_axis(dist, batch_size: int) -> tuple[int, str | None]:
    """A default batch size the user did not choose, made to split over the mesh's data axis: the next multiple
    of its devices. Returns (batch size, a note saying so, or None when it already split)."""
    if dist.parallel == "none":
        return batch_size, None
    import keras

    data, _ = layouts.parse_mesh(dist.mesh, dist.parallel, len(keras.distribution.list_devices()))
    return layouts.fit_default_batch(batch_size, data)


def setup(dist, dims: layouts.Dims, batch_size: int) -> dict | None:
    """Set keras' global distribution for `dist` (before the model is built); returns what the run records.

    None for `--parallel none`.
    """
    if dist.parallel == "none":
        return None
    import keras

    devices = keras.distribution.list_devices()
    data, model = layouts.parse_mesh(dist.mesh, dist.parallel, len(devices))
    _, count = process()
    layouts.check_batch(batch_size, data)
    if dist.parallel == "data":
        mesh = keras.distribution.DeviceMesh((data,), (layouts.DATA_AXIS,), devices)
        distribution = keras.distribution.DataParallel(device_mesh=mesh, auto_shard_dataset=False)
        groups = {}
    else:
        mesh = keras.distribution.DeviceMesh((data, model), (layouts.DATA_AXIS, layouts.MODEL_AXIS), devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        groups = {}
        for placement in layouts.place(dims, model):
            layout_map[placement.rule.pattern] = placement.axes
            groups[placement.rule.group] = list(placement.axes)
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name=layouts.DATA_AXIS, auto_shard_dataset=False
        )
    # Each process feeds its own rows of every batch (batching.local): nothing for keras to shard.
    keras.distribution.set_distribution(distribution)
    info = {
        "parallel": dist.parallel,
        "mesh_shape": list(mesh.shape),
        "axis_names": list(mesh.axis_names),
        "devices": len(devices),
        "processes": count,
        "layouts": groups,
    }
    print(
        f"distribution: {dist.parallel} parallel over {len(devices)} devices, mesh "
        f"{' x '.join(f'{n} {a}' for n, a in zip(mesh.shape, mesh.axis_names))}"
        + (f", {count} processes" if count > 1 else ""),
        flush=True,
    )
    return info


def data_part() -> tuple[int, int, int]:
    """(first, end, n): this process feeds data shards first..end-1 of the n the batch axis has.

    A global batch is split into n equal shards along the mesh's batch axis. A
    process feeds the rows of the shards its own devices hold, which is the whole
    batch when the batch axis is not split across processes (model parallel over
    hosts), and 1/processes of it in a data-parallel job. (0, 1, 1) without a
    distribution.
    """
    import keras

    current = keras.distribution.distribution()
    if current is None:
        return 0, 1, 1
    import jax

    devices = current.device_mesh.backend_mesh.devices
    axis = current.device_mesh.axis_names.index(current.batch_dim_name)
    mine = [
        i
        for i in range(devices.shape[axis])
        if any(d.process_index == jax.process_index() for d in devices.take([i], axis=axis).flat)
    ]
    if mine != list(range(mine[0], mine[-1] + 1)):
        raise UserError(f"this process's devices hold data shards {mine}, which are not contiguous; use another --mesh")
    return mine[0], mine[-1] + 1, devices.shape[axis]


def data_replicas() -> int:
    """How many ways keras' current distribution splits a batch (1 without one)."""
    return data_part()[2]
