"""The long-lived model thread: it owns the Engine, loads models and runs generations.

The GUI talks to it only through queued signals (`request_load`, `request_generate`,
`request_selftest`) and a per-request `threading.Event` for cancellation, which the engine checks
between verification steps; the worker's own event loop is busy while a generation runs, so a
queued "stop" slot would arrive too late. Everything it reports goes out as signals, delivered on the GUI thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, QThread, Signal, Slot

from speclens.app.settings import AUTO_METHOD, DRAFT_MODEL_METHODS, needs_reload
from speclens.engine.decoding.decode import GenerationConfig
from speclens.engine.decoding.drafter import StepCost
from speclens.engine.decoding.events import StepEvent, Summary, TokenEvent
from speclens.engine.session import Engine, EngineError, ModelSettings
from speclens.engine.tools.selftest import ChainVerifier, SelftestReport, run_selftest

log = logging.getLogger(__name__)

Progress = Callable[[str, "float | None"], None]
EngineFactory = Callable[[ModelSettings, Progress], Engine]

SELFTEST_TRIALS = 65_536


def load_engine(settings: ModelSettings, progress: Progress) -> Engine:
    return Engine.load(settings, progress=progress)


@dataclass(frozen=True)
class LoadInfo:
    """What the GUI needs to know about a loaded engine."""

    settings: ModelSettings
    description: str
    methods: tuple[str, ...]
    compat_ok: bool | None  # None: single model, nothing to check
    compat_lines: tuple[str, ...]
    drafters: tuple[str, ...] = ()  # per drafter folder: whether it fits the target, and why not
    unfit: int = 0  # drafter folders left out: made for another target
    # the target's timed forwards over 1, 2, ... tokens (Engine.lookup_cost; None on a GPU): the speedup
    # advisor's verify-cost shape
    verify_shape: StepCost | None = None


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: the full message list, a frozen config and its own cancel flag."""

    model: ModelSettings
    messages: tuple[tuple[str, str], ...]  # (role, content)
    config: GenerationConfig
    id: int  # from EngineWorker.new_request, unique per worker
    tag: str = "chat"
    overflow: str = "stop"  # limits.OVERFLOW_POLICIES: what a conversation past the model's context does
    cancel: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


@dataclass(frozen=True)
class ContextUse:
    """How much of the model's context a request's prompt takes, and what the overflow policy did."""

    tokens: int  # the prompt as sent (after any dropped turns)
    context: int | None  # the model's context length (None: unknown)
    notice: str | None = None  # one line for the user when turns were dropped


@dataclass(frozen=True)
class SelftestRequest:
    """An exactness self-test on the loaded engine (loading `model` first when needed).

    `verify` replaces the chain verifier under test (None: the engine's own)."""

    model: ModelSettings
    id: int
    trials: int = SELFTEST_TRIALS
    verify: ChainVerifier | None = field(default=None, compare=False)
    cancel: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)


class _SelftestCancelled(Exception):
    pass


class _Closing(Exception):
    """The app is closing: a model load stops at its next progress report."""


class EngineWorker(QObject):
    """Lives on its own QThread (see `WorkerThread`); slots run there, one at a time."""

    progress = Signal(str, object)  # message, fraction in [0, 1] or None
    loaded = Signal(object)  # LoadInfo
    load_failed = Signal(str)
    started = Signal(int)  # request id: generation (after any load) begins
    tokens = Signal(int, object)  # request id, tuple[TokenEvent, ...] of one verification step
    step = Signal(int, object)  # request id, StepEvent
    summary = Signal(int, object)  # request id, Summary
    context_use = Signal(int, object)  # request id, ContextUse: before the first token
    error = Signal(int, str)  # request id, message
    finished = Signal(int)  # request id; always the last signal of a request
    selftest_progress = Signal(int, str, object)  # request id, message, fraction or None
    selftest_done = Signal(int, object)  # request id, SelftestReport (a failed load reports FAIL)

    request_load = Signal(object)  # ModelSettings, queued to `load`
    request_generate = Signal(object)  # GenerateRequest, queued to `generate`
    request_selftest = Signal(object)  # SelftestRequest, queued to `selftest`

    def __init__(self, factory: EngineFactory | None = None) -> None:
        super().__init__()
        self._factory = factory or load_engine
        self._engine: Engine | None = None
        self._engine_settings: ModelSettings | None = None
        self._ids = itertools.count(1)
        self.closing = threading.Event()  # set by WorkerThread.stop, from the GUI thread
        self.request_load.connect(self.load)
        self.request_generate.connect(self.generate)
        self.request_selftest.connect(self.selftest)

    def next_id(self) -> int:
        """A request id unique to this worker (every sender of its requests shares the sequence)."""
        return next(self._ids)

    def new_request(
        self, model: ModelSettings, messages: tuple[tuple[str, str], ...], config: GenerationConfig, tag: str = "chat",
        overflow: str = "stop",
    ) -> GenerateRequest:
        return GenerateRequest(model, messages, config, self.next_id(), tag, overflow)

    @Slot(object)
    def load(self, settings: ModelSettings) -> None:
        self._load(settings)

    @Slot(object)
    def generate(self, request: GenerateRequest) -> None:
        try:
            if request.cancel.is_set():
                return
            if request.config.method in DRAFT_MODEL_METHODS and request.model.draft is None:
                # else a draft model loaded for an earlier message would quietly go on drafting
                self.error.emit(request.id, f"Method '{request.config.method}' drafts with a second model: choose a "
                                "draft model in Settings, or another method.")
                return
            engine = self._engine
            if needs_reload(self._engine_settings, request.model):
                engine = self._load(request.model, request.cancel)  # Stop also stops a load (a download)
                if isinstance(engine, str):
                    self.error.emit(request.id, f"Could not load the model: {engine}")
                    return
            if request.config.method not in (AUTO_METHOD, *engine.methods):
                self.error.emit(
                    request.id,
                    f"Method '{request.config.method}' is not available with the loaded models "
                    f"(available: {', '.join(engine.methods)}).",
                )
                return
            self.started.emit(request.id)
            self._run(engine, request)
        except EngineError as exc:
            self.error.emit(request.id, str(exc))
        except Exception as exc:  # a bug must not kill the thread the app depends on
            log.exception("generation failed")
            self.error.emit(request.id, f"{type(exc).__name__}: {exc}")
        finally:
            self.finished.emit(request.id)

    @Slot(object)
    def selftest(self, request: SelftestRequest) -> None:
        def progress(message: str, fraction: float | None) -> None:
            # run_selftest has no cancel flag, but calls this every few thousand trials
            if request.cancel.is_set():
                raise _SelftestCancelled
            self.selftest_progress.emit(request.id, message, fraction)

        try:
            engine = self._engine
            if needs_reload(self._engine_settings, request.model):
                progress("Loading the models to test", None)
                engine = self._load(request.model)
                if isinstance(engine, str):
                    report = SelftestReport(False, (f"FAIL could not load the models: {engine}",))
                    self.selftest_done.emit(request.id, report)
                    return
            report = run_selftest(engine, trials=request.trials, verify=request.verify, progress=progress)
        except _SelftestCancelled:
            report = SelftestReport(False, ("FAIL cancelled before the checks finished",))
        except Exception as exc:  # report, don't kill the thread the app depends on
            log.exception("self-test failed")
            report = SelftestReport(False, (f"FAIL the self-test stopped with {type(exc).__name__}: {exc}",))
        self.selftest_done.emit(request.id, report)

    def _run(self, engine: Engine, request: GenerateRequest) -> None:
        batch: list[TokenEvent] = []
        config = request.config
        if config.method == AUTO_METHOD:
            config = dataclasses.replace(config, method=engine.default_method)
        fitted = engine.fit_chat(request.message_dicts(), config.max_new_tokens, request.overflow)
        self.context_use.emit(request.id, ContextUse(fitted.tokens, fitted.context, fitted.notice))
        for event in engine.generate_ids(list(fitted.ids), config, request.cancel):
            if isinstance(event, TokenEvent):
                batch.append(event)
                continue
            if batch:
                self.tokens.emit(request.id, tuple(batch))
                batch = []
            if isinstance(event, StepEvent):
                self.step.emit(request.id, event)
            elif isinstance(event, Summary):
                self.summary.emit(request.id, event)
        if batch:
            self.tokens.emit(request.id, tuple(batch))

    def _load(self, settings: ModelSettings, cancel: threading.Event | None = None) -> Engine | str:
        """The loaded engine, or the user-readable reason it could not be loaded. The loader's progress
        reports stop it when the app closes or `cancel` is set (a download then keeps its part to resume)."""
        self._engine = None  # free the old models before loading new ones
        self._engine_settings = None

        def progress(message: str, fraction: float | None) -> None:
            if self.closing.is_set() or (cancel is not None and cancel.is_set()):
                raise _Closing
            self.progress.emit(message, fraction)

        try:
            engine = self._factory(settings, progress)
        except Exception as exc:
            if self.closing.is_set():
                return "the app is closing"  # _Closing, or whatever a loader made of it: nobody waits
            if cancel is not None and cancel.is_set():
                self.load_failed.emit("Stopped while loading (a download resumes where it stopped next time).")
                return "stopped while loading; a download resumes where it stopped next time"
            if isinstance(exc, EngineError):
                message = str(exc)
            else:
                log.exception("model load failed")
                message = f"{type(exc).__name__}: {exc}"
            self.load_failed.emit(message)
            return message
        self._engine, self._engine_settings = engine, settings
        report = engine.compatibility
        self.loaded.emit(
            LoadInfo(
                settings=settings,
                description=engine.describe(),
                methods=(AUTO_METHOD, *engine.methods),
                compat_ok=None if report is None else bool(report.ok),
                compat_lines=() if report is None else tuple(report.lines),
                drafters=tuple(("✓ " if fit.fits else "✗ ") + fit.line() for fit in engine.drafter_report),
                unfit=sum(not fit.fits for fit in engine.drafter_report),
                verify_shape=getattr(engine, "lookup_cost", None),
            )
        )
        return engine


class WorkerThread(QObject):
    """Owns the QThread and the worker moved onto it; `stop()` cancels and joins."""

    def __init__(self, factory: EngineFactory | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("speclens-engine")
        self.worker = EngineWorker(factory)
        self.worker.moveToThread(self.thread)
        self.thread.start()

    def stop(self, timeout_ms: int = 3_000) -> bool:
        """Stop a model load at its next progress report, end the thread's event loop and join it.
        Generations and self-tests are cancelled by their own flags. False when the thread is still
        inside work that cannot be interrupted (a load between two progress reports) after timeout_ms:
        then this QThread must not be destroyed while it runs (Qt aborts the process)."""
        self.worker.closing.set()
        self.thread.quit()
        return self.thread.wait(timeout_ms)
