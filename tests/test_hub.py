"""Hub downloads, on a fake hub (tests never reach a model hub): sized first, bytes / rate / time left,
refused when the model cannot fit, stoppable, and one line for a gated or missing repository."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import DryRunFileInfo
from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

from speclens.engine.runtime import hub
from speclens.engine.runtime.hub import HubError, fetch_model

# the HTTP library huggingface_hub uses (httpx2 from 2.x, httpx before)
httpx = pytest.importorskip("httpx2") if importlib.util.find_spec("httpx2") else pytest.importorskip("httpx")


class FakeHub:
    """snapshot_download(dry_run=True) and hf_hub_download over an in-memory repository; downloads
    report their bytes in chunks through tqdm_class, as the real one does."""

    def __init__(self, root: Path, files: dict[str, int], fail: BaseException | None = None):
        self.root, self.files, self.fail = root, files, fail
        self.downloaded: list[str] = []

    def snapshot_download(self, repo, allow_patterns=None, dry_run=False, local_files_only=False, **kwargs):
        if local_files_only:  # the cache, no network
            folder = self.root / "snapshots" / "c0ffee"
            if not (folder / "config.json").exists():
                raise LocalEntryNotFoundError("not cached")
            return str(folder)
        assert dry_run, "the whole snapshot is never fetched blindly"
        if self.fail is not None:
            raise self.fail
        import fnmatch

        names = [n for n in self.files if any(fnmatch.fnmatch(n, p) for p in allow_patterns)]
        return [DryRunFileInfo(commit_hash="c0ffee", file_size=self.files[n], filename=n,
                               local_path=str(self.root / n), is_cached=False, will_download=True) for n in names]

    def hf_hub_download(self, repo, filename, tqdm_class=None, **kwargs):
        path = self.root / "snapshots" / "c0ffee" / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        size = self.files[filename]
        bar = tqdm_class(total=size, initial=0) if tqdm_class else None
        written = 0
        with path.open("wb") as out:
            if filename == "config.json":
                out.write(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}).encode())
            while written < size and filename != "config.json":
                n = min(1 << 20, size - written)
                out.write(b"\0" * n)
                written += n
                if bar is not None:
                    bar.update(n)
        self.downloaded.append(filename)
        return str(path)


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    def install(files: dict[str, int], fail: BaseException | None = None) -> FakeHub:
        fake = FakeHub(tmp_path, files, fail)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
        monkeypatch.setattr(hub, "REPORT_EVERY_S", 0.0)
        return fake

    return install


def _response(status: int) -> httpx.Response:
    return httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/org/m"))


def test_a_download_is_sized_first_and_reports_bytes_rate_and_time_left(fake_hub):
    fake = fake_hub({"config.json": 60, "tokenizer.json": 2_000, "model.safetensors": 6_000_000,
                     "pytorch_model.bin": 6_000_000, "README.md": 10})
    lines: list[tuple[str, float | None]] = []
    folder = fetch_model("org/m", torch.device("cpu"), torch.float32, lambda m, f: lines.append((m, f)))
    assert (folder / "model.safetensors").stat().st_size == 6_000_000
    assert "pytorch_model.bin" not in fake.downloaded and "README.md" not in fake.downloaded  # safetensors only
    first = lines[0][0]
    assert "6.0 MB of weights" in first and "about 12.0 MB in float32 on cpu" in first and "to download" in first
    downloading = [m for m, _ in lines if m.startswith("Downloading org/m")]
    assert downloading and all(" of 6.0 MB, " in m and "/s, " in m and "left" in m for m in downloading)
    fractions = [f for m, f in lines if m.startswith("Downloading")]
    assert fractions == sorted(fractions) and fractions[-1] == pytest.approx(1.0)


def test_legacy_weights_are_fetched_where_there_are_no_safetensors(fake_hub):
    fake = fake_hub({"config.json": 60, "pytorch_model.bin": 1_000})
    fetch_model("org/m", torch.device("cpu"), torch.float32, lambda m, f: None)
    assert "pytorch_model.bin" in fake.downloaded


def test_a_model_that_cannot_fit_is_refused_before_its_weights_download(fake_hub, monkeypatch):
    fake = fake_hub({"config.json": 60, "model-00001-of-00002.safetensors": 8_000_000_000,
                     "model-00002-of-00002.safetensors": 8_000_000_000})
    monkeypatch.setattr(hub, "available_memory", lambda device: 24_000_000_000)
    with pytest.raises(HubError, match=r"needs about 32.0 GB of memory in float32 on cpu, and 24.0 GB is free"):
        fetch_model("org/big", torch.device("cpu"), torch.float32, lambda m, f: None)
    assert fake.downloaded == ["config.json"]


def test_a_stop_raised_by_progress_stops_the_download_and_passes_through(fake_hub):
    fake = fake_hub({"config.json": 60, "model.safetensors": 50_000_000})

    class Stop(Exception):
        pass

    def progress(message, fraction):
        if fraction is not None and fraction > 0.1:
            raise Stop

    with pytest.raises(Stop):
        fetch_model("org/m", torch.device("cpu"), torch.float32, progress)
    assert "model.safetensors" not in fake.downloaded


@pytest.mark.parametrize("error, words", [
    (GatedRepoError("401 gated", response=_response(401)), "is gated: accept the licence at "
                                                           "https://huggingface.co/org/m and log in with `hf auth login`"),
    (RepositoryNotFoundError("404", response=_response(404)), "No model org/m on the hub"),
    (LocalEntryNotFoundError("offline"), "not in the local cache and the hub cannot be reached"),
    (httpx.ConnectError("no route"), "Could not download org/m: ConnectError: no route"),
])
def test_hub_failures_are_one_line_a_user_can_act_on(fake_hub, error, words):
    fake_hub({}, fail=error)
    with pytest.raises(HubError) as caught:
        fetch_model("org/m", torch.device("cpu"), torch.float32, lambda m, f: None)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_load_model_turns_hub_failures_into_load_errors(fake_hub, monkeypatch):
    from speclens.engine.runtime.models import LoadOptions, ModelLoadError, load_model

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the fake hub is "online"
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    fake_hub({}, fail=GatedRepoError("401 gated", response=_response(401)))
    with pytest.raises(ModelLoadError, match="is gated"):
        load_model("org/m", LoadOptions(device="cpu"))


def test_a_cached_model_loads_when_the_hub_cannot_be_reached(fake_hub, tmp_path):
    fake_hub({"config.json": 60, "model.safetensors": 1_000})
    folder = fetch_model("org/m", torch.device("cpu"), torch.float32, lambda m, f: None)  # online: cached now
    fake_hub({}, fail=httpx.ConnectError("no route"))
    lines = []
    assert fetch_model("org/m", torch.device("cpu"), torch.float32, lambda m, f: lines.append(m)) == folder
    assert "loading the cached copy" in lines[0]


def test_xet_downloads_report_their_bytes_once(monkeypatch):
    """The hub's Xet reporter drives the bar class with reconstruction and transfer bytes and reads its
    `n`: counted once, no TypeError (a bar whose every attribute was a function failed here)."""
    import logging
    from types import SimpleNamespace

    reporting = pytest.importorskip("huggingface_hub.utils._xet_progress_reporting")
    seen = []
    bar_class = hub._byte_counter(seen.append)
    reporter = reporting.XetDownloadProgressReporter(reconstruction_desc="x", total=300, log_level=logging.INFO,
                                                     tqdm_class=bar_class)
    for done in (100, 300):
        reporter.update_progress(SimpleNamespace(total_bytes_completed=done, total_transfer_bytes_completed=done,
                                                 total_bytes_completion_rate=1.0,
                                                 total_transfer_bytes_completion_rate=1.0, total_bytes=300))
    reporter.close()
    assert sum(seen) == 300


def test_only_the_indexed_weights_are_fetched(fake_hub):
    fake = fake_hub({"config.json": 60, "model.safetensors.index.json": 0, "model-00001-of-00001.safetensors": 2_000,
                     "consolidated.safetensors": 2_000})
    real_download = fake.hf_hub_download

    def download(repo, filename, tqdm_class=None, **kwargs):
        path = real_download(repo, filename, tqdm_class, **kwargs)
        if filename.endswith("index.json"):
            Path(path).write_text(json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
        return path

    huggingface_hub.hf_hub_download = download
    lines = []
    fetch_model("org/m", torch.device("cpu"), torch.float32, lambda m, f: lines.append(m))
    assert "consolidated.safetensors" not in fake.downloaded and "2.0 kB of weights" in lines[0]
