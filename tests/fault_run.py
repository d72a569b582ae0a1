"""Run the finetune CLI with a fault injected right after the checkpoint of a given step.

Used by conftest.run_with_fault in a subprocess: FAULT names a signal (SIGKILL, SIGTERM,
SIGINT) that the process sends itself after saving the checkpoint of step
FAULT_STEP; FAULT_MARK, if set, is a file that receives the time of sending.
"""

import os
import signal
import time

from finetune import checkpoint, cli

fault = getattr(signal, os.environ["FAULT"])
at_step = int(os.environ["FAULT_STEP"])
save = checkpoint.save


def save_then_signal(run_dir, run_id, step, *args, **kwargs):
    saved = save(run_dir, run_id, step, *args, **kwargs)
    if step == at_step:
        if os.environ.get("FAULT_MARK"):
            with open(os.environ["FAULT_MARK"], "w") as f:
                f.write(str(time.time()))
        os.kill(os.getpid(), fault)
    return saved


checkpoint.save = save_then_signal
cli.main()
