"""The training loop: one optimizer step per batch (its micro-batches), from the step a run is at to its last.

Keras' fit() is not used, for three reasons found in use:
- an exact resume starts mid-epoch at a given step, which fit cannot;
- on JAX, fit swallows Ctrl-C (a bare `except` in its log handling catches the
  KeyboardInterrupt while the main thread waits on a step), so the run went on;
- fit reorders a PyDataset's batches, so the tokens counted for a step were not
  those of the batch it trained.
`train_on_batch` runs the same compiled train step on every backend and leaves
the variables in sync after each step (JAX included), so a checkpoint or an
evaluation can happen after any step. What watches the loop (the NaN guard,
signals, the time limit, progress lines) is small and lives here too.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from finetune.platform import backend
from finetune.platform.errors import RunStopped, UserError

_IN_FILES = ("best_weights", "order_arrays")  # Progress' arrays: a checkpoint's files of their own, not state.json


@dataclass
class Progress:
    """What training has done so far; saved in every checkpoint and restored on resume."""

    step: int = 0
    rows: list = field(default_factory=list)
    """history.csv: a row per step (train_loss) and per evaluation (eval_loss, eval_accuracy)."""
    evaluations: list = field(default_factory=list)
    """Held-out metrics, with the step, after each data epoch, every --eval-every steps and after the last step."""
    trained_tokens: int = 0
    response_tokens: int = 0
    computed_positions: int = 0
    """Positions of the micro-batches this process fed the model (each cut to its longest row where it is cut)."""
    computed_padding: int = 0
    """Those of them that were padding: with computed_positions, what --packing and --group-by-length save."""
    train_seconds: float = 0.0
    """Time in optimizer steps, over every session of the run."""
    stopped_early: dict | None = None
    """{at_step, reason} once --early-stop ended training."""
    best_weights: list | None = None
    """The trainable variables' values at the best evaluation (--keep-best); a checkpoint keeps them in a file of
    their own (checkpoint.BEST), not in state.json."""
    order_arrays: dict | None = None
    """What the order needs to go on as the uninterrupted run would, by name (Order.kept: GRPO's batch of rollouts
    part way through the --num-iterations steps that train on it); a checkpoint keeps them in a file of their own
    (checkpoint.ORDER)."""

    def to_state(self) -> dict:
        state = asdict(self)
        del state["best_weights"], state["order_arrays"]
        return state

    @classmethod
    def from_state(cls, state: dict) -> Progress:
        # .get: a checkpoint saved before a field was added resumes with its default.
        return cls(**{k: state[k] for k in asdict(cls()) if k in state and k not in _IN_FILES})

    def best(self) -> dict | None:
        """The evaluation with the lowest held-out loss, the earliest of equals; None before any."""
        return min(self.evaluations, key=lambda e: e["loss"], default=None)

    def evaluations_since_best(self) -> int:
        """How many evaluations came after the best one: what --early-stop counts."""
        best = self.best()
        return 0 if best is None else len(self.evaluations) - 1 - self.evaluations.index(best)


@dataclass(frozen=True)
class Evaluation:
    """When the loop scores the held-out records, and what the scores decide (the `eval` settings).

    Args:
        score: callable() -> dict with loss, perplexity and accuracy over the held-out records; None when the run
            holds none out (--eval-fraction 0 without --eval-data), and nothing is evaluated.
        every: int or None. Also evaluate every this many steps, beside each data epoch's end and the last step.
        keep_best: bool. Keep the trainable weights of the best evaluation (Progress.best_weights).
        early_stop: int or None. Stop once this many evaluations in a row found no lower loss.
    """

    score: object = None
    every: int | None = None
    keep_best: bool = False
    early_stop: int | None = None
    history: tuple = ()
    """The held-out metrics history.csv keeps beside the loss and accuracy (the method's held_out_history)."""
    method: object = None
    """The run's method (methods/method.Method), whose words the log says the scores in: given with `score`."""

    def words(self, result: dict) -> str:
        """`result`, an evaluation's scores, as the log says them (Method.held_out_words)."""
        return self.method.held_out_words(result)

    def due(self, step: int, steps_per_epoch: int, total_steps: int) -> bool:
        """Whether to evaluate after `step`."""
        return self.score is not None and evaluates_after(step, self.every, steps_per_epoch, total_steps)

    def stop_reason(self, progress: Progress) -> str | None:
        """Why to stop early after the evaluation just made; None to go on."""
        stale = progress.evaluations_since_best()
        if self.early_stop is None or stale < self.early_stop:
            return None
        best = progress.best()
        return f"{stale} evaluations without {self.method.better_words(best)} at step {best.get('step')} " \
               f"(--early-stop {self.early_stop})"  # fmt: skip


def evaluates_after(step: int, every: int | None, steps_per_epoch: int, total_steps: int) -> bool:
    """Whether a run that holds records out scores them after `step`: every --eval-every steps, at each epoch's
    end, and at its last step."""
    return bool(every and step % every == 0) or step % steps_per_epoch == 0 or step == total_steps


def _stopped_before_training(name: str) -> str:
    return f"{name}: stopped before training; nothing was written, so rerunning the same command starts it again"


class StopSignals:
    """SIGTERM and Ctrl-C over a whole run, from loading the model to publishing it: train.run installs one.

    What a signal does depends on where the run is (mode()):
    - before training (the default: loading, preparing, evaluating, the reference pass, the first samples) it stops
      the run at once, with nothing written (RunStopped, exit 130 or 143);
    - from the claimed run directory on, the loop stops after the step under way, with a checkpoint; a second Ctrl-C
      raises KeyboardInterrupt at once;
    - while the results are written (outputs.Claim.finishing) it stops at once, the last checkpoint kept, and a
      second signal is ignored while the first unwinds.

    Python runs a handler between two bytecodes of the main thread, and an exception raised there is lost when those
    are a finalizer's: a `__del__` that a garbage collection runs prints "Exception ignored in" and drops it. On
    JAX, keras' evaluate() runs enough of them (regex's Group.__del__ in the trace) that a Ctrl-C while evaluating
    before training was lost in up to 4 of 6 tries (the tiny preset on a CPU), and the run trained on. So the
    handler records the signal too, and the run checks the record where it may stop (check_stop): at each phase
    line (Phases), after each held-out batch (scoring), before the run directory is claimed (train.run) and after
    each step (Loop).

    Inside keras' evaluation, prediction and generation (deferred()) a first signal is only recorded, and the stop
    is taken after the batch or generation under way: a compiled call runs to its end whatever is raised, and a
    KeyboardInterrupt raised inside keras-hub's generate() on JAX left the process to crash as it exited (SIGSEGV
    in XLA's thread pools as Python finalized: 22 of 40 runs whose Ctrl-C came while generating, 0 of 14 deferred).

    Signal handlers can only be set from the main thread; elsewhere the defaults stay and nothing is recorded.

    Args:
        at_once: callable(name) -> str or None. What a stop at once says (name: Ctrl-C or SIGTERM); None: the loop
            stops after its step instead. The default is a stop before training.
        again: bool. A second signal stops at once again; False ignores it while the first stop unwinds.
    """

    active: StopSignals | None = None
    """The installed one, which check_stop() reads: signal handlers are the process's, so is this."""

    def __init__(self, at_once: Callable[[str], str] | None = _stopped_before_training, again: bool = True):
        self.received = None
        self.at_once = at_once
        self.again = again
        self._previous = {}
        self._outer = None
        self._interrupted = None
        """What the stop at once the handler raised as a KeyboardInterrupt says: _raise_as_stopped's."""
        self._deferred = 0
        """How many deferred() blocks the main thread is in."""

    @classmethod
    @contextlib.contextmanager
    def mode(cls, at_once: Callable[[str], str] | None, again: bool = True):
        """The active StopSignals stopping as `at_once` and `again` say in the block (a new one installed if none
        is: the loop and the results of a run that train.run did not start). A signal already received and not
        acted on stops the run on entering a mode that stops at once."""
        signals = cls.active
        if signals is None:
            with cls(at_once, again) as signals:
                yield signals
            return
        before = signals.at_once, signals.again
        signals.at_once, signals.again = at_once, again
        try:
            signals.check()
            yield signals
        except KeyboardInterrupt:
            signals._raise_as_stopped()
            raise
        finally:
            signals.at_once, signals.again = before

    @classmethod
    @contextlib.contextmanager
    def deferred(cls):
        """Around a keras call that compiles or runs compiled code: a first signal is recorded, not raised, and the
        caller's check_stop() after each batch takes it."""
        signals = cls.active
        if signals is None:
            yield
            return
        signals._deferred += 1
        try:
            yield
        finally:
            signals._deferred -= 1

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
            self._outer, StopSignals.active = StopSignals.active, self
        return self

    def __exit__(self, kind, error, trace):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._previous:
            StopSignals.active = self._outer
        self._previous = {}
        if isinstance(error, KeyboardInterrupt):
            self._raise_as_stopped()

    def stop_after_steps(self) -> None:
        """From now on a signal stops the run after a training step, with a checkpoint (Loop), not at once; a stop
        asked for before, whose raise was lost, is taken first."""
        self.check()
        self.at_once = None

    def check(self) -> None:
        """Stop at once if a signal asked to and this mode stops at once: the handler's own raise may have been lost."""
        if self.received is not None and self.at_once is not None:
            self._interrupted = None  # the handler's raise, if it made one, was lost: this is its stop
            raise self._stopped(self.at_once)

    def _stopped(self, said: Callable[[str], str]) -> RunStopped:
        name, code = ("SIGTERM", 143) if self.received == signal.SIGTERM else ("Ctrl-C", 130)
        return RunStopped(said(name), code)

    def _raise_as_stopped(self) -> None:
        """Raise the RunStopped that the KeyboardInterrupt the handler raised at once stands for, if it raised one."""
        said, self._interrupted = self._interrupted, None
        if said is not None:
            raise self._stopped(said) from None

    def _handle(self, signum, frame):
        earlier, self.received = self.received, signum
        if self.at_once is not None:
            if self._deferred and earlier is None:
                return  # check_stop() after the batch under way takes it
            if earlier is None or self.again:
                # A KeyboardInterrupt, which mode() and __exit__ make the RunStopped: keras wraps an Exception raised
                # inside a layer's call in a RuntimeError of its own ("Exception encountered when calling
                # Softmax.call()", seen on JAX), and any `except Exception` on the way would keep it.
                self._interrupted = self.at_once
                raise KeyboardInterrupt
            return
        if signum == signal.SIGINT and earlier == signal.SIGINT:
            raise KeyboardInterrupt
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        hint = " (Ctrl-C again to quit at once)" if signum == signal.SIGINT else ""
        print(f"\n{name}: saving a checkpoint after this step, then stopping{hint}", file=sys.stderr, flush=True)


def check_stop() -> None:
    """Stop the run here if a signal asked for a stop at once (StopSignals); nothing outside a run."""
    if StopSignals.active is not None:
        StopSignals.active.check()


def stop_after_steps() -> None:
    """From now on a signal stops the run after a training step, with a checkpoint (StopSignals.stop_after_steps)."""
    if StopSignals.active is not None:
        StopSignals.active.stop_after_steps()


@dataclass(frozen=True)
class Plan:
    """What the loop is to do.

    total_steps: int. Train steps progress.step .. total_steps - 1.
    checkpoint_every: int. Save a checkpoint every this many steps (and after each evaluation).
    deadline: float or None. A time.monotonic() instant to stop before, with a checkpoint: steps, evaluations
        and saves are timed, and the loop stops when the next of them might not end in time.
    divergence_advice: str. What to try when the loss is not finite.
    settings: str. The batch size, seq-len and rank, named when a step runs out of memory.
    release_host_memory: bool. Hand the heap's freed pages back to the OS after each micro-batch
        (backend.release_freed_host_memory): a run with pictures on a CPU, whose encoder's pass would otherwise
        stack on the last micro-batch's freed activations.
    """

    total_steps: int
    checkpoint_every: int
    deadline: float | None = None
    divergence_advice: str = ""
    settings: str = ""
    release_host_memory: bool = False


@dataclass
class Hooks:
    """What the loop calls out to.

    evaluation: Evaluation. What to evaluate the held-out records with, and when: after each data epoch, every
        `evaluation.every` steps and after the last step.
    save_checkpoint: callable(progress), called every `checkpoint_every` steps, after each evaluation, and
        before stopping on a signal or the time limit.
    callbacks: keras Callbacks (callbacks.py) told of each step (on_train_batch_end, with the run's step, and
        logs of its loss, tokens, seconds, and the learning rate and gradient norm it applied where known),
        evaluation (on_test_end) and the end of training (on_train_end).
    last_saved: int or None. The step of the checkpoint a resumed run started from.
    eval_seconds: float. How long the evaluation before training took: the first guess of the next one's.
    out: a text stream for progress; sys.stdout when None.
    """

    evaluation: Evaluation
    save_checkpoint: Callable
    callbacks: list = field(default_factory=list)
    last_saved: int | None = None
    eval_seconds: float = 0.0
    out: object = None


class Loop:
    """Runs steps `progress.step` .. `plan.total_steps` - 1 of `order` on `trainer` (builder.compile's
    TrainingView), as `plan` says, calling out through `hooks`."""

    def __init__(self, trainer, order, progress: Progress, plan: Plan, hooks: Hooks):
        self.trainer = trainer
        self.order = order
        self.total_steps = plan.total_steps
        self.progress = progress
        self.evaluation = hooks.evaluation
        self.save_checkpoint = hooks.save_checkpoint
        self.checkpoint_every = plan.checkpoint_every
        self.deadline = plan.deadline
        self.divergence_advice = plan.divergence_advice
        self.settings = plan.settings
        self.release_host_memory = plan.release_host_memory
        self.last_saved = hooks.last_saved
        self.callbacks = list(hooks.callbacks)
        self.out = hooks.out or sys.stdout  # looked up now: notebooks and tests swap sys.stdout
        self._longest = {"step": 0.0, "eval": hooks.eval_seconds, "save": 0.0}
        # tokens/s over this session's steps but the first of each batch shape, which compiles it.
        self.timed_tokens = 0
        self.timed_seconds = 0.0
        self._shapes = set()
        self._report = Report(plan.total_steps, self.out)

    def run(self) -> Progress:
        """Train to `total_steps`; running out of memory is a UserError that names the settings to lower."""
        try:
            return self._run()
        except BaseException as error:
            if not backend.is_out_of_memory(error):
                raise
            kept = f" (the checkpoint at step {self.last_saved} is kept)" if self.last_saved else ""
            raise UserError(
                f"out of memory at step {self.progress.step + 1} with {self.settings}; "
                f"lower --batch-size or --seq-len{kept}"
            ) from error

    def _run(self) -> Progress:
        progress, order = self.progress, self.order
        if progress.order_arrays is not None:  # resumed where the order kept some
            order.take_up(progress.step, progress.order_arrays)
        with StopSignals.mode(None) as signals:
            while progress.step < self.total_steps and not progress.stopped_early:
                step = progress.step
                loss, seconds, shapes, applied = self._optimizer_step(step)
                tokens, response_tokens = order.tokens(step)
                progress.step += 1
                progress.trained_tokens += tokens
                progress.response_tokens += response_tokens
                progress.train_seconds += seconds
                epoch = step // order.steps_per_epoch + 1
                progress.rows.append({"step": progress.step, "epoch": epoch, "train_loss": loss, **applied})
                if self._shapes.issuperset(shapes):  # no micro-batch of a new shape: nothing compiled
                    self.timed_tokens += tokens
                    self.timed_seconds += seconds
                    self._longest["step"] = max(self._longest["step"], seconds)
                self._shapes.update(shapes)
                self._report.step(progress.step, loss, self.tokens_per_second())
                for callback in self.callbacks:
                    logs = {"loss": loss, "tokens": tokens, "seconds": seconds, **applied}
                    callback.on_train_batch_end(progress.step, logs)

                evaluate = self.evaluation.due(progress.step, order.steps_per_epoch, self.total_steps)
                if evaluate:
                    self._evaluate(epoch)
                    self._stop_early()
                stop = self._stop_reason(signals)
                if evaluate or stop or progress.step % self.checkpoint_every == 0:
                    self._save()
                if stop:
                    self._report.close()
                    raise RunStopped(*stop)
                if progress.stopped_early:
                    break
            if self.evaluation.score is not None and not self._evaluated_at(progress.step):
                # Resumed at the last step from a checkpoint saved mid-epoch (a stop): the end needs its evaluation.
                self._evaluate(max(1, -(-progress.step // order.steps_per_epoch)))
                self._save()
        self._report.close()
        for callback in self.callbacks:
            callback.on_train_end()
        return progress

    def _optimizer_step(self, step: int) -> tuple:
        """Train optimizer step `step` (one micro-batch after another); (loss, seconds, shapes, applied).

        The loss is the step's mean over its response tokens: the micro-batches' losses,
        each weighted by its share of them (batching.TrainOrder), averaged. applied: the
        step's learning rate and gradient norm before clipping (optimizer.step_record).
        """
        started, losses, shapes, reported = time.perf_counter(), [], set(), []
        with self._naming_the_checkpoint():
            batches = self.order.micro_batches(step)
        for x, y, w in batches:
            logs = self.trainer.train_on_batch(x, y, sample_weight=w, return_dict=True)
            losses.append(float(logs["loss"]))
            reported.append({name: float(value) for name, value in logs.items() if name != "loss"})
            shapes.add(tuple(x["token_ids"].shape))
            mask = x.get("padding_mask")  # numpy (batching.inputs): 0 at padding, a segment id or 1 elsewhere
            if mask is not None:
                self.progress.computed_positions += mask.size
                self.progress.computed_padding += mask.size - int(np.count_nonzero(mask))
            if self.release_host_memory:
                backend.release_freed_host_memory()
        seconds = time.perf_counter() - started
        loss = sum(losses) / len(losses)
        if not math.isfinite(loss):
            raise self._diverged(f"the training loss is {loss} at step {step + 1}")
        from finetune.model import optimizer  # keras: loop.py is read before the backend is chosen

        # A preference view's metrics (rewards_chosen, reward_accuracy, ...), each the step's: its micro-batches',
        # weighed as the order says (a micro-batch of filler pairs alone weighs nothing).
        weights = self.order.metric_weights(step)
        total = sum(weights)
        applied = {name: sum(w * r[name] for w, r in zip(weights, reported)) / total for name in reported[0]}
        applied.update(optimizer.step_record(self.trainer.optimizer, step))
        applied.update(self.order.step_metrics(step))  # GRPO's rollouts: rewards, lengths
        if not math.isfinite(applied.get("grad_norm", 0.0)):
            raise self._diverged(f"the gradient norm is {applied['grad_norm']} at step {step + 1}")
        # A metric with no value this step (a reward function that gave None for every completion: its mean) is
        # None, an empty cell in history.csv, not a NaN that state.json and metrics.json cannot hold.
        applied = {name: None if isinstance(v, float) and math.isnan(v) else v for name, v in applied.items()}
        return loss, seconds, shapes, applied

    def _evaluated_at(self, step: int) -> bool:
        return any(row["step"] == step and "eval_loss" in row for row in self.progress.rows)

    def _stop_early(self) -> None:
        """--early-stop: end training, as a finished run, once the evaluations stopped improving."""
        reason = self.evaluation.stop_reason(self.progress)
        if reason is not None and self.progress.step < self.total_steps:
            self.progress.stopped_early = {"at_step": self.progress.step, "reason": reason}
            self._report.line(f"early stop at step {self.progress.step}/{self.total_steps}: {reason}")

    def restore_best(self) -> dict | None:
        """--keep-best: put the best evaluation's weights back, for publishing; returns that evaluation."""
        best = self.progress.best()
        if not self.evaluation.keep_best or best is None or self.progress.best_weights is None:
            return None
        for variable, value in zip(self.trainer.trainable_variables, self.progress.best_weights):
            variable.assign(value)
        if best["step"] != self.progress.step:
            print(f"keep best: publishing the adapter of step {best['step']} ({self.evaluation.words(best)})")
        return best

    def tokens_per_second(self) -> float | None:
        return self.timed_tokens / self.timed_seconds if self.timed_seconds > 0 else None

    def _evaluate(self, epoch: int) -> None:
        started = time.perf_counter()
        with self._naming_the_checkpoint():
            result = self.evaluation.score()
        self._longest["eval"] = max(self._longest["eval"], time.perf_counter() - started)
        if not math.isfinite(result["loss"]):
            raise self._diverged(f"the held-out loss is {result['loss']} after step {self.progress.step}")
        self.progress.evaluations.append({"step": self.progress.step, **result})
        if self.evaluation.keep_best and self.progress.best() is self.progress.evaluations[-1]:
            # LoRA factors are small: a copy in memory, written with each checkpoint (checkpoint.BEST).
            self.progress.best_weights = [np.array(v.numpy()) for v in self.trainer.trainable_variables]
        for callback in self.callbacks:
            callback.on_test_end({"step": self.progress.step, **result})
        self.progress.rows.append(
            {
                "step": self.progress.step,
                "epoch": epoch,
                "eval_loss": result["loss"],
                # A preference method's accuracy is its reward accuracy, which its own column holds.
                **({"eval_accuracy": result["accuracy"]} if "accuracy" in self.evaluation.method.held_out else {}),
                **{f"eval_{name}": result[name] for name in self.evaluation.history},
            }
        )
        self._report.line(
            f"epoch {epoch}: {self.evaluation.words(result)} (step {self.progress.step}/{self.total_steps})"
        )

    def _save(self) -> None:
        started = time.perf_counter()
        self.progress.order_arrays = self.order.kept(self.progress.step)
        self.save_checkpoint(self.progress)
        self._longest["save"] = max(self._longest["save"], time.perf_counter() - started)
        self.last_saved = self.progress.step

    def _stop_reason(self, signals: StopSignals):
        if signals.received == signal.SIGINT:
            return self._stopped_message("Ctrl-C"), 130
        if signals.received == signal.SIGTERM:
            return self._stopped_message("SIGTERM"), 143
        if self.deadline is not None and self.progress.step < self.total_steps:
            # The next step, a possible evaluation after it and a save must all end in time.
            needed = 2 * self._longest["step"] + self._longest["eval"] + 2 * self._longest["save"] + 5.0
            if time.monotonic() + needed >= self.deadline:
                return self._stopped_message("the time limit is near"), 75
        return None

    def _stopped_message(self, why: str) -> str:
        return (
            f"{why}: stopped at step {self.progress.step}/{self.total_steps} with a checkpoint; "
            "rerun the same command with --resume to continue (in Python: finetune.run(cfg, resume=True))"
        )

    @contextlib.contextmanager
    def _naming_the_checkpoint(self):
        """A UserError of the data met mid-run (a GRPO reward function that raised) says what a resume takes up."""
        try:
            yield
        except UserError as error:
            kept = (f"the checkpoint at step {self.last_saved} is kept: fix the cause and rerun with --resume"
                    if self.last_saved else "no checkpoint had been saved yet: fix the cause and run again")  # fmt: skip
            raise UserError(f"{error}; {kept}") from error

    def _diverged(self, what: str) -> UserError:
        kept = (
            f"the last good checkpoint (step {self.last_saved}) is kept"
            if self.last_saved
            else "no checkpoint had been saved yet"
        )
        return UserError(f"{what}: training diverged, so nothing was published; {kept}.\n{self.divergence_advice}")


class Report:
    """Progress a person can follow: a live line in a terminal or notebook, a line every few steps in logs."""

    def __init__(self, total_steps: int, out):
        self.total = total_steps
        self.out = out
        self.live = _is_interactive(out)
        self.every = max(1, min(100, total_steps // 10))
        self.started = time.monotonic()
        self._last_print = 0.0
        self._open = False
        self._first_step = None

    def step(self, step: int, loss: float, tokens_per_second: float | None) -> None:
        now = time.monotonic()
        if self._first_step is None:
            self._first_step = step - 1
        due = step % self.every == 0 or step == self.total or now - self._last_print > 60
        if not self.live and not due:
            return
        elapsed = now - self.started
        done = step - self._first_step
        left = elapsed / done * (self.total - step) if done else 0.0
        rate = f"  {tokens_per_second:,.0f} tok/s" if tokens_per_second else ""
        text = f"step {step}/{self.total}  loss {loss:.4f}{rate}  {clock(elapsed)} elapsed  {clock(left)} left"
        if self.live:
            print("\r" + text.ljust(78), end="", file=self.out, flush=True)
            self._open = True
        else:
            print(text, file=self.out, flush=True)
        self._last_print = now

    def line(self, text: str) -> None:
        self.close()
        print(text, file=self.out, flush=True)

    def close(self) -> None:
        if self._open:
            print(file=self.out, flush=True)
            self._open = False


class Phases:
    """A line per phase of a run, with the time since it started: logs without a terminal show where the run is."""

    def __init__(self):
        self.started = time.perf_counter()

    def __call__(self, text: str) -> None:
        check_stop()  # between two phases: a stop the signal handler's raise lost is taken here
        print(f"[{clock(self.seconds())}] {text}", flush=True)

    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def guarded(self, items):
        """`items`, each consumed inside StopSignals.deferred() and followed by a stop check: a compiled call on
        one (a batch scored) runs to its end, and a stop asked for meanwhile is taken after it."""
        for item in items:
            with StopSignals.deferred():
                yield item
            check_stop()


def _is_interactive(out) -> bool:
    return bool(getattr(out, "isatty", lambda: False)()) or "ipykernel" in sys.modules


def clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
