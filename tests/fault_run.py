"""Run the finetune CLI with a fault injected at a point of the run.

Used by conftest.run_with_fault in a subprocess: FAULT names a signal (SIGKILL, SIGTERM,
SIGINT) that the process sends itself at FAULT_STEP: a step number, right after the
checkpoint of that step is saved; `publish:NAME`, while the results are published,
right after result NAME (adapter.lora.h5, metrics.json, ...) is written under its
temporary name and before it is renamed into place; or `finalizer:evaluate`, as the
held-out records are evaluated before training, from inside a finalizer (a `__del__`),
where Python drops whatever the signal's handler raises: what a garbage collection in
keras' evaluate() on JAX did to a Ctrl-C. FAULT_MARK, if set, is a file that receives
the time of sending.
"""

import os
import signal
import time

from finetune import cli
from finetune.training import checkpoint, outputs, scoring

fault = getattr(signal, os.environ["FAULT"])
at = os.environ["FAULT_STEP"]


def send():
    if os.environ.get("FAULT_MARK"):
        with open(os.environ["FAULT_MARK"], "w") as f:
            f.write(str(time.time()))
    os.kill(os.getpid(), fault)


if at.startswith("publish:"):
    publishing, write_atomic = at.removeprefix("publish:"), outputs.write_atomic

    def write_then_signal(path, write):
        def written(temporary):
            write(temporary)
            if path.name == publishing:
                send()

        return write_atomic(path, written)

    outputs.write_atomic = write_then_signal
elif at == "finalizer:evaluate":
    metrics, sent = scoring.HeldOut.metrics, []

    class Finalized:
        def __del__(self):
            send()
            for _ in range(1000):  # bytecodes after the signal: its handler runs among them, in this finalizer
                pass

    def metrics_after_a_finalizer(self):
        if not sent:
            sent.append(Finalized())
            sent.clear()  # the object's last reference: CPython finalizes it here
            sent.append(True)
        return metrics(self)

    scoring.HeldOut.metrics = metrics_after_a_finalizer
else:
    at_step, save = int(at), checkpoint.save

    def save_then_signal(run_dir, run_id, step, *args, **kwargs):
        saved = save(run_dir, run_id, step, *args, **kwargs)
        if step == at_step:
            send()
        return saved

    checkpoint.save = save_then_signal
cli.main()
