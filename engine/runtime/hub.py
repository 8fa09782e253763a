"""Models from the Hugging Face hub: sized before downloading, downloaded with progress, resumable, stoppable.

`fetch_model` asks the hub what a repository's model files weigh (a dry run, nothing written), refuses
when the weights cannot fit in memory on the chosen device or on the disk, then downloads file by file
into the hub's cache while `progress` hears bytes, rate and time left. The hub keeps a stopped file's
part (`.incomplete`) and the next start resumes it. `progress` may raise to stop the download (the
window's close, Ctrl-C). Every hub failure is a one-line `HubError` a user can act on.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

Progress = Callable[[str, "float | None"], None]

# What loading a model needs from its repository (weights as safetensors where the repository has them).
MODEL_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja")
LEGACY_WEIGHTS = ("*.bin",)
BYTES_PER = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8}
REPORT_EVERY_S = 0.25  # progress lines at most this often


class HubError(RuntimeError):
    """A hub download that cannot go on; one line for the user."""


@dataclass(frozen=True)
class HubFile:
    name: str
    size: int
    cached: bool


def human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def explain(repo: str, exc: BaseException) -> str:
    """The one line a user can act on, for a hub error."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    page = f"https://huggingface.co/{repo}"
    if isinstance(exc, GatedRepoError):
        return (f"{repo} is gated: accept the licence at {page} and log in with `hf auth login`, then try again.")
    if isinstance(exc, RepositoryNotFoundError):
        return (f"No model {repo} on the hub (check the name at {page}; a private one needs `hf auth login`).")
    if isinstance(exc, RevisionNotFoundError):
        return f"{repo} has no such revision."
    if isinstance(exc, LocalEntryNotFoundError):
        return (f"{repo} is not in the local cache and the hub cannot be reached (offline, or HF_HUB_OFFLINE is "
                "set): connect, or give a model folder.")
    if isinstance(exc, HfHubHTTPError):
        return f"The hub refused {repo}: {str(exc).splitlines()[0][:200]}"
    return f"Could not download {repo}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _is_hub_failure(exc: BaseException) -> bool:
    """A failure of the hub or the network (not a stop raised by a progress callback)."""
    root = type(exc).__module__.split(".")[0]
    return root in ("huggingface_hub", "httpx", "httpx2", "httpcore", "requests", "urllib3") or isinstance(exc, OSError)


@contextmanager
def _as_hub_error(repo: str) -> Iterator[None]:
    """Hub and network failures inside become one-line HubErrors; anything else (a stop raised by a
    progress callback) passes through as it was raised."""
    try:
        yield
    except HubError:
        raise
    except Exception as exc:
        if not _is_hub_failure(exc):
            raise
        raise HubError(explain(repo, exc)) from exc


def list_files(repo: str, patterns: tuple[str, ...] = MODEL_FILES) -> list[HubFile]:
    """The repository's model files, their sizes and whether each is cached (a dry run: nothing written)."""
    from huggingface_hub import snapshot_download

    with _as_hub_error(repo):
        infos = snapshot_download(repo, allow_patterns=list(patterns), dry_run=True)
        if not any(i.filename.endswith(".safetensors") for i in infos):
            infos = snapshot_download(repo, allow_patterns=list(patterns + LEGACY_WEIGHTS), dry_run=True)
    return [HubFile(i.filename, int(i.file_size or 0), bool(i.is_cached)) for i in infos]


def _one_set_of_weights(repo: str, files: list[HubFile]) -> list[HubFile]:
    """Where an index names the weight shards (model.safetensors.index.json), those and no other weights
    (some repositories also ship a consolidated copy, which would download and be sized twice)."""
    index = next((f for f in files if f.name.endswith(".safetensors.index.json")), None)
    if index is None:
        return files
    from huggingface_hub import hf_hub_download

    try:
        listed = set(json.loads(Path(hf_hub_download(repo, index.name)).read_text())["weight_map"].values())
    except Exception:  # noqa: BLE001 - an unreadable index: keep every file
        return files
    return [f for f in files if not f.name.endswith((".safetensors", ".bin")) or f.name in listed]


def available_memory(device: torch.device) -> int | None:
    """Bytes free for weights on `device` (None: unknown)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def weights_in_memory(weight_bytes: int, stored: str | None, dtype: torch.dtype) -> int:
    """Bytes the weights take once loaded in `dtype` (stored as `stored` in the files)."""
    per_stored = BYTES_PER.get(str(stored or "bfloat16").removeprefix("torch."), 2)
    return int(weight_bytes / per_stored * torch.finfo(dtype).bits / 8)


def fits(repo: str, files: list[HubFile], stored_dtype: str | None, device: torch.device, dtype: torch.dtype,
         folder: Path) -> tuple[str, str | None]:
    """(a line saying what the model needs, a line saying why it does not fit, or None)."""
    weights = sum(f.size for f in files if f.name.endswith((".safetensors", ".bin")))
    needed = weights_in_memory(weights, stored_dtype, dtype)
    free = available_memory(device)
    to_fetch = sum(f.size for f in files if not f.cached)
    line = (f"{repo}: {human(weights)} of weights, about {human(needed)} in {str(dtype).removeprefix('torch.')} on "
            f"{device.type}" + (f" ({human(free)} free)" if free is not None else "")
            + (f"; {human(to_fetch)} to download" if to_fetch else "; all in the cache"))
    if free is not None and needed * 1.1 > free:
        return line, (f"{repo} needs about {human(needed)} of memory in {str(dtype).removeprefix('torch.')} on "
                      f"{device.type}, and {human(free)} is free: choose a smaller model or dtype, or another device.")
    disk = shutil.disk_usage(folder if folder.exists() else Path.home()).free
    if to_fetch > disk:
        return line, f"{repo} needs {human(to_fetch)} of disk to download, and {folder} has {human(disk)} free."
    return line, None


def _byte_counter(sink: Callable[[int], None]) -> type:
    """A progress-bar class for the hub's downloader that hands the bytes written to `sink`. It has
    `update_transfer`, so a Xet download routes its network bytes there (ignored) and its written
    bytes to `update`, as for snapshot_download's own aggregate bar: each byte is counted once. A
    resumed file's `initial` bytes count as done."""

    class _Bytes:
        def __init__(self, *args, total: int | None = None, initial: int = 0, **kwargs) -> None:
            self.total, self.n = total, int(initial or 0)
            if self.n:
                sink(self.n)

        def update(self, n: int | float | None = 1) -> None:
            n = int(n or 0)
            self.n += n
            sink(n)

        def update_transfer(self, n: int | float | None = 1) -> None:
            pass  # network bytes of a Xet download: the written ones (update) are counted

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

        def __getattr__(self, name: str):  # set_postfix_str, refresh, close, ...: nothing to draw
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *args, **kwargs: None

    return _Bytes


def cached_folder(repo: str) -> Path | None:
    """The cached snapshot of `repo` when it holds a config and weights (no network asked), else None."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo, allow_patterns=list(MODEL_FILES + LEGACY_WEIGHTS), local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached, or partly: the hub is asked
        return None
    weights = any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))
    return folder if (folder / "config.json").exists() and weights else None


def fetch_model(repo: str, device: torch.device, dtype: torch.dtype, progress: Progress, offload: bool = False,
                code: bool = False) -> Path:
    """The local folder of hub model `repo`, downloaded as needed (see the module docstring). With
    `offload` (weights spread over GPU and CPU) the device's memory is not a limit; `code` also fetches
    the repository's Python files (trust_remote_code)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.constants import HF_HUB_CACHE

    patterns = MODEL_FILES + (("*.py",) if code else ())
    try:
        files = list_files(repo, patterns)
    except HubError:
        cached = cached_folder(repo)  # the hub out of reach, or gated without a token: a whole cached copy loads
        if cached is None:
            raise
        progress(f"{repo}: the hub could not be asked; loading the cached copy", None)
        return cached
    files = _one_set_of_weights(repo, files)
    if not files:
        raise HubError(f"{repo} holds no model files (config.json, weights) that SpecLens can load.")
    stored = None
    if any(f.name == "config.json" for f in files):
        with _as_hub_error(repo):
            config = json.loads(Path(hf_hub_download(repo, "config.json")).read_text())
        stored = config.get("torch_dtype") or config.get("dtype") or (config.get("text_config") or {}).get("dtype")
    line, refusal = fits(repo, files, stored, torch.device("cpu") if offload else device, dtype, Path(HF_HUB_CACHE))
    progress(line, None)
    if refusal:
        raise HubError(refusal)
    total = sum(f.size for f in files if not f.cached and f.name != "config.json")  # that one is already here
    done, start, last = 0, time.monotonic(), 0.0

    def on_bytes(n: int) -> None:
        nonlocal done, last
        done += n
        now = time.monotonic()
        if now - last < REPORT_EVERY_S and done < total:
            return
        last = now
        rate = done / max(now - start, 1e-6)
        left = (total - done) / rate if rate > 0 else float("inf")
        eta = f"{left / 60:.0f} min left" if left >= 90 else f"{left:.0f} s left"
        progress(f"Downloading {repo}: {human(done)} of {human(total)}, {human(rate)}/s, {eta}",
                 min(done / total, 1.0) if total else None)

    folder = None
    counter = _byte_counter(on_bytes)
    for f in files:
        with _as_hub_error(repo):
            path = hf_hub_download(repo, f.name, tqdm_class=counter)
        folder = Path(path).parents[len(Path(f.name).parts) - 1]  # the snapshot folder
    progress(f"Downloaded {repo}", 1.0)
    return folder
