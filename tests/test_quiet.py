"""Quiet by default: a run's stderr holds the tool's lines only, and the frameworks' log lines are dropped."""

import os
import re
import subprocess
import sys

from conftest import BACKEND

from finetune.platform import quiet

NOISE = [
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    b"I0000 00:00:1795325987.734281   15909 port.cc:153] oneDNN custom operations are on.",
    b"E0000 00:00:1795325992.352479   15909 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)",
    # torch's logging, in the same form with a path (torch.compile past its recompile limit, --compile)
    b"W1129 06:30:19.954000 32681 torch/_dynamo/convert_frame.py:1994] [0/16] torch._dynamo hit config.recompile_limit",
    b"W1122 05:40:01.123456    1234 cudart_stub.cc:31] Could not find cuda drivers on your machine",
    b"normalizer.cc(51) LOG(INFO) precompiled_charsmap is empty. use identity normalization.",
    b"[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3",
    b"To enable the following instructions: AVX2 AVX512F AVX512_VNNI FMA, in other operations, rebuild TensorFlow "
    b"with the appropriate compiler flags.",
]
OURS = [b"error: LoRA rank must be at least 1, got 0; try --rank 4", b"note: 3 records skipped", b"Traceback (most"]


def test_framework_log_lines_are_noise_and_ours_are_not():
    assert all(quiet.is_noise(line) for line in NOISE)
    assert not any(quiet.is_noise(line) for line in OURS)


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "finetune", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "KERAS_BACKEND": BACKEND},
        timeout=300,
    )


def test_a_tiny_run_prints_nothing_on_stderr(tmp_path):
    done = cli(
        *f"gemma --preset tiny --backend {BACKEND} --seq-len 64 --batch-size 2 --max-steps 1".split(),
        *("--max-records", "20", "--set", "train.samples=0", "--output", str(tmp_path / "run")),
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "training steps 1-1" in done.stdout


def test_finetune_data_prints_nothing_on_stderr():
    """`finetune data` chooses no backend: with a shell that sets neither KERAS_BACKEND nor TF_CPP_MIN_LOG_LEVEL
    (conftest sets both for the tests), Keras starts TensorFlow, which notes the CPU features it was built without."""
    env = {k: v for k, v in os.environ.items() if k not in ("KERAS_BACKEND", "TF_CPP_MIN_LOG_LEVEL")}
    args = [sys.executable, "-m", "finetune", "data", "sample", "--preset", "tiny", "--seq-len", "64"]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "format: dolly (instruction, response)" in done.stdout


def test_an_error_still_reaches_stderr_whole():
    done = cli("gemma", "--preset", "tiny", "--rank", "0")
    assert done.returncode == 2
    assert done.stderr == "error: LoRA rank must be at least 1, got 0; try --rank 4\n"


def python(code):
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "KERAS_BACKEND": BACKEND, "FINETUNE_VERBOSE": ""},
        timeout=60,
    )


NOISY = "import os; os.write(2, b'E0000 00:00:1795325992.352479   1 cuda_platform.cc:52] failed call to cuInit\\n')\n"


def test_the_python_api_filters_when_it_chooses_the_backend_and_verbose_keeps_everything():
    """finetune.run, evaluate, generate, load and export all choose the backend first (a notebook's way in)."""
    select = f"from finetune.platform import backend; backend.select({BACKEND!r})\n"
    done = python(select + NOISY + "os.write(2, b'ours\\n')")
    assert done.returncode == 0 and done.stderr == "ours\n", done.stderr
    done = python("from finetune.platform import quiet; quiet.keep_verbose()\n" + select + NOISY)
    assert done.returncode == 0 and "failed call to cuInit" in done.stderr, done.stderr


def test_a_descriptor_put_over_the_filter_is_left_in_place_at_exit(tmp_path):
    """pytest's or a notebook's capture may replace descriptor 2 after the filter: uninstalling must not undo it."""
    code = (
        "import os\nfrom finetune.platform import quiet\nquiet.install()\n"
        f"f = os.open({str(tmp_path / 'err.txt')!r}, os.O_WRONLY | os.O_CREAT)\nos.dup2(f, 2)\n"
        "quiet._uninstall()\nos.write(2, b'still here\\n')\n"
    )
    done = python(code)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert (tmp_path / "err.txt").read_text() == "still here\n"


def test_a_run_after_a_refused_one_in_python_i_prints_no_framework_line(tmp_path):
    """`python -i` writes its `>>> ` prompt to stderr and waits: the filter, installed by the refused first run,
    held the prompt back as a line without its end, and absl's banner, printed when the second run imported
    TensorFlow, arrived as that line's tail and was let through."""
    settings = {"backend": BACKEND, "train.max_steps": 1, "train.samples": 0, "data.max_records": 20,
                "model.seq_len": 64, "train.batch_size": 2}  # fmt: skip
    session = (
        "import finetune\n"
        f"finetune.run(finetune.load_config('tiny', {{**{settings!r}, 'output.dir': 'a', 'data.path': 'no.jsonl'}}))\n"
        f"finetune.run(finetune.load_config('tiny', {{**{settings!r}, 'output.dir': 'b'}}))['steps']\n"
    )
    done = subprocess.run(
        [sys.executable, "-i"],
        input=session,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "KERAS_BACKEND": BACKEND, "FINETUNE_VERBOSE": ""},
        timeout=300,
    )
    assert "UserError: data file" in done.stderr and "no.jsonl does not exist" in done.stderr, done.stderr
    assert (tmp_path / "b" / "metrics.json").is_file(), done.stderr[-3000:]
    noise = [line for line in done.stderr.splitlines() if quiet.is_noise(re.sub(r"^(>>> )+", "", line).encode())]
    assert not noise, noise
    assert done.stderr.rstrip().endswith(">>>")  # the prompts still show


def test_a_line_without_its_end_is_passed_on_once_nothing_more_comes():
    code = (
        "import os, time\nfrom finetune.platform import quiet\nquiet.install()\nos.write(2, b'>>> ')\ntime.sleep(0.5)\n"
        "os.write(2, b'WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n')\n"
        "os.write(2, b'ours\\n')\n"
    )
    done = python(code)
    assert done.returncode == 0 and done.stderr == ">>> ours\n", done.stderr


def test_a_log_line_glued_to_a_python_i_prompt_is_dropped_and_the_prompt_kept():
    """TensorFlow's cuInit error came within the partial-line wait of `>>> `, on the TensorFlow suite's machine."""
    glued = b">>> E0000 00:00:1795623707.432647   32049 cuda_platform.cc:52] failed call to cuInit: INTERNAL"
    assert quiet._shown(glued) == b">>> "
    assert quiet._shown(b">>> ... W0000 00:00:1.5 1 port.cc:1] x") == b">>> ... "
    assert quiet._shown(b">>> finetune.run(cfg)") == b">>> finetune.run(cfg)\n"
    assert quiet._shown(b"error: ... the run's output") == b"error: ... the run's output\n"
