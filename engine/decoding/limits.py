"""Every generation and engine setting's accepted values, checked in one place.

The command line, settings.toml, the settings dialog and the Engine's API all build the same frozen
configs (SamplingParams, GenerationConfig, session.ModelSettings), whose constructors call these
checks, so a value is refused the same way wherever it comes from, and before any model loads. A
refusal is a `SettingError` (a ValueError) whose message is one line naming the setting and what it
accepts. Checks compare as `not (low <= x <= high)`: NaN fails every comparison, so it is refused too.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable

MAX_K = 16  # draft length (a tree drafter's depth)
MAX_NEW_TOKENS = 32_768
MAX_TEMPERATURE = 100.0  # beyond it the distribution is uniform noise to float32
MAX_REPETITION_PENALTY = 100.0
MAX_TOP_K = 1_000_000
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed's range
MAX_TREE_BUDGET = 128  # the head's draft-tree nodes per step (eagle_lookup's grafted chains come on top)
MAX_STOP_STRINGS = 16

# Every method name some engine can offer; which ones a loaded pair offers is Engine.methods.
KNOWN_METHODS = ("ar", "lookup", "rest", "draft", "tree", "eagle", "eagle_chain", "eagle_lookup", "eagle3", "eagle3_chain",
                 "medusa", "dflash")
DRAFT_MODEL_METHODS = ("draft", "tree")  # need a second model

# What happens when a prompt or conversation does not fit the model's context (session.fit_prompt).
OVERFLOW_POLICIES = ("stop", "drop_oldest")
OVERFLOW_LABELS = {
    "stop": "stop with a message",
    "drop_oldest": "drop the oldest turns (the system prompt stays)",
}

DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d{1,3})?")
_METHOD_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}(@[0-9.]{1,8})?")  # synthetic@0.8: a parameter after @


class SettingError(ValueError):
    """A setting outside what it accepts; the message is one line, naming the setting."""


def check_int(name: str, value: object, low: int, high: int, note: str = "") -> int:
    """`value` as an int in low..high (bools and floats are refused: a TOML `k = 4.5` is a mistake)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SettingError(f"{name} must be a whole number in {low}..{high}{note}, got {value!r}")
    value = int(value)
    if not low <= value <= high:
        raise SettingError(f"{name} must be in {low}..{high}{note}, got {value}")
    return value


def check_float(name: str, value: object, low: float, high: float, *, low_open: bool = False, note: str = "") -> float:
    """`value` as a finite float in [low, high] (or (low, high] with low_open); ints are taken."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SettingError(f"{name} must be a number, got {value!r}")
    value = float(value)
    span = f"{'(' if low_open else ''}{low:g}{', ' if low_open else '..'}{high:g}{']' if low_open else ''}"
    inside = (low < value if low_open else low <= value) and value <= high
    if not math.isfinite(value) or not inside:
        raise SettingError(f"{name} must be in {span}{note}, got {value}")
    return value


def check_choice(name: str, value: object, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise SettingError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def check_method(value: object, *, allow_auto: bool = False) -> str:
    """A known method name ('auto' too where the caller resolves it to the engine's best)."""
    return check_choice("method", value, (("auto",) if allow_auto else ()) + KNOWN_METHODS)


def check_method_name(value: object) -> str:
    """A well-formed method name: which drafter it names is the caller's (a test's or a bench's own)."""
    if not isinstance(value, str) or not _METHOD_NAME.fullmatch(value):
        raise SettingError(f"method must be a method name such as {KNOWN_METHODS[1]!r}, got {value!r}")
    return value


def check_device(value: object) -> str:
    if not isinstance(value, str) or not _DEVICE.fullmatch(value):
        raise SettingError(f"device must be auto, cpu, cuda, cuda:N or mps; got {value!r}")
    return value


def check_text(name: str, value: object, max_chars: int) -> str:
    if not isinstance(value, str):
        raise SettingError(f"{name} must be text, got {value!r}")
    if len(value) > max_chars:
        raise SettingError(f"{name} must be at most {max_chars:,} characters, got {len(value):,}")
    return value
