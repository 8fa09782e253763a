"""Peers that `speclens bench` measures beside SpecLens's own methods, in the same run: llama.cpp.

`llama_cpp` runs llama.cpp (through llama-cpp-python, the optional extra `pip install -e '.[peers]'`) on
the target's own GGUF file: the same prompt token ids (our chat template), the same threads and new-token
count, greedy. Its time is measured as ours is: the prompt but its last token is prefilled untimed, then
the clock runs from the last prompt token to the last new token. Its tokens go into the report like any
method's, so `equal_to_ar` says whether llama.cpp's greedy output equals ours.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

LLAMA_CPP = "llama_cpp"


def llama_cpp_problem(engine) -> str | None:
    """Why `llama_cpp` cannot run for this engine's target, or None when it can."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install -e '.[peers]')"
    if gguf_of(engine) is None:
        return f"llama.cpp reads GGUF files and {engine.target.source} is not one"
    return None


def gguf_of(engine) -> Path | str | None:
    """The target's GGUF file ('default' for the embedded default, fetched on first use), or None."""
    from speclens.engine.runtime.models import DEFAULT_MODEL

    source = str(engine.target.source)
    if source == DEFAULT_MODEL:
        return DEFAULT_MODEL
    path = Path(source).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


class LlamaCppPeer:
    """One llama.cpp context on a GGUF file, decoding greedily from token ids."""

    def __init__(self, path: Path, threads: int, n_ctx: int):
        from llama_cpp import Llama

        self.path, self.threads, self.n_ctx = path, threads, n_ctx
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, logits_all=False, verbose=False)

    def generate(self, ids: list[int], max_new: int, eos_ids: frozenset[int]) -> tuple[tuple[int, ...], float]:
        """Greedy tokens after `ids` (stopping after an end-of-sequence token, as ours does) and the
        decode seconds, prefill of ids[:-1] excluded."""
        import llama_cpp
        import numpy as np

        llm = self.llm
        vocab = llm.n_vocab()
        llm.reset()
        if len(ids) > 1:
            llm.eval(ids[:-1])
        tokens: list[int] = []
        start = time.perf_counter()
        llm.eval(ids[-1:])
        while True:
            # the last row's logits [V], read from the context (Llama.scores holds them only with logits_all)
            last = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,))
            token = int(np.argmax(last))
            tokens.append(token)
            if token in eos_ids or len(tokens) >= max_new:
                break
            llm.eval([token])
        return tuple(tokens), time.perf_counter() - start


def llama_cpp_peer(engine, threads: int, n_ctx: int) -> LlamaCppPeer:
    """The engine's peer, made once and kept on the engine (a context larger than asked is reused)."""
    from speclens.engine.runtime.models import DEFAULT_MODEL, default_gguf

    problem = llama_cpp_problem(engine)
    if problem:
        raise ValueError(f"{LLAMA_CPP}: {problem}")
    path = gguf_of(engine)
    path = default_gguf() if path == DEFAULT_MODEL else path
    peer = getattr(engine, "_speclens_llama_cpp", None)
    if peer is None or peer.path != path or peer.threads != threads or peer.n_ctx < n_ctx:
        peer = LlamaCppPeer(path, threads, max(n_ctx, 2048))
        engine._speclens_llama_cpp = peer
    return peer


def llama_cpp_logits(engine, texts: list[list[int]], threads: int):
    """Teacher-forced logits [T - 1, V] of llama.cpp for each token list (its own context, all rows kept):
    what `speclens bench --kernel-agreement` compares with float32 beside our own kernels."""
    import numpy as np
    import torch
    from llama_cpp import Llama

    from speclens.engine.runtime.models import DEFAULT_MODEL, default_gguf

    problem = llama_cpp_problem(engine)
    if problem:
        raise ValueError(f"{LLAMA_CPP}: {problem}")
    path = gguf_of(engine)
    path = default_gguf() if path == DEFAULT_MODEL else path
    longest = max((len(ids) for ids in texts), default=1)
    llm = Llama(model_path=str(path), n_ctx=max(longest + 8, 512), n_threads=threads, n_threads_batch=threads,
                n_batch=512, logits_all=True, verbose=False)
    for ids in texts:
        llm.reset()
        llm.eval(ids)
        yield torch.from_numpy(np.array(llm.scores[: len(ids) - 1]))
