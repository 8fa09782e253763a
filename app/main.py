"""Entry point: QApplication on qasync's event loop, plus a headless screenshot mode.

    speclens-gui
    speclens-gui --prompt "Explain speculative decoding" [--compare] --screenshot out.png
    speclens-gui --prompt "..." --screenshot-settings settings.png   (the advisor after the answer)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import qasync
from pyqtgraph.util.garbage_collector import GarbageCollector
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from speclens.app.chat_view import Message
from speclens.app.compare import CompareResult
from speclens.app.settings import CPU_KERNELS, MAX_K, SettingsStore, with_overrides
from speclens.app.window import MainWindow
from speclens.app.worker import EngineFactory

SCREENSHOT_SIZE = (1440, 900)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="speclens-gui", description="SpecLens desktop app")
    parser.add_argument("--prompt", help="send this message at start-up")
    parser.add_argument("--compare", action="store_true", help="run the prompt plain vs speculative")
    parser.add_argument("--screenshot", type=Path, help="save a screenshot here when done, then exit")
    parser.add_argument("--target", help="target model: default, hub id, folder or .gguf")
    # the loaded models decide which methods exist (Engine.methods); an unknown one fails after load
    parser.add_argument("--method", help="drafting method offered by the loaded models, e.g. ar, lookup, draft, tree")
    parser.add_argument("--adaptive-k", action=argparse.BooleanOptionalAction, default=None,
                        help="adapt the draft length while generating (K is then the maximum)")
    parser.add_argument("-k", type=int, choices=range(1, MAX_K + 1), metavar=f"1..{MAX_K}", help="draft length")
    parser.add_argument("--max-new-tokens", type=int, help="answer length limit")
    parser.add_argument("--cpu-kernels", choices=CPU_KERNELS, help="how a float32 model computes on a CPU (Settings: CPU kernels)")
    parser.add_argument("--screenshot-settings", type=Path,
                        help="headless mode: also save the settings dialog (speedup advisor) here")
    parser.add_argument("--screenshot-race", type=Path,
                        help="headless mode with --compare: also save the window mid-race here")
    parser.add_argument("--timeout", type=float, default=900.0, help="headless mode: give up after this many seconds")
    return parser.parse_args(argv)


async def run_headless(
    window: MainWindow,
    prompt: str,
    compare: bool,
    screenshot: Path | None,
    timeout: float,
    settings_screenshot: Path | None = None,
    race_screenshot: Path | None = None,
) -> int:
    """Send the prompt (or compare it), wait for the answer, save a screenshot; return an exit code."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def finish(result: object) -> None:
        if not done.done():
            done.set_result(result)

    if compare:
        window.compare.finished.connect(finish)
        window.run_compare(prompt)
    else:
        window.answer_finished.connect(finish)
        if not window.send_message(prompt):
            print("speclens: could not send the prompt", file=sys.stderr)
            return 2
    try:
        result = await asyncio.wait_for(done, timeout)
    except asyncio.TimeoutError:
        print(f"speclens: no answer within {timeout:g} s", file=sys.stderr)
        return 3
    if compare and race_screenshot is not None and window.compare.replaying:
        # mid-race: 60% of the slower side's time, when the faster one has usually finished
        while window.compare.replaying and window.compare.race_clock < 0.6 * window.compare.race_length:
            await asyncio.sleep(0.01)
        race_screenshot.parent.mkdir(parents=True, exist_ok=True)
        if not window.grab().save(str(race_screenshot)):
            print(f"speclens: could not write {race_screenshot}", file=sys.stderr)
            return 4
    while compare and window.compare.replaying:  # the race is replayed at the measured pace (at most ~20 s)
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.3)  # let the plots timer and layout catch up before grabbing
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        if not window.grab().save(str(screenshot)):
            print(f"speclens: could not write {screenshot}", file=sys.stderr)
            return 4
    if settings_screenshot is not None:
        dialog = window.settings_dialog()
        dialog.resize(dialog.sizeHint().expandedTo(dialog.minimumSizeHint()))
        dialog.show()
        await asyncio.sleep(0.3)
        settings_screenshot.parent.mkdir(parents=True, exist_ok=True)
        saved = dialog.grab().save(str(settings_screenshot))
        dialog.close()
        if not saved:
            print(f"speclens: could not write {settings_screenshot}", file=sys.stderr)
            return 4
    error = result.error if isinstance(result, (Message, CompareResult)) else ""
    if error and error != "(stopped)":
        print(f"speclens: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None, engine_factory: EngineFactory | None = None) -> int:
    """`engine_factory` replaces Engine.load (tests and embedding); None loads real models."""
    args = parse_args(argv)
    store = SettingsStore()
    # flags apply to this run only; the stored settings stay as they were
    try:
        settings = with_overrides(
            store.load(), target=args.target, method=args.method, k=args.k,
            max_new_tokens=args.max_new_tokens, adaptive_k=args.adaptive_k, cpu_kernels=args.cpu_kernels,
        )
    except ValueError as exc:
        print(f"speclens: {exc}", file=sys.stderr)
        return 2
    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("SpecLens")
    app.setOrganizationName("speclens")
    # The model worker runs Python on its own thread; a cyclic collection that started there could
    # delete Qt objects off the GUI thread and crash. Collect on the GUI thread only, on a timer.
    collector = GarbageCollector(interval=1.0)
    try:
        return _run(app, store, settings, args, engine_factory)
    finally:
        collector.timer.stop()
        gc.enable()


def _close_on_ctrl_c(window: MainWindow) -> list[int]:
    """Ctrl-C in the terminal closes the window as its close button does (the answer in progress is
    saved, the model thread stopped) instead of raising inside a Qt slot. Python runs the handler at its
    next bytecode on the GUI thread, which the garbage collector's one-second timer guarantees. The
    returned list gets the signal number when it fired."""
    fired: list[int] = []

    def on_sigint(signum, _frame) -> None:
        fired.append(signum)
        # from the event loop, not here: the handler may run inside any slot, midway through its work
        QTimer.singleShot(0, window.close)
        QTimer.singleShot(0, QApplication.quit)

    signal.signal(signal.SIGINT, on_sigint)
    return fired


def _run(app: QApplication, store: SettingsStore, settings, args: argparse.Namespace,
         engine_factory: EngineFactory | None) -> int:
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)

    window = MainWindow(store, engine_factory=engine_factory, settings=settings)
    if args.screenshot is not None:
        window.resize(*SCREENSHOT_SIZE)
    window.show()

    with loop:
        if args.prompt:
            code = loop.run_until_complete(
                run_headless(
                    window, args.prompt, args.compare, args.screenshot, args.timeout, args.screenshot_settings,
                    args.screenshot_race
                )
            )
            window.close()
        elif args.screenshot is not None:
            loop.run_until_complete(asyncio.sleep(0.5))
            window.grab().save(str(args.screenshot))
            window.close()
            code = 0
        else:
            quitting = asyncio.Event()
            app.aboutToQuit.connect(quitting.set)
            interrupted = _close_on_ctrl_c(window)
            loop.run_until_complete(quitting.wait())
            code = 130 if interrupted else 0
            if interrupted:
                print("\ninterrupted", file=sys.stderr)
    if window.engine_thread_running():
        # closed during a model load that cannot be interrupted: the window has saved everything, and
        # destroying a running QThread would abort the process, so leave it now without finalising
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
