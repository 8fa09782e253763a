"""Application settings: a frozen snapshot, its TOML store, the model catalog and the dialog.

A generation copies the `AppSettings` it starts with, so edits made while it runs apply to the next
message only.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import platformdirs
import tomli_w
import tomllib
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from speclens.app.plots import AdvisorPanel
from speclens.engine.decoding.decode import GenerationConfig
from speclens.engine.decoding.drafter import StepCost
from speclens.engine.decoding.events import StepEvent
from speclens.engine.decoding.limits import (
    DTYPES,
    MAX_K,
    MAX_NEW_TOKENS,
    MAX_TREE_BUDGET,
    OVERFLOW_LABELS,
    OVERFLOW_POLICIES,
    check_choice,
    check_int,
    check_method,
    check_text,
)
from speclens.engine.decoding.sampling import SamplingParams
from speclens.engine.runtime.models import CPU_KERNELS
from speclens.engine.session import ModelSettings, shipped_heads

# The engine says which methods a loaded pair offers (Engine.methods); these only name the known ones.
METHOD_LABELS = {
    "auto": "Best available (EAGLE + lookup + datastore for the default model)",
    "ar": "Plain autoregressive (no drafting)",
    "draft": "Draft model",
    "lookup": "Prompt lookup",
    "rest": "Datastore lookup (the target's past answers)",
    "tree": "Token tree (draft model)",
    "eagle": "EAGLE heads (dynamic tree)",
    "eagle_chain": "EAGLE heads (chain)",
    "eagle_lookup": "EAGLE heads + prompt lookup + datastore if loaded (one tree)",
    "medusa": "Medusa heads",
    "eagle3": "EAGLE-3 head (dynamic tree)",
    "eagle3_chain": "EAGLE-3 head (chain)",
    "dflash": "DFlash parallel drafter (a block per step)",
}
# Methods that need no second model: a configured draft model is only loaded for the others.
TARGET_ONLY_METHODS = frozenset({"auto", "ar", "lookup", "rest", "eagle", "eagle_chain", "eagle_lookup", "medusa",
                                 "eagle3", "eagle3_chain", "dflash"})
# Methods that draft with a second model, so a message with no draft model set is refused.
DRAFT_MODEL_METHODS = frozenset({"draft", "tree"})
# Resolved by the worker to the loaded engine's best method (Engine.default_method).
AUTO_METHOD = "auto"
# Offered before any engine has reported its own list (e.g. settings opened before the first load).
FALLBACK_METHODS: tuple[str, ...] = ("auto", "ar", "lookup", "draft")


def method_label(method: str) -> str:
    return METHOD_LABELS.get(method, method)
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda", "mps")  # offered in the dialog; settings.toml may say cuda:N
CPU_KERNEL_LABELS = {  # the engine's CPU_KERNELS, as the dialog names them
    "auto": "auto (integer where its check passes on this CPU)",
    "integer": "integer (8-bit activations, VNNI / AVX2)",
    "integer16": "integer16 (16-bit activations: closer to float32, slower blocks)",
    "native": "native float32 (exact float math)",
    "packed": "packed (PyTorch, oneDNN)",
    "stock": "stock (PyTorch's nn.Linear)",
}
MAX_SEED = 2**31 - 1  # what the dialog's spin box holds
MAX_SYSTEM_PROMPT = 20_000  # characters
MAX_COMPARE_RUNS = 9


@dataclass(frozen=True)
class AppSettings:
    target: str = "default"
    method: str = "auto"
    draft: str = ""  # model source for method "draft"; empty = none
    k: int = 4
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = -1  # -1 = a fresh seed per message (TOML has no null)
    max_new_tokens: int = 256
    device: str = "auto"
    dtype: str = "auto"
    cpu_kernels: str = "auto"  # engine.runtime.models.CPU_KERNELS
    adaptive_k: bool = True  # K above is then the upper bound of the +2/-1 schedule
    tree_budget: int = 0  # draft-tree nodes of the EAGLE / Medusa methods; 0 = by device (CPU: up to 4, cut; GPU: 32)
    system_prompt: str = ""  # sent before every conversation's turns; empty = the chat template's own default
    # a conversation past the model's context: drop its oldest turns (said in a banner), or stop with a message
    context_overflow: str = "drop_oldest"
    compare_runs: int = 3  # the Compare tab's pairs of runs (interleaved plain / speculative); figures are medians
    # more drafter folders (EAGLE-1/3, DFlash, Medusa, a datastore), one per line, beside the ones shipped for the
    # default model; one made for another target is left out and the Compatibility report says why
    drafter_folders: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):  # a hand-edited file can hold any TOML type
            value, kind = getattr(self, f.name), type(getattr(AppSettings, f.name))
            numeric = kind is float and isinstance(value, int) and not isinstance(value, bool)
            if not (type(value) is kind or numeric):
                raise ValueError(f"{f.name} must be {kind.__name__}, got {value!r}")
        # The engine's own checks (engine.decoding.limits), then what only the window has.
        check_method(self.method, allow_auto=True)
        check_int("K", self.k, 1, MAX_K)
        check_int("max new tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)
        check_int("seed", self.seed, -1, MAX_SEED, note=" (-1: a fresh seed per message)")
        check_int("tree nodes", self.tree_budget, 0, MAX_TREE_BUDGET, note=" (0 = by device)")
        check_text("the system prompt", self.system_prompt, MAX_SYSTEM_PROMPT)
        check_choice("context overflow", self.context_overflow, OVERFLOW_POLICIES)
        check_int("compare runs", self.compare_runs, 1, MAX_COMPARE_RUNS)
        SamplingParams(self.temperature, self.top_k, self.top_p)
        self.model_settings()  # the model sources, device, dtype, CPU kernels (ModelSettings' own checks)

    def model_settings(self) -> ModelSettings:
        draft = self.draft.strip() or None
        target = self.target.strip() or "default"
        extra = tuple(line.strip() for line in self.drafter_folders.splitlines() if line.strip())
        return ModelSettings(
            target=target,
            draft=None if self.method in TARGET_ONLY_METHODS else draft,
            heads=(shipped_heads(target) + extra) if extra else (),  # (): the shipped ones for the default
            device=self.device,
            dtype=self.dtype,
            cpu_kernels=self.cpu_kernels,
            tree_budget=self.tree_budget or None,
            skip_unfit=True,
        )

    def conversation(self, turns: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        """The (role, text) turns a model is sent: the system prompt, when there is one, then `turns`."""
        system = self.system_prompt.strip()
        return ((("system", system),) if system else ()) + tuple(turns)

    def generation_config(self, method: str | None = None) -> GenerationConfig:
        return GenerationConfig(
            method=method or self.method,
            k=self.k,
            sampling=SamplingParams(self.temperature, self.top_k, self.top_p),
            max_new_tokens=self.max_new_tokens,
            seed=None if self.seed < 0 else self.seed,
            adaptive_k=self.adaptive_k,
        )

    @classmethod
    def from_dict(cls, data: dict) -> tuple[AppSettings, tuple[str, ...]]:
        """Build from a (possibly old or hand-edited) mapping, key by key: a bad value keeps that
        setting's default and the others are kept. Returns the settings and one line per value
        ignored; keys this version does not know are passed over silently (older or newer files)."""
        settings, ignored = cls(), []
        for f in fields(cls):
            if f.name in data:
                try:
                    settings = replace(settings, **{f.name: data[f.name]})
                except ValueError as exc:
                    ignored.append(f"{f.name} = {data[f.name]!r}: {exc}")
        return settings, tuple(ignored)


def needs_reload(loaded: ModelSettings | None, wanted: ModelSettings) -> bool:
    """True when `wanted` cannot run on the engine loaded with `loaded`.

    A loaded draft model is kept for ar/lookup messages so switching methods back and forth does
    not reload anything."""
    if loaded is None:
        return True
    same_target = (loaded.target, loaded.device, loaded.dtype, loaded.cpu_kernels, loaded.tree_budget,
                   loaded.heads) == (
        wanted.target,
        wanted.device,
        wanted.dtype,
        wanted.cpu_kernels,
        wanted.tree_budget,  # the head drafters are built for one tree size at load
        wanted.heads,
    )
    if not same_target:
        return True
    return wanted.draft is not None and wanted.draft != loaded.draft


def config_dir() -> Path:
    override = os.environ.get("SPECLENS_CONFIG_DIR")
    return Path(override) if override else Path(platformdirs.user_config_dir("speclens"))


class SettingsStore:
    """AppSettings as TOML in the user config folder; writes are atomic (temp file + rename)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or config_dir() / "settings.toml"
        self.problems: tuple[str, ...] = ()  # what the last load could not use, for the window to say

    def load(self) -> AppSettings:
        """The stored settings (defaults where there are none). A file that cannot be read, or has
        values that cannot be used, is first copied to settings.toml.bak: the next save rewrites it."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            self.problems = ()
            return AppSettings()
        except OSError as exc:
            self.problems = (f"could not read it: {exc}",)
            return AppSettings()
        try:
            settings, self.problems = AppSettings.from_dict(tomllib.loads(raw.decode("utf-8")))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            settings, self.problems = AppSettings(), (f"not valid TOML ({exc}); every setting is at its default",)
        if self.problems:
            backup = self.path.with_suffix(".toml.bak")
            try:
                backup.write_bytes(raw)
                self.problems += (f"the file as it was is kept as {backup}",)
            except OSError:
                pass
        return settings

    def save(self, settings: AppSettings) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".toml.tmp")
        tmp.write_text(tomli_w.dumps(asdict(settings)), encoding="utf-8")
        os.replace(tmp, self.path)


@dataclass(frozen=True)
class CatalogEntry:
    label: str
    target: str
    draft: str = ""


CATALOG: tuple[CatalogEntry, ...] = (
    CatalogEntry("Embedded default: SmolLM2-135M-Instruct (GGUF, offline)", "default"),
    CatalogEntry(
        "SmolLM2-1.7B-Instruct + SmolLM2-135M-Instruct",
        "HuggingFaceTB/SmolLM2-1.7B-Instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    CatalogEntry(
        "SmolLM2-360M-Instruct + SmolLM2-135M-Instruct",
        "HuggingFaceTB/SmolLM2-360M-Instruct",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    CatalogEntry(
        "Qwen2.5-7B-Instruct + Qwen2.5-0.5B-Instruct",
        "Qwen/Qwen2.5-7B-Instruct",
        "Qwen/Qwen2.5-0.5B-Instruct",
    ),
    CatalogEntry(
        "Qwen2.5-1.5B-Instruct + Qwen2.5-0.5B-Instruct",
        "Qwen/Qwen2.5-1.5B-Instruct",
        "Qwen/Qwen2.5-0.5B-Instruct",
    ),
    CatalogEntry(
        "Llama-3.1-8B-Instruct + Llama-3.2-1B-Instruct",
        "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Llama-3.2-1B-Instruct",
    ),
)
CUSTOM_LABEL = "Custom (hub id, local folder or GGUF file)"


class _SourceEdit(QWidget):
    """A model source: hub id typed in, or a local folder / GGUF file picked."""

    def __init__(self, placeholder: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.edit = QLineEdit()
        self.edit.setPlaceholderText(placeholder)
        folder = QPushButton("Folder…")
        gguf = QPushButton("GGUF…")
        folder.clicked.connect(self._pick_folder)
        gguf.clicked.connect(self._pick_gguf)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.edit, 1)
        row.addWidget(folder)
        row.addWidget(gguf)

    def _pick_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Model folder")
        if path:
            self.edit.setText(path)

    def _pick_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "GGUF model", "", "GGUF models (*.gguf)")
        if path:
            self.edit.setText(path)


class SettingsDialog(QDialog):
    """Edits an AppSettings. `check_requested` asks the owner to load the pair and answer with
    `show_report` (and `set_methods`), so the compatibility report is seen before the pair is used.

    `methods` are the loaded engine's methods; `steps` the last answer's StepEvents, which feed the
    speedup advisor."""

    check_requested = Signal(object)  # AppSettings

    def __init__(
        self,
        settings: AppSettings,
        parent: QWidget | None = None,
        methods: tuple[str, ...] | None = None,
        steps: tuple[StepEvent, ...] = (),
        steps_source: str = "",
        verify_shape: StepCost | None = None,
    ) -> None:
        super().__init__(parent)
        self.setWindowTitle("SpecLens settings")
        self.setMinimumWidth(620)
        self._steps, self._steps_source = tuple(steps), steps_source
        self._verify_shape = verify_shape

        self.pair = QComboBox()
        for entry in CATALOG:
            self.pair.addItem(entry.label, entry)
        self.pair.addItem(CUSTOM_LABEL, None)
        self.target = _SourceEdit("default, a hub id, a folder or a .gguf file")
        self.method = QComboBox()
        self.method.setToolTip("The methods the loaded models offer; “Check pair” refreshes the list.")
        self.draft = _SourceEdit("draft model: hub id, folder or .gguf (draft-model methods)")
        self.k = QSpinBox(minimum=1, maximum=MAX_K)
        self.adaptive_k = QCheckBox("Adapt K while generating (+2 after a fully accepted draft, −1 otherwise)")
        self.adaptive_k.setToolTip("K above is then the largest draft length. Output stays exact.")
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.1, decimals=2)
        self.temperature.setSpecialValueText("0 (greedy)")
        self.top_k = QSpinBox(minimum=0, maximum=1000)
        self.top_k.setSpecialValueText("off")
        self.top_p = QDoubleSpinBox(minimum=0.01, maximum=1.0, singleStep=0.05, decimals=2)
        self.seed = QSpinBox(minimum=-1, maximum=MAX_SEED)
        self.seed.setSpecialValueText("random")
        self.max_new_tokens = QSpinBox(minimum=1, maximum=MAX_NEW_TOKENS, singleStep=64)
        self.device = QComboBox()
        self.device.addItems(DEVICES)
        self.dtype = QComboBox()
        self.dtype.addItems(DTYPES)
        self.cpu_kernels = QComboBox()
        for name in CPU_KERNELS:
            self.cpu_kernels.addItem(CPU_KERNEL_LABELS.get(name, name), name)
        self.cpu_kernels.setToolTip("How a float32 model computes on a CPU. Integer rounds activations to 8 bits "
                                    "(as llama.cpp does; top-1 agreement with float32 is measured by `speclens "
                                    "bench --kernel-agreement`) and verifies drafts at a fraction of the cost. "
                                    "Speculative output stays exactly that of plain decoding on the same kernels.")
        self.system_prompt = QPlainTextEdit()
        self.system_prompt.setPlaceholderText("Empty: the model's own default (from its chat template)")
        self.system_prompt.setToolTip("Sent before every conversation's messages, from the next message on")
        self.system_prompt.setFixedHeight(58)
        self.context_overflow = QComboBox()
        for name in OVERFLOW_POLICIES:
            self.context_overflow.addItem(OVERFLOW_LABELS[name], name)
        self.context_overflow.setToolTip("What happens when a conversation no longer leaves the answer room in the "
                                         "model's context. Dropping is shown in a banner when it happens.")
        self.compare_runs = QSpinBox(minimum=1, maximum=MAX_COMPARE_RUNS)
        self.compare_runs.setToolTip("Runs of each side the Compare tab times, interleaved plain / speculative; it "
                                     "reports the medians and races the median runs")
        self.drafter_folders = QPlainTextEdit()
        self.drafter_folders.setPlaceholderText("More drafter folders, one per line (EAGLE-1 / EAGLE-3 / DFlash / "
                                                "Medusa heads, a datastore)")
        self.drafter_folders.setToolTip("Beside the ones shipped for the default model. Each is checked against the "
                                        "target when it loads: one made for another model is left out, and the "
                                        "Compatibility report says why.")
        self.drafter_folders.setFixedHeight(46)
        add_folder = QPushButton("Add folder…")
        add_folder.clicked.connect(self._add_drafter_folder)
        drafters = QWidget()
        drafters_row = QHBoxLayout(drafters)
        drafters_row.setContentsMargins(0, 0, 0, 0)
        drafters_row.addWidget(self.drafter_folders, 1)
        drafters_row.addWidget(add_folder, 0, Qt.AlignmentFlag.AlignTop)
        self.tree_budget = QSpinBox(minimum=0, maximum=MAX_TREE_BUDGET)
        self.tree_budget.setSpecialValueText("auto (CPU: up to 4, as many as pay; GPU: 32)")
        self.tree_budget.setToolTip("Tokens the EAGLE and Medusa trees draft per step. Bigger trees are "
                                    "accepted further but cost more to verify, which a CPU feels and a GPU hardly "
                                    "does. Auto on a CPU verifies, at each step, only the nodes likely enough to "
                                    "be accepted to pay for themselves; a number here is verified whole.")

        models = QGroupBox("Models")
        model_form = QFormLayout(models)
        model_form.addRow("Known pair", self.pair)
        model_form.addRow("Target", self.target)
        model_form.addRow("Drafter", self.method)
        model_form.addRow("Draft model", self.draft)
        model_form.addRow("Device", self.device)
        model_form.addRow("Precision", self.dtype)
        model_form.addRow("CPU kernels", self.cpu_kernels)
        model_form.addRow("Tree nodes", self.tree_budget)
        model_form.addRow("Drafter folders", drafters)

        decoding = QGroupBox("Decoding (applies from the next message)")
        decoding_form = QFormLayout(decoding)
        decoding_form.addRow("Draft length K", self.k)
        decoding_form.addRow("", self.adaptive_k)
        decoding_form.addRow("Temperature", self.temperature)
        decoding_form.addRow("Top-k", self.top_k)
        decoding_form.addRow("Top-p", self.top_p)
        decoding_form.addRow("Seed", self.seed)
        decoding_form.addRow("Max new tokens", self.max_new_tokens)
        decoding_form.addRow("System prompt", self.system_prompt)
        decoding_form.addRow("Context full", self.context_overflow)
        decoding_form.addRow("Compare runs", self.compare_runs)

        self.report = QPlainTextEdit(readOnly=True)
        self.report.setPlaceholderText("Press “Check pair” to load the models and see whether they fit.")
        self.report.setMaximumHeight(120)
        self.check = QPushButton("Check pair")
        self.check.clicked.connect(lambda: self.check_requested.emit(self.settings()))
        self.error = QLabel()
        self.error.setStyleSheet("color: #b00020;")
        self.error.setWordWrap(True)
        compat = QGroupBox("Compatibility")
        compat_layout = QVBoxLayout(compat)
        compat_layout.addWidget(self.report)
        compat_layout.addWidget(self.check, 0, Qt.AlignmentFlag.AlignRight)

        self.advisor = AdvisorPanel(MAX_K)
        self.advisor.apply_requested.connect(self.k.setValue)
        self.k.valueChanged.connect(self._refresh_advisor)
        advisor_box = QGroupBox("Speedup advisor (from the last answer's measured steps)")
        advisor_layout = QVBoxLayout(advisor_box)
        advisor_layout.addWidget(self.advisor)

        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self._accept_if_valid)
        buttons.rejected.connect(self.reject)

        left = QVBoxLayout()
        left.addWidget(models)
        left.addWidget(decoding)
        left.addWidget(compat)
        columns = QHBoxLayout()
        columns.addLayout(left, 3)
        columns.addWidget(advisor_box, 2)
        layout = QVBoxLayout(self)
        layout.addLayout(columns)
        layout.addWidget(self.error)
        layout.addWidget(buttons)

        self.set_methods(methods or FALLBACK_METHODS, settings.method)
        self.set_settings(settings)
        self.pair.activated.connect(self._apply_pair)
        self.method.currentIndexChanged.connect(self._sync_enabled)

    def set_methods(self, methods: tuple[str, ...] | list[str], keep: str | None = None) -> None:
        """Offer `methods` (the loaded engine's), plus `keep` (or the current choice) so a stored
        setting is never silently replaced."""
        keep = keep or self.method.currentData()
        offered = list(dict.fromkeys(methods))
        if keep and keep not in offered:
            offered.append(keep)
        self.method.blockSignals(True)
        self.method.clear()
        for method in offered:
            self.method.addItem(method_label(method), method)
        self.method.blockSignals(False)
        self._select_method(keep or offered[0])

    def set_measurement(self, steps: tuple[StepEvent, ...], source: str = "") -> None:
        self._steps, self._steps_source = tuple(steps), source
        self._refresh_advisor()

    def set_settings(self, s: AppSettings) -> None:
        self.target.edit.setText(s.target)
        self.draft.edit.setText(s.draft)
        self._select_method(s.method)
        self.k.setValue(s.k)
        self.adaptive_k.setChecked(s.adaptive_k)
        self.temperature.setValue(s.temperature)
        self.top_k.setValue(s.top_k)
        self.top_p.setValue(s.top_p)
        self.seed.setValue(s.seed)
        self.max_new_tokens.setValue(s.max_new_tokens)
        if self.device.findText(s.device) < 0:  # cuda:N from settings.toml
            self.device.addItem(s.device)
        self.device.setCurrentText(s.device)
        self.context_overflow.setCurrentIndex(max(0, self.context_overflow.findData(s.context_overflow)))
        self.compare_runs.setValue(s.compare_runs)
        self.dtype.setCurrentText(s.dtype)
        self.cpu_kernels.setCurrentIndex(max(0, self.cpu_kernels.findData(s.cpu_kernels)))
        self.tree_budget.setValue(s.tree_budget)
        self.system_prompt.setPlainText(s.system_prompt)
        self.drafter_folders.setPlainText(s.drafter_folders)
        match = [i for i, e in enumerate(CATALOG) if (e.target, e.draft) == (s.target, s.draft)]
        match = match or [i for i, e in enumerate(CATALOG) if e.target == s.target]
        self.pair.setCurrentIndex(match[0] if match else len(CATALOG))
        self._sync_enabled()
        self._refresh_advisor()

    def settings(self) -> AppSettings:
        """The edited settings; raises ValueError when they do not validate."""
        return AppSettings(
            target=self.target.edit.text().strip() or "default",
            method=self.method.currentData(),
            draft=self.draft.edit.text().strip(),
            k=self.k.value(),
            temperature=self.temperature.value(),
            top_k=self.top_k.value(),
            top_p=self.top_p.value(),
            seed=self.seed.value(),
            max_new_tokens=self.max_new_tokens.value(),
            device=self.device.currentText(),
            dtype=self.dtype.currentText(),
            cpu_kernels=self.cpu_kernels.currentData(),
            adaptive_k=self.adaptive_k.isChecked(),
            tree_budget=self.tree_budget.value(),
            system_prompt=self.system_prompt.toPlainText().strip(),
            context_overflow=self.context_overflow.currentData(),
            compare_runs=self.compare_runs.value(),
            drafter_folders=self.drafter_folders.toPlainText().strip(),
        )

    def _add_drafter_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Drafter folder")
        if path:
            lines = [line for line in self.drafter_folders.toPlainText().splitlines() if line.strip()]
            self.drafter_folders.setPlainText("\n".join([*lines, path]))

    def show_report(self, ok: bool | None, lines: tuple[str, ...] | list[str],
                    drafters: tuple[str, ...] | list[str] = ()) -> None:
        """ok None: a single model, no pair to check; `drafters`: one line per drafter folder (fits or why not)."""
        verdict = {True: "✓ The pair is compatible.", False: "✗ The pair is not usable as it is.",
                   None: "✓ Loaded (one model: no draft model to check against it)."}[ok]
        heading = ["", "Drafter folders:"] if drafters else []
        self.report.setPlainText("\n".join([verdict, *lines, *heading, *drafters]))

    def _select_method(self, method: str) -> None:
        index = self.method.findData(method)
        if index < 0:
            self.method.addItem(method_label(method), method)
            index = self.method.count() - 1
        self.method.setCurrentIndex(index)

    def _refresh_advisor(self) -> None:
        self.advisor.set_measurement(self._steps, self._steps_source, current_k=self.k.value(),
                                     verify_shape=self._verify_shape)

    def _apply_pair(self, index: int) -> None:
        entry = self.pair.itemData(index)
        if entry is None:
            return
        self.target.edit.setText(entry.target)
        self.draft.edit.setText(entry.draft)
        if entry.draft:
            self._select_method("draft")
        self.report.clear()

    def _sync_enabled(self) -> None:
        self.draft.setEnabled(self.method.currentData() not in TARGET_ONLY_METHODS)

    def _accept_if_valid(self) -> None:
        try:
            self.settings()
        except ValueError as exc:
            self.error.setText(str(exc))
            return
        self.accept()


def with_overrides(settings: AppSettings, **changes: object) -> AppSettings:
    """A copy with the given fields replaced, skipping the ones left as None (command-line flags)."""
    return replace(settings, **{k: v for k, v in changes.items() if v is not None})
