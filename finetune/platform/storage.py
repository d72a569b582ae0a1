"""Where bytes land: durable local writes, and remote run directories (gs://, /gcs/) staged locally.

Checkpoints and results are written to a local directory first: h5py cannot
write to gs://, and a rename is only atomic on a local disk. A remote --output
(any fsspec URL; gs:// needs gcsfs) gets a local staging directory, and a
`Mirror` copies it out: checkpoints as they are written, so a preempted job
keeps them, and the results at the end with metrics.json last.

/gcs/<bucket>/ (Vertex AI's Cloud Storage FUSE mount) is a local path, but it
is staged the same way: gcsfuse has no flock, and refuses to rename a directory
(as a checkpoint save does) unless mounted with --rename-dir-limit; copying
files into it always works.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

from finetune.platform.errors import UserError

GCS_EXTRA = 'pip install "finetune[gcs]"'
FUSE_MOUNT = Path("/gcs")  # where Vertex AI mounts Cloud Storage
# What a name and a path may hold, in bytes, where the file system does not say: ext4, xfs and APFS refuse a
# component over 255, and Linux' system calls a path over 4096.
NAME_MAX, PATH_MAX = 255, 4096


def check_output(path: str, flag: str, *, directory: bool = False, beside: int = 0, inside: int = 0) -> None:
    """Refuse, before any work, an output the user named that could not be written once the work is done.

    Every output path goes through here (`bench --json`/`--plot`, `export --output`, a run's --output), so that
    a folder where a file is expected, a folder nobody may write in (a read-only file system included) or a name
    the file system refuses ends the command in seconds rather than after training. A URL (gs://) is left to its
    file system: check_writable probes a bucket.

    flag: str. The option that named `path`, for messages.
    directory: bool. `path` is a directory to make (its missing parents are made too); else a file, whose folder
        must exist.
    beside: int. Bytes the temporary names written beside `path` add to its last component.
    inside: int. Bytes of the longest name written inside `path`, a directory.
    """
    if is_remote(path):
        return
    if not path.strip():
        raise UserError(f"{flag} is empty (an unset shell variable?); pass the {'directory' if directory else 'file'}")
    target = Path(os.path.abspath(os.path.expanduser(path)))
    existing = nearest_existing(target if directory else target.parent)
    name_max, path_max = _limits(existing)
    for part in target.parts:
        if len(part.encode("utf-8")) + (beside if part == target.name else 0) > name_max:
            raise UserError(
                f"{flag}: the name {part[:40]}... is {len(part.encode('utf-8'))} bytes, too long for the file system "
                f"(at most {name_max - beside} here); pass a shorter {flag}"
            )
    if len(str(target).encode("utf-8")) + inside > path_max:
        raise UserError(f"{flag} {path[:40]}... is too long a path for the file system; pass a shorter {flag}")
    for part in (target, *target.parents):  # a link to nothing: making the directory fails only after the work
        if part.is_symlink() and not part.exists():
            raise UserError(f"{flag} {path}: {part} is a link to {os.readlink(part)}, which does not exist; create "
                            f"it or pass another {flag}")  # fmt: skip
    if directory and target.exists() and not target.is_dir():
        raise UserError(f"{flag} {path} is a file, not a directory; pass another {flag}")
    if not directory and target.is_dir():
        raise UserError(f"{flag} {path} is a folder; name the file to write, such as {Path(path) / 'results'}")
    if not directory and existing != target.parent:
        raise UserError(f"cannot write {path}: its folder does not exist; create it or pass another {flag}")
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {path}: {existing} is not a writable directory; pass another {flag}")


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists: where what is written under it would be made."""
    while path != path.parent:
        try:
            if path.exists():
                return path
        except OSError:  # a name too long for the file system: it cannot exist
            pass
        path = path.parent
    return path


def _limits(existing: Path) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the file system holding `existing`, as it reports them."""
    try:
        return os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):  # Windows has no pathconf; a file system may not say
        return NAME_MAX, PATH_MAX


def write_synced(path: Path, payload: bytes) -> None:
    """Write `payload` to `path` and fsync it."""
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_directory(path: Path) -> None:
    """Make a rename or a new entry in `path` durable (POSIX; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_remote(path: str | None) -> bool:
    """Whether `path` is a URL (gs://bucket/..., memory://...) rather than a local path."""
    return bool(path) and re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path) is not None


# Cloud Storage's bucket names: 3 to 63 lower-case letters, digits, dashes, underscores and dots (up to 222 with
# dots), starting and ending with a letter or digit.
_BUCKET = re.compile(r"[a-z0-9](?:[a-z0-9._-]{1,220})[a-z0-9]")


def bucket_problem(path: str) -> str | None:
    """Why `path` (gs://BUCKET/PATH, or /gcs/BUCKET/PATH under Vertex AI's mount) names no bucket; None if it
    does."""
    rest = (
        path[len("gs://") :] if path.startswith("gs://") else path[len("/gcs/") :] if path.startswith("/gcs/") else None
    )
    if rest is None:
        return f"{path} is not a bucket path"
    bucket = rest.split("/", 1)[0]
    if not bucket:
        return f"{path} names no bucket"
    if not _BUCKET.fullmatch(bucket) or (len(bucket) > 63 and "." not in bucket):
        return (f"{path}: {bucket!r} is not a Cloud Storage bucket name (3 to 63 lower-case letters, digits, "
                "dashes, underscores and dots, starting and ending with a letter or digit)")  # fmt: skip
    return None


def is_fuse(path: str | None) -> bool:
    """Whether `path` is under Vertex AI's Cloud Storage FUSE mount, /gcs/."""
    return bool(path) and not is_remote(path) and Path(os.path.abspath(path)).is_relative_to(FUSE_MOUNT)


def is_staged(path: str | None) -> bool:
    """Whether a run for `path` is written to a local staging directory and copied there."""
    return is_remote(path) or is_fuse(path)


def filesystem(url: str):
    """(fsspec file system, path within it) for a URL or a local path; a UserError when a protocol is not installed."""
    import fsspec

    if not is_remote(url):
        return fsspec.filesystem("file", auto_mkdir=True), os.path.abspath(os.path.expanduser(url))
    protocol = url.split("://", 1)[0]
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError:
        extra = GCS_EXTRA if protocol in ("gs", "gcs") else f"install the fsspec file system for {protocol}://"
        raise UserError(f"writing to {protocol}:// needs a package that is not installed: {extra}") from None
    except ValueError as e:
        raise UserError(
            f"cannot use {url}: {e}; pass a local directory, gs://bucket/path or /gcs/bucket/path"
        ) from None


def check_writable(url: str) -> None:
    """Write and delete a small object under `url`: an unreachable or read-only bucket is refused before training."""
    fs, root = filesystem(url)
    probe = f"{root.rstrip('/')}/.finetune-probe-{uuid.uuid4().hex[:8]}"
    try:
        fs.pipe_file(probe, b"finetune checks it can write here\n")
        fs.rm_file(probe)
    except Exception as e:  # noqa: BLE001 - each file system raises its own errors (HttpError, auth, OSError)
        raise UserError(
            f"cannot write to {url} ({_reason(e)});\ncheck the bucket name and your credentials "
            "(gcloud auth application-default login), or pass another --output"
        ) from None


def staging_dir(url: str) -> Path:
    """The local directory a run for `url` is written to before it is copied there.

    The same URL always stages in the same place, so the run directory's lock
    keeps two runs on this machine from writing to one URL.
    """
    return Path(tempfile.gettempdir()) / "finetune-staging" / _digest(url)


def _digest(url: str) -> str:
    """A short name for `url`, the same with or without a trailing slash: its staged or fetched copy's folder."""
    return hashlib.sha256(url.rstrip("/").encode("utf-8")).hexdigest()[:16]


def _files(local: Path) -> dict[str, Path]:
    """Relative name to path of each file under `local`, leaving out hidden ones (locks, files being written)."""
    found = {}
    for path in sorted(local.rglob("*")) if local.is_dir() else []:
        relative = path.relative_to(local)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            found[relative.as_posix()] = path
    return found


class Mirror:
    """A local directory copied to a remote one (any fsspec URL, or a local path) as it changes.

    Only files that changed since they were last sent are copied. Files named
    in `last` are copied after all others: metrics.json marks a finished run,
    and a checkpoint's manifest.json a whole checkpoint.

    prune: str or None. A folder ("" for all) where, on the final push, every
        remote file that is not local is deleted: checkpoints of a run this one
        replaced go only once it has finished, as they do locally.
    """

    def __init__(self, local: Path, url: str, last: tuple[str, ...] = (), prune: str | None = None):
        self.local = Path(local)
        self.url = url.rstrip("/")
        self.last = last
        self.prune = prune
        self.fs, self.root = filesystem(url)
        self.root = self.root.rstrip("/")
        self.sent: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) when it was sent

    def remote(self, name: str) -> str:
        return f"{self.root}/{name}"

    def push(self, final: bool = False) -> None:
        """Copy new and changed files; delete remote files this mirror sent that are gone locally.

        final: bool. The local copy is final: also prune (see the class).
        """
        files = _files(self.local)
        order = sorted(files, key=lambda name: name.rsplit("/", 1)[-1] in self.last)
        for name in order:
            stat = files[name].stat()
            stamp = (stat.st_size, stat.st_mtime_ns)
            if self.sent.get(name) != stamp:
                self.fs.put_file(str(files[name]), self.remote(name))
                self.sent[name] = stamp
        gone = [name for name in self.sent if name not in files]
        if final and self.prune is not None:
            gone += [name for name in self.remote_files(self.prune) if name not in files and name not in gone]
        for name in gone:
            self.fs.rm_file(self.remote(name))
            self.sent.pop(name, None)

    def remote_files(self, folder: str = "") -> list[str]:
        """Names (relative to the mirror's root) of the remote files under `folder`."""
        base = self.remote(folder).rstrip("/") if folder else self.root
        self.fs.invalidate_cache()
        if not self.fs.exists(base):
            return []
        return sorted(p.split(f"{self.root}/", 1)[-1] for p in self.fs.find(base))

    def exists(self, name: str) -> bool:
        self.fs.invalidate_cache()
        return self.fs.exists(self.remote(name))

    def delete(self, name: str) -> None:
        if self.exists(name):
            self.fs.rm_file(self.remote(name))
        self.sent.pop(name, None)

    def pull(self, folder: str, names: tuple[str, ...] = ()) -> None:
        """Copy the remote `folder` and files `names` here, for a resume; a name missing remotely is removed here.

        Files of `folder` that only exist here are kept: a checkpoint whose copy
        failed is still one to resume from. A file whose size matches is not
        copied again, so pulling twice copies once. Each file is downloaded
        under a hidden name and renamed into place.
        """
        wanted = self.remote_files(folder) + [n for n in names if self.exists(n)]
        for name in names:
            if name not in wanted:
                (self.local / name).unlink(missing_ok=True)
        for name in wanted:
            path = self.local / name
            if not (path.is_file() and path.stat().st_size == self.fs.size(self.remote(name))):
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_name(f".partial.{path.name}")
                self.fs.get_file(self.remote(name), str(partial))
                os.replace(partial, path)
            stat = path.stat()
            self.sent[name] = (stat.st_size, stat.st_mtime_ns)


def fetched(url: str, names: tuple[str, ...]) -> Path:
    """A local copy of the files `names` at the top of the remote directory `url` (those present): what `finetune
    eval`, `generate`, `export` and `publish` read of a finished run on Cloud Storage. Its checkpoints and logs,
    and anything else there, stay where they are.

    The copy is kept under the temporary directory, in a folder of this user's (mode 700), by URL; a file is
    fetched again only when the bucket's copy changed (its size or a version the store gives: generation,
    time, etag), and always where the store gives no version. Each file arrives under a hidden name and is renamed
    into place; a file gone from the bucket goes from the copy. Two processes reading the same URL at once take
    turns (an flock beside the copy), so neither clears the other's file in flight. Copies of other URLs not fetched
    for UNUSED_DAYS are removed. A path that is missing, is a file, or cannot be read or copied is a UserError,
    with nothing half-copied left behind."""
    fs, root = filesystem(url)
    root = root.rstrip("/")
    try:
        fs.invalidate_cache()
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        raise UserError(f"{url} does not exist; check the path") from None
    except Exception as e:  # noqa: BLE001 - each file system raises its own errors (HttpError, auth, OSError)
        raise UserError(f"cannot read {url} ({_reason(e)}); check the path and your credentials "
                        "(gcloud auth application-default login)") from None  # fmt: skip
    if any(e.get("type") == "file" and e["name"].rstrip("/") == root for e in entries):
        raise UserError(f"{url} is a file; pass the run's directory, the folder that holds its config.yaml")
    wanted = {_name(e): e for e in entries if e.get("type") == "file" and _name(e) in names}
    base = Path(tempfile.gettempdir()) / f"finetune-fetched-{_user()}"
    local = base / _digest(url)
    try:
        base.mkdir(mode=0o700, exist_ok=True)
        with _taking_turns(base / f"{local.name}.lock"):  # beside the copy: kept when a stale copy is removed
            local.mkdir(exist_ok=True)
            _fetch_into(local, fs, wanted)
    except Exception as e:  # noqa: BLE001 - the store's errors, a full disk, another user's folder
        raise UserError(f"cannot copy {url} to {local} ({_reason(e)}); check your credentials and the space "
                        "free there") from None  # fmt: skip
    _prune(base, local)
    return local


UNUSED_DAYS = 7
"""A fetched copy not fetched again for this long is removed (a --full run's copy holds its weights)."""


def _prune(base: Path, kept: Path) -> None:
    """Remove the copies under `base` but `kept` that were last fetched UNUSED_DAYS ago or more, each under its
    lock, taken without waiting (a copy being fetched is left); best effort: what cannot be removed stays."""
    import time

    try:
        import fcntl
    except ImportError:  # Windows: no lock to take, so nothing is removed
        return
    old = time.time() - UNUSED_DAYS * 86400
    for copy in base.iterdir():
        try:
            stamped = copy / ".fetched.json"
            if copy == kept or not copy.is_dir() or copy.is_symlink():
                continue
            if (stamped.stat().st_mtime if stamped.exists() else copy.stat().st_mtime) > old:
                continue
            with open(base / f"{copy.name}.lock", "a") as lock_file:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if stamped.exists() and stamped.stat().st_mtime > old:
                    continue  # fetched again since it was judged: being read
                shutil.rmtree(copy)
        except OSError:
            continue


@contextlib.contextmanager
def _taking_turns(path: Path):
    """An exclusive flock on `path` for the block, waited for; unguarded where the system offers none."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with open(path, "a") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        except OSError:  # a file system without locks (FUSE)
            yield
            return
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _fetch_into(local: Path, fs, wanted: dict) -> None:
    """fetched's copy of the remote `wanted` entries (by name) into `local`, by their versions."""
    import json

    stamps_file = local / ".fetched.json"
    try:
        stamps = json.loads(stamps_file.read_text())
    except (OSError, ValueError):
        stamps = {}
    kept = {}
    for name, entry in wanted.items():
        stamp = _version(entry)
        if not (local / name).is_file() or stamp is None or stamps.get(name) != stamp:
            partial = local / f".partial-{uuid.uuid4().hex[:8]}.{name}"
            try:
                fs.get_file(entry["name"], str(partial))
                os.replace(partial, local / name)
            finally:
                partial.unlink(missing_ok=True)
        kept[name] = stamp
    for path in local.iterdir():
        if path.name not in wanted and (not path.name.startswith(".") or path.name.startswith(".partial-")):
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)
    written = local / f".fetched-{uuid.uuid4().hex[:8]}.json"
    written.write_text(json.dumps(kept))
    os.replace(written, stamps_file)


def _reason(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def _user() -> str:
    return str(os.getuid()) if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")


_VERSION_KEYS = ("generation", "mtime", "updated", "etag", "ETag", "md5Hash", "LastModified", "last_modified")


def _version(entry: dict) -> list | None:
    """What tells one copy of a remote file from another: its size and the versions its store lists, or None
    where the store lists none (the file is then fetched every time)."""
    versions = [str(entry[key]) for key in _VERSION_KEYS if entry.get(key) is not None]
    return [entry.get("size"), *versions] if versions else None


@contextlib.contextmanager
def listed(url: str, files: tuple[str, ...], folder: str, inside: str):
    """Yields (URL, local stand-in) for the remote directory `url` and each directory in it: what `finetune runs`
    reads of runs on Cloud Storage, without their weights. A stand-in holds the small `files` (status and
    metrics), and for each directory under `folder` (the checkpoints) its `inside` file (the manifest) and,
    for the other files listed there, empty files of the bucket's sizes (sparse: no space taken), so that a
    checkpoint is judged whole or not as a local one is. The stand-ins live in a temporary directory, removed
    when the block ends."""
    fs, root = filesystem(url)
    root = root.rstrip("/")
    base = Path(tempfile.mkdtemp(prefix="finetune-listed-"))
    try:
        try:
            found = _stand_ins(fs, root, url.rstrip("/"), base, (files, folder, inside))
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - each file system raises its own errors (HttpError, auth, OSError)
            raise UserError(f"cannot list {url} ({_reason(e)}); check the path and your credentials "
                            "(gcloud auth application-default login)") from None  # fmt: skip
        yield found
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _stand_ins(fs, root: str, url: str, base: Path, wanted: tuple) -> list[tuple[str, Path]]:
    files, folder, inside = wanted
    fs.invalidate_cache()
    if not fs.isdir(root):
        raise UserError(f"{url} is not a directory; pass a run directory or a directory of runs")
    top = {_name(e): e for e in fs.ls(root, detail=True)}
    names = [""] + sorted(name for name, e in top.items() if e.get("type") == "directory" and not name.startswith("."))
    found = []
    for name in names:
        remote, local = f"{root}/{name}".rstrip("/"), base / (name or ".run")
        local.mkdir(parents=True, exist_ok=True)
        here = {_name(e): e for e in fs.ls(remote, detail=True)} if name else top
        for file in files:
            if here.get(file, {}).get("type") == "file":
                fs.get_file(f"{remote}/{file}", str(local / file))
        if here.get(folder, {}).get("type") == "directory":
            for entry in fs.ls(f"{remote}/{folder}", detail=True):
                if entry.get("type") == "directory" and not _name(entry).startswith("."):
                    _stand_in(fs, entry["name"].rstrip("/"), local / folder / _name(entry), inside)
        found.append((f"{url}/{name}".rstrip("/"), local))
    return found


def _name(entry: dict) -> str:
    return entry["name"].rstrip("/").rsplit("/", 1)[-1]


def _stand_in(fs, remote: str, local: Path, inside: str) -> None:
    """The remote folder `remote` as `local`: its `inside` file fetched, its other files empty of their size."""
    local.mkdir(parents=True, exist_ok=True)
    for entry in fs.ls(remote, detail=True):
        name = _name(entry)
        if entry.get("type") != "file" or name.startswith("."):
            continue
        if name == inside:
            fs.get_file(entry["name"], str(local / name))
        else:
            with open(local / name, "wb") as f:
                f.truncate(int(entry.get("size") or 0))


def remove_staging(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
