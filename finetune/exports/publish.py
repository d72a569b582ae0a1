"""finetune publish: a finished run, exported and described by a model card, uploaded to the Hugging Face Hub or to
Kaggle Models.

The files are made by the export code (export.py) in a temporary directory, never in the run, with a README.md
written from the run's record (card.py); the directory goes when the upload is done. A keras-hub preset goes up
through keras-hub's own `keras_hub.upload_preset`, to kaggle:// or hf://; a transformers, PEFT, LoRA or GGUF
directory through huggingface_hub's HfApi. Every refusal comes before anything is exported or sent: a malformed
handle, a format the destination does not take, a run that is not finished, a base whose licence forbids giving
the model to others, a missing library, and (for a real upload) missing credentials. The credentials are left to
the libraries that upload: finetune only asks whether there are some, and never reads, prints or writes them.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from finetune.exports import card, export
from finetune.platform import platforms
from finetune.platform.errors import UserError

HF, KAGGLE = "hf", "kaggle"
README = "README.md"


@dataclass(frozen=True)
class Form:
    """One way a run goes up: the export that makes its files, and how the card describes them."""

    export: str
    """The export.FORMATS format that writes the files."""
    what: str
    """How the card says what goes up (card.Upload.what, whose {model} and {causal_lm} the card fills)."""
    library: str
    """The Hub's library_name for the card."""


KERAS = Form("merged", "a keras-hub preset of {model}, for keras_hub.models.{causal_lm}.from_preset", "keras-hub")
FORMS = {
    "keras": KERAS,
    "merged": KERAS,  # export's name for the same preset
    "lora": Form("lora", "the LoRA adapter for keras-hub (adapter.lora.h5, and adapter.json naming its base)", "keras-hub"),
    "hf": Form("hf", "{model}, in transformers' format", "transformers"),
    "peft": Form("peft", "the adapter for PEFT, on the base model in transformers' format", "peft"),
    "gguf": Form("gguf", "{model}, as GGUF for llama.cpp and Ollama", "gguf"),
}  # fmt: skip
KAGGLE_FORMS = ("keras", "merged")
"""What goes to Kaggle Models: keras-hub presets, which keras_hub.upload_preset uploads."""
HANDLES = "hf://USER/NAME or kaggle://OWNER/MODEL/keras/VARIATION"
_SLUG = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")


@dataclass(frozen=True)
class Destination:
    hub: str
    """hf or kaggle."""
    repo: str
    """USER/NAME on the Hub, OWNER/MODEL/keras/VARIATION on Kaggle."""

    def __str__(self) -> str:
        return f"{self.hub}://{self.repo}"

    @property
    def url(self) -> str:
        if self.hub == HF:
            return f"https://huggingface.co/{self.repo}"
        owner, model, *_ = self.repo.split("/")
        return f"https://www.kaggle.com/models/{owner}/{model}"


@dataclass(frozen=True)
class Request:
    """What `finetune publish` is asked for.

    to: str. hf://USER/NAME or kaggle://OWNER/MODEL/keras/VARIATION.
    format: str. keras (or merged: a keras-hub preset with the adapter merged in), lora, hf, peft or gguf; Kaggle
        takes keras.
    dry_run: bool. List the files and print the card; upload nothing, and need no credentials.
    private: bool. Make a new Hugging Face repository private (kagglehub makes every new Kaggle model private).
    """

    to: str
    format: str = "keras"
    dry_run: bool = False
    private: bool = False


@dataclass
class Published:
    destination: str
    files: list
    """(name, bytes) of each file that went up, or would have."""
    card: str
    uploaded: bool
    url: str


def destination(text: str) -> Destination:
    """The hub and repository `text` names; a UserError for anything else."""
    scheme, sep, rest = str(text).partition("://")
    parts = rest.split("/") if sep else []
    if scheme == HF and len(parts) == 2 and all(_slug(p, 96) for p in parts):
        return Destination(HF, rest)
    if scheme == KAGGLE and len(parts) == 4 and all(_slug(p, 50) for p in parts):
        if parts[2] != "keras":
            raise UserError(
                f"--to {text}: finetune uploads a keras-hub preset to Kaggle, whose framework is keras: "
                f"kaggle://{parts[0]}/{parts[1]}/keras/{parts[3]}"
            )
        return Destination(KAGGLE, rest)
    if scheme == KAGGLE and len(parts) == 5:
        raise UserError(f"--to {text}: leave the version out; Kaggle numbers each upload ({HANDLES})")
    raise UserError(f"--to {text!r} is not a handle finetune uploads to; pass {HANDLES}")


def _slug(part: str, longest: int) -> bool:
    return bool(_SLUG.fullmatch(part)) and len(part) <= longest and "--" not in part and ".." not in part


def check(request: Request) -> tuple[Destination, Form]:
    """Where and how the run goes up, once the request makes sense and the upload can work; pure Python."""
    where = destination(request.to)
    if request.format not in FORMS:
        raise UserError(f"unknown format {request.format!r}; choose one of {', '.join(FORMS)}")
    if where.hub == KAGGLE and request.format not in KAGGLE_FORMS:
        raise UserError(
            f"Kaggle Models takes a keras-hub preset: use --format keras for {where}, or publish --format "
            f"{request.format} to hf://USER/NAME"
        )
    library = "huggingface_hub" if where.hub == HF else "kagglehub"
    if importlib.util.find_spec(library) is None:
        extra = "pip install 'finetune[hf]'" if where.hub == HF else "pip install kagglehub"
        raise UserError(f"publishing to {where.hub}:// needs the {library} package: {extra}")
    if not request.dry_run and not has_credentials(where.hub):
        raise UserError(missing_credentials(where.hub))
    return where, FORMS[request.format]


def has_credentials(hub: str) -> bool:
    """Whether the uploading library will find credentials; their values are not read here."""
    if hub == KAGGLE:
        platforms.use_kaggle_secrets()  # a Kaggle notebook's secrets, into the environment kagglehub reads
        return platforms.kaggle_credentials_present()
    import huggingface_hub

    return huggingface_hub.get_token() is not None


def missing_credentials(hub: str) -> str:
    if hub == KAGGLE:
        return (
            "no Kaggle credentials: set KAGGLE_USERNAME and KAGGLE_KEY, or write ~/.kaggle/kaggle.json "
            "(kaggle.com, Settings, API); --dry-run shows what would go up without them"
        )
    return (
        "no Hugging Face credentials: set HF_TOKEN to a token that may write, or run `hf auth login`; "
        "--dry-run shows what would go up without them"
    )


def open_finished(run_dir):
    """The run in `run_dir` (runs.Run), once it is a finished one: its adapter, config and metrics.json."""
    from finetune.training import outputs, runs

    run = runs.open_run(run_dir)
    if outputs.is_locked(run.directory) or outputs.checked_metrics(run.directory) is None:
        raise UserError(
            f"{run.shown} has no metrics.json, so it is not a finished run; publish a run once it has finished "
            "(finetune runs shows its state)"
        )
    return run


def licence_of(run):
    """The licence of the run's base, refused where its terms forbid passing on a model built on it."""
    from finetune.model import presets

    licence = presets.licence_of(run.config.model.preset, run.adapter["preset"]["family"])
    if not licence.redistribution:
        raise UserError(
            f"{run.config.model.preset} comes under the {licence.name} ({licence.link}), which does not allow "
            "giving a model built on it to others; finetune will not publish it"
        )
    return licence


def publish(run_dir, request: Request, backend: str | None = None) -> Published:
    """Export the finished run in `run_dir` as `request` asks, with its model card, and upload it (list it, with
    dry_run). Every check comes first: a refusal raises UserError with nothing exported or sent."""
    from finetune.training import runs

    where, form = check(request)
    if request.private and where.hub == KAGGLE:  # said, not left silent: the flag changes nothing there
        print("note: --private is for the Hugging Face Hub; Kaggle makes every new model private already (share it "
              "on its page)")  # fmt: skip
    run = open_finished(run_dir)
    runs.check_writes_text(run, "publish")  # a classifier or reward model: its exports are not published yet
    licence = licence_of(run)
    runs.select_backend(run, backend)
    scratch = Path(tempfile.mkdtemp(prefix="finetune-publish-"))
    try:
        folder = scratch / "upload"
        wanted = export.Request(form.export, folder)
        export.export_run(run, wanted, export.check_request(wanted))
        (folder / export.MARKER).unlink()  # export's own record, which names the run's local path
        text = card.model_card(run, card.Upload(form.what, form.library, str(where)), licence)
        (folder / README).write_text(text, encoding="utf-8")
        files = [(str(p.relative_to(folder)), p.stat().st_size) for p in sorted(folder.rglob("*")) if p.is_file()]
        if not request.dry_run:
            upload(where, folder, form, request.private)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return Published(str(where), files, text, not request.dry_run, where.url)


def upload(where: Destination, folder: Path, form: Form, private: bool) -> None:
    """Send `folder` to `where`: a keras-hub preset through keras_hub.upload_preset, anything else to the Hub
    through huggingface_hub. A failure (the network, the handle, access to it) is a UserError."""
    failures = _upload_failures(where.hub)
    try:
        if where.hub == KAGGLE:
            import keras_hub

            keras_hub.upload_preset(str(where), str(folder))
            return
        import huggingface_hub

        api = huggingface_hub.HfApi()
        api.create_repo(where.repo, private=private, exist_ok=True)
        if form is KERAS:
            # keras-hub writes its own model card over ours when the repository has none yet: ours goes up first.
            api.upload_file(path_or_fileobj=str(folder / README), path_in_repo=README, repo_id=where.repo)
            import keras_hub

            keras_hub.upload_preset(str(where), str(folder))
        else:
            api.upload_folder(
                repo_id=where.repo, folder_path=str(folder), commit_message="Upload with finetune publish"
            )
    except failures as error:
        first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        raise UserError(
            f"the upload to {where} failed: {first}; check the handle, that your credentials may write to it, "
            "and the network"
        ) from None


def _upload_failures(hub: str) -> tuple:
    """What the uploading libraries raise for a refused or failed upload: kagglehub's HTTP errors are OSErrors, and
    huggingface_hub's refusals too, but not its client's connection errors (httpx's, which it names HTTPError)."""
    failures = [OSError, ValueError]
    if hub == HF:
        from huggingface_hub import errors

        failures.append(getattr(errors, "HTTPError", OSError))
    else:
        from kagglehub import exceptions

        failures += [exceptions.BackendError, exceptions.CredentialError, exceptions.NotFoundError,
                     exceptions.UnauthenticatedError]  # fmt: skip
    return tuple(failures)


def listing(published: Published) -> str:
    """The files, their sizes and where they go, as `finetune publish` prints them."""
    width = max(len(name) for name, _ in published.files)
    lines = [f"  {name:<{width}}  {_size(size):>9}" for name, size in published.files]
    total = _size(sum(size for _, size in published.files))
    verb = "uploaded" if published.uploaded else "would upload"
    return "\n".join([f"{verb} {len(published.files)} files ({total}) to {published.destination}:", *lines])


def _size(count: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000 or unit == "GB":
            return f"{count} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count} B"
