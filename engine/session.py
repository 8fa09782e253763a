"""The engine a front end talks to: loaded models, drafters, chat template, generation.

One `Engine` lives as long as its models. It keeps the target's KV cache between calls, so the next
turn of a conversation only prefills what is new.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from speclens.engine.decoding.decode import GenerationConfig, generate
from speclens.engine.decoding.drafter import Drafter, StepCost
from speclens.engine.decoding.events import Event
from speclens.engine.decoding.limits import (
    DTYPES,
    MAX_TREE_BUDGET,
    OVERFLOW_POLICIES,
    SettingError,
    check_choice,
    check_device,
    check_int,
    check_text,
)
from speclens.engine.decoding.prompt import Fitted, PromptError, clean_text, fit_ids, fit_turns
from speclens.engine.decoding.tree import CHAIN_PATHS, DEFAULT_TREE_PATHS, TreeDrafter, TreeShape
from speclens.engine.drafters.datastore import Datastore, DatastoreDrafter, is_datastore
from speclens.engine.drafters.draft_model import DraftModelDrafter
from speclens.engine.drafters.folders import drafter_fit
from speclens.engine.drafters.lookup import PromptLookupDrafter
from speclens.engine.drafters.trees import DraftModelTreeDrafter, LookupGraftedDrafter
from speclens.engine.runtime.cache import CachedModel
from speclens.engine.runtime.cpu_kernels import integer_target, native_kernel_of
from speclens.engine.runtime.models import (
    CPU_KERNELS,
    DEFAULT_MODEL,
    CompatReport,
    LoadedModel,
    LoadOptions,
    ModelLoadError,
    Progress,
    _no_progress,
    check_pair,
    load_model,
)

SHIPPED_HEADS = Path(__file__).resolve().parent.parent / "resources" / "drafters"
# Heads trained for the embedded default target, shipped in resources/ (see their model cards).
DEFAULT_HEADS = ("eagle-smollm2-135m", "medusa-smollm2-135m", "datastore-smollm2-135m")
# Preferred method when the user names none: the strongest one the loaded models offer. `rest`
# (a datastore alone) is left out: prompt lookup, always there, was faster in every benchmark.
PREFERENCE = ("eagle_lookup", "eagle", "medusa", "tree", "draft", "lookup", "ar")


# What loading a corrupt or mismatched weights file raises (safetensors has its own error type).
UNREADABLE_WEIGHTS = (OSError, RuntimeError, KeyError, ValueError, SafetensorError)

MAX_SOURCE_CHARS = 4096  # a model's source: a path or a hub id


def shipped_heads(target: str) -> tuple[str, ...]:
    """The drafter folders shipped for `target` (the default model's; none for others)."""
    if target != DEFAULT_MODEL:
        return ()
    return tuple(str(SHIPPED_HEADS / name) for name in DEFAULT_HEADS if (SHIPPED_HEADS / name).exists())


class EngineError(RuntimeError):
    """Anything that stops the engine from doing what was asked; the message is meant for users."""


@dataclass(frozen=True)
class ModelSettings:
    target: str = DEFAULT_MODEL
    draft: str | None = None  # a draft model's source, for methods "draft" and "tree"
    heads: tuple[str, ...] = ()  # folders of EAGLE or Medusa heads; () = the shipped ones for the default
    device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    offload: bool = False
    cpu_kernels: str = "auto"  # runtime.models.CPU_KERNELS: auto | integer | native | packed | stock
    tree_budget: int | None = None  # draft-tree nodes for the head methods; None: by device (tree_budget)
    skip_unfit: bool = False  # drafter folders made for another target are left out (drafter_report), not an error

    def __post_init__(self) -> None:  # the same checks wherever the settings come from (limits)
        check_text("target", self.target, MAX_SOURCE_CHARS)
        if not self.target.strip():
            raise SettingError("target must name a model: 'default', a folder, a .gguf file or a hub id")
        if self.draft is not None:
            check_text("draft", self.draft, MAX_SOURCE_CHARS)
        if not isinstance(self.heads, tuple):
            raise SettingError(f"heads must be a tuple of folders, got {self.heads!r}")
        for folder in self.heads:
            check_text("drafter folder", folder, MAX_SOURCE_CHARS)
        check_device(self.device)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("cpu_kernels", self.cpu_kernels, CPU_KERNELS)
        for name in ("trust_remote_code", "offload", "skip_unfit"):
            if not isinstance(getattr(self, name), bool):
                raise SettingError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.tree_budget is not None:
            check_int("tree budget", self.tree_budget, 1, MAX_TREE_BUDGET, note=" nodes")


class Engine:
    def __init__(self, target: LoadedModel, draft: LoadedModel | None = None, heads: tuple[str, ...] = (),
                 budget: int | None = None, skip_unfit: bool = False):
        self.target = target
        self.draft = draft
        self.compatibility: CompatReport | None = check_pair(target, draft) if draft else None
        if self.compatibility is not None and not self.compatibility.ok:
            raise EngineError(
                f"{draft.name} cannot draft for {target.name}:\n" + "\n".join(self.compatibility.lines)
            )
        rows = target.model.config.get_text_config().vocab_size
        n_vocab = self.compatibility.n_vocab if self.compatibility else min(len(target.tokenizer), rows)
        self.target_lm = CachedModel(target.model, n_vocab)
        self.lookup_cost = measure_lookup_cost(self.target_lm)
        self._drafters: dict[str, Drafter | TreeDrafter] = {"lookup": PromptLookupDrafter(step_cost=self.lookup_cost)}
        if draft is not None:
            self._drafters["draft"] = DraftModelDrafter(CachedModel(draft.model, n_vocab))
            self._drafters["tree"] = DraftModelTreeDrafter(
                CachedModel(draft.model, n_vocab), TreeShape.from_paths(DEFAULT_TREE_PATHS)
            )
        # Each drafter folder against this target, from its config (engine/drafters/folders.py); with
        # skip_unfit (the window) one made for another target is left out and reported, else loading says why.
        self.drafter_report = tuple(drafter_fit(folder, target.model.config, target.name) for folder in heads)
        if skip_unfit:
            heads = tuple(fit.folder for fit in self.drafter_report if fit.fits)
        configs = {Path(folder): _folder_config(Path(folder)) for folder in heads}
        stores = [folder for folder, config in configs.items() if is_datastore(config)]
        if len(stores) > 1:
            raise EngineError(f"Give at most one datastore folder, not {len(stores)}: {', '.join(map(str, stores))}.")
        store = _load_datastore(stores[0]) if stores else None
        if store is not None:
            if store.max_token >= n_vocab:
                raise EngineError(
                    f"The datastore in {stores[0]} holds token id {store.max_token}, past {target.name}'s "
                    f"vocabulary of {n_vocab}: it was built for another model ({configs[stores[0]].get('target', '?')})."
                )
            self._drafters["rest"] = DatastoreDrafter(store)
        for folder, config in configs.items():
            if not is_datastore(config):
                self._drafters.update(
                    _head_drafters(folder, config, self.target_lm, tree_budget(target.device, budget), store,
                                   head_step_cost(target.device, budget),
                                   self.lookup_cost if budget is None else None))
        self.eos_ids = _eos_ids(target)

    def remeasure_lookup_cost(self) -> None:
        """Measure prompt lookup's step cost again (measure_lookup_cost), as after the thread count changed
        (the bench's --threads): for its cut and for eagle_lookup's, where that one has it."""
        measured = measure_lookup_cost(self.target_lm)
        for drafter in self._drafters.values():
            if isinstance(drafter, PromptLookupDrafter):
                drafter.step_cost = measured
            if isinstance(drafter, LookupGraftedDrafter) and drafter.lookup_cost is not None:
                drafter.lookup_cost = measured
        self.lookup_cost = measured

    @classmethod
    def load(cls, settings: ModelSettings, progress: Progress | None = None) -> Engine:
        progress = progress or _no_progress
        options = LoadOptions(settings.device, settings.dtype, settings.trust_remote_code, settings.offload,
                              settings.cpu_kernels)
        try:
            target = load_model(settings.target, options, progress)
            draft = load_model(settings.draft, options, progress) if settings.draft else None
        except ModelLoadError as exc:
            raise EngineError(str(exc)) from exc
        heads = settings.heads or shipped_heads(settings.target)
        return cls(target, draft, heads, settings.tree_budget, settings.skip_unfit)

    @property
    def default_method(self) -> str:
        return next(m for m in PREFERENCE if m in self.methods)

    @property
    def methods(self) -> tuple[str, ...]:
        return ("ar", *self._drafters)

    @contextmanager
    def extra_drafter(self, method: str, drafter: Drafter | TreeDrafter) -> Iterator[None]:
        """Offer `drafter` as `method` for the duration (the benchmark's synthetic drafters)."""
        self._drafters[method] = drafter
        try:
            yield
        finally:
            del self._drafters[method]

    def drafter(self, method: str) -> Drafter | TreeDrafter | None:
        if method == "ar":
            return None
        if method not in self._drafters:
            raise EngineError(f"Method {method!r} is not available here; choose one of {', '.join(self.methods)}.")
        return self._drafters[method]

    def describe(self) -> str:
        t = self.target
        kernels = "" if native_kernel_of(t.model) is None else (
            (", integer kernels: 16-bit activations" if t.model.get_output_embeddings().residual
             else ", integer kernels: 8-bit activations") if integer_target(t.model) else ", native kernels")
        text = f"{t.name} ({t.device.type}, {str(t.dtype).removeprefix('torch.')}{kernels})"
        return text + (f" + draft {self.draft.name}" if self.draft else "")

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of `messages` ({"role", "content"}: system, user, assistant) in the target's chat
        template, ready for the assistant's turn. EngineError when the template refuses a system turn."""
        from jinja2 import TemplateError

        tokenizer = self.target.tokenizer
        if getattr(tokenizer, "chat_template", None):
            try:
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except TemplateError as exc:  # some templates raise for a role they do not take
                if any(m["role"] == "system" for m in messages):
                    raise EngineError(f"{self.target.name}'s chat template does not take a system prompt ({exc}). "
                                      "Leave the system prompt empty for this model.") from exc
                raise
        else:
            text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_text(self, prompt: str) -> list[int]:
        return self.target.tokenizer(clean_text(prompt)[0])["input_ids"]

    @property
    def context_length(self) -> int | None:
        """Tokens the target's context holds (None where its config does not say)."""
        return self.target_lm.context_length

    def fit_chat(self, messages: list[dict[str, str]], max_new_tokens: int, policy: str = "stop") -> Fitted:
        """`messages` encoded to leave the answer room in the context, by the overflow policy
        (limits.OVERFLOW_POLICIES); EngineError when it refuses. Invalid text becomes U+FFFD."""
        check_choice("context overflow policy", policy, OVERFLOW_POLICIES)
        messages = [{**m, "content": clean_text(m["content"])[0]} for m in messages]
        try:
            return fit_turns(messages, self.encode_chat, self.context_length, max_new_tokens, policy)
        except PromptError as exc:
            raise EngineError(str(exc)) from exc

    def fit_text(self, prompt: str, max_new_tokens: int, policy: str = "stop") -> Fitted:
        """A plain-text prompt's ids, made to fit as fit_chat does (drop_oldest keeps the newest tokens)."""
        check_choice("context overflow policy", policy, OVERFLOW_POLICIES)
        try:
            ids = self.encode_text(prompt)
            bos = self.target.tokenizer.bos_token_id
            keep_first = 1 if ids and bos is not None and ids[0] == bos else 0  # the BOS token stays first
            return fit_ids(ids, self.context_length, max_new_tokens, policy, keep_first)
        except PromptError as exc:
            raise EngineError(str(exc)) from exc

    def chat(
        self, messages: list[dict[str, str]], config: GenerationConfig, cancel: threading.Event | None = None
    ) -> Iterator[Event]:
        return self.generate_ids(self.encode_chat(messages), config, cancel)

    def generate_ids(
        self, prompt_ids: list[int], config: GenerationConfig, cancel: threading.Event | None = None
    ) -> Iterator[Event]:
        return generate(
            self.target_lm,
            self.target.tokenizer,
            prompt_ids,
            config,
            drafter=self.drafter(config.method),
            eos_ids=self.eos_ids,
            cancel=cancel,
        )


def _folder_config(folder: Path) -> dict:
    config_file = folder / "config.json"
    if not config_file.exists():
        raise EngineError(f"{folder} holds no config.json: not a folder of EAGLE or Medusa heads or a datastore.")
    try:
        return json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise EngineError(f"Could not read {config_file}: {exc}") from exc


def _load_datastore(folder: Path) -> Datastore:
    try:
        return Datastore.load(folder)
    except UNREADABLE_WEIGHTS as exc:
        raise EngineError(f"Could not load the datastore in {folder}: {exc}") from exc


# eagle_lookup's grafted chains: lookup continuations of 8 tokens and datastore ones of 2 beat chains
# of the draft depth (4) at both tree budgets in interleaved runs on the Spec-Bench dev prompts (4 nodes,
# on an AMD EPYC: 1.66x against 1.58x plain, tau 2.59 against 2.49; 32 nodes: tau 3.24 against 3.09),
# as copied spans run long and set phrases short.
LOOKUP_CHAIN_TOKENS = 8
STORE_CHAIN_TOKENS = 2
# On a CPU the head methods' trees keep only the nodes worth their cost (keep_worthwhile): a step costs
# CPU_STEP_ROWS verified rows' worth besides its nodes. With the target's decoder on 4-bit blocks and its
# LM head on 8-bit blocks, a one-token forward no longer waits on memory and every verified node costs
# nearly a row of arithmetic, while drafting and the root's row cost a few rows. In a sweep of 2-8 on our
# own prompts (resources/prompts/bench.jsonl, two cores, two interleaved rounds; README, "Choosing the
# tree's nodes") 3-4 ran fastest for eagle_lookup (4: 1.03-1.04x plain decoding, against 0.89x for the
# fixed cut to 2 nodes before it) and 4-5 for eagle. A GPU verifies a few dozen tokens at about the cost of
# one: no cut there. An asked tree budget is kept whole, so tau at a budget can be measured on any device.
CPU_STEP_ROWS = 4.0
# Prompt lookup drafts for free, so what a step with its chain costs is the target's forward over the
# chain and the root. On a CPU that curve is measured when the models load (measure_lookup_cost: forwards
# of 1 .. LOOKUP_COST_TOKENS tokens, about a quarter of a second) and cuts the chain (K becomes a maximum);
# eagle_lookup verifies a lookup chain worth verifying at that cost alone, without its head. Against the
# fixed 2.5 rows besides the chain that it replaced (README, "Choosing the tree's nodes"), interleaved in
# one process, two rounds each: `lookup` 1.24-1.26x plain decoding against 1.15x on our own prompts and
# 1.30x against 1.24x on the Spec-Bench dev prompts; eagle_lookup unchanged (1.24-1.26x against 1.25x,
# 1.28-1.29x against 1.29-1.30x). A head's trees keep CPU_STEP_ROWS: a curve of forwards alone misses
# what drafting them costs, and kept too many nodes there (1.11-1.13x against 1.21-1.24x).
LOOKUP_COST_TOKENS = 9  # chains of up to 8 tokens are timed; longer ones extrapolate the curve
# A target whose one-token forward takes longer than this (a model many times the default's size) would
# take seconds to time: its chain is cut at the fixed LOOKUP_CPU_STEP_ROWS rows besides it instead, the
# constant the measured cost replaced (such a forward waits on memory, where extra tokens come cheap).
LOOKUP_TIMING_LIMIT_S = 0.05
LOOKUP_CPU_STEP_ROWS = 2.5


def head_step_cost(device: torch.device, asked_budget: int | None = None) -> StepCost | None:
    """What the head methods' trees are cut by (None: no cut): CPU_STEP_ROWS rows besides their nodes, on a
    CPU unless a tree budget was asked."""
    return StepCost.linear(CPU_STEP_ROWS) if device.type == "cpu" and asked_budget is None else None


def measure_lookup_cost(target: CachedModel, rounds: int = 3) -> StepCost | None:
    """Prompt lookup's step cost on a CPU (None elsewhere: a GPU verifies a chain at about the cost of one
    token): the target's forward over n + 1 tokens for a chain of n, timed now over a context of 64
    tokens (medians of `rounds`), made rising and convex (StepCost.measured); for a target too slow to
    time quickly, LOOKUP_CPU_STEP_ROWS rows besides the chain. The target's cache is left empty."""
    if target.device.type != "cpu":
        return None
    context = [1 + i % max(target.n_vocab - 1, 1) for i in range(64)]
    try:
        if target.time_forwards(context[:2], (1,), rounds=1)[1] > LOOKUP_TIMING_LIMIT_S:
            return StepCost.linear(LOOKUP_CPU_STEP_ROWS)
        seconds = target.time_forwards(context, range(1, LOOKUP_COST_TOKENS + 1), rounds)
    finally:
        target.reset()
    return StepCost.measured([seconds[t] for t in range(1, LOOKUP_COST_TOKENS + 1)])


def _head_drafters(folder: Path, config: dict, target: CachedModel, budget: int, store: Datastore | None,
                   cost: StepCost | None, lookup_cost: StepCost | None) -> dict[str, TreeDrafter]:
    """The methods a folder of trained heads adds: EAGLE (dynamic tree, chain, tree with the lookup
    chains grafted in, prompt lookup's and the datastore's when there is one) or Medusa; trees of
    `budget` nodes, cut to the nodes worth verifying at `cost` (keep_worthwhile; not the chain), and the
    grafted tree skips the head where lookup's chain alone is worth verifying at `lookup_cost`."""
    from speclens.engine.drafters.dflash import DFlashHead, is_dflash
    from speclens.engine.drafters.eagle import EagleDrafter, EagleHead
    from speclens.engine.drafters.eagle3 import Eagle3Head, is_eagle3
    from speclens.engine.drafters.medusa import MedusaDrafter, MedusaHeads, sparse_tree_paths

    text_config = target.model.config.get_text_config()
    try:
        if "medusa_num_heads" in config:
            heads = MedusaHeads.load(folder, text_config.hidden_size, text_config.vocab_size)
            # a sparse tree of `budget` nodes fitted to the heads' measured accuracy, when training saved it
            accuracy = heads.config.get("medusa_rank_accuracy")
            if accuracy:
                paths = sparse_tree_paths(accuracy, budget)
            else:
                paths = heads.config.get("medusa_choices") or DEFAULT_TREE_PATHS
            return {"medusa": MedusaDrafter(heads, target, TreeShape.from_paths(paths), step_cost=cost)}
        if is_dflash(config):
            return _dflash_drafters(folder, DFlashHead.load(folder), target)
        if is_eagle3(config):
            head3 = Eagle3Head.load(folder)
        else:
            head = EagleHead.load(folder)
    except UNREADABLE_WEIGHTS as exc:
        raise EngineError(f"Could not load the heads in {folder}: {exc}") from exc
    if is_eagle3(config):
        return _eagle3_drafters(folder, head3, target, budget, cost)
    for what, own, target_value in (("width", head.config.hidden_size, text_config.hidden_size),
                                     ("vocabulary", head.config.vocab_size, text_config.vocab_size)):
        if own != target_value:
            raise EngineError(f"The EAGLE head in {folder} has {what} {own}, the target {target_value}: "
                              "it was trained for another model.")
    tree = EagleDrafter(head, target, top_k=eagle_top_k(budget), budget=budget, step_cost=cost)
    return {
        "eagle": tree,
        "eagle_chain": EagleDrafter(head, target, shape=TreeShape.from_paths(CHAIN_PATHS), name="eagle_chain"),
        "eagle_lookup": LookupGraftedDrafter(tree, "eagle_lookup", store, LOOKUP_CHAIN_TOKENS, STORE_CHAIN_TOKENS, cost,
                                             lookup_cost),
    }


def _dflash_drafters(folder: Path, head, target: CachedModel) -> dict[str, Drafter]:
    """The method a DFlash head adds: `dflash`, a chain of up to block_size - 1 tokens from one forward."""
    from speclens.engine.drafters.dflash import DFlashDrafter

    text_config = target.model.config.get_text_config()
    layers = head.layer_ids_for(text_config.num_hidden_layers)
    problems = [f"reads a target of width {head.target_hidden_size}, this one has {text_config.hidden_size}"
                if head.target_hidden_size != text_config.hidden_size else "",
                f"reads target layers {layers}, this target has {text_config.num_hidden_layers}"
                if any(not 0 <= i < text_config.num_hidden_layers for i in layers) else "",
                f"uses mask token {head.mask_token_id}, past this target's {text_config.vocab_size} embeddings"
                if not 0 <= head.mask_token_id < text_config.vocab_size else ""]
    problem = next((p for p in problems if p), None)
    if problem:
        raise EngineError(f"The DFlash drafter in {folder} {problem}: it was trained for another model.")
    return {"dflash": DFlashDrafter(head, target)}


def _eagle3_drafters(folder: Path, head, target: CachedModel, budget: int,
                     cost: StepCost | None) -> dict[str, TreeDrafter]:
    """The methods an EAGLE-3 head adds: its dynamic tree (`eagle3`) and its chain (`eagle3_chain`)."""
    from speclens.engine.drafters.eagle3 import Eagle3Drafter

    text_config = target.model.config.get_text_config()
    for what, own, target_value in (("width", head.target_hidden_size, text_config.hidden_size),
                                    ("vocabulary", head.config.vocab_size, text_config.vocab_size)):
        if own != target_value:
            raise EngineError(f"The EAGLE-3 head in {folder} reads a target of {what} {own}, this one has "
                              f"{target_value}: it was trained for another model.")
    layers = head.layers_for(text_config.num_hidden_layers)
    if any(not 0 <= j <= text_config.num_hidden_layers for j in layers):  # hidden-state indices 0..L
        raise EngineError(f"The EAGLE-3 head in {folder} reads target layers {layers}; this target has "
                          f"{text_config.num_hidden_layers}: it was trained for another model.")
    return {
        "eagle3": Eagle3Drafter(head, target, top_k=eagle_top_k(budget), budget=budget, step_cost=cost),
        "eagle3_chain": Eagle3Drafter(head, target, shape=TreeShape.from_paths(CHAIN_PATHS), name="eagle3_chain"),
    }


def tree_budget(device: torch.device, asked: int | None = None) -> int:
    """Draft-tree nodes (besides the root) for the head methods: as asked, else by device. Verifying 33
    tokens cost 1.9 decode steps on a 2-core CPU (oneDNN-packed float32) and about 1 on an H200, so a
    CPU gets a small tree: budget 4 was the fastest of 4..32 in a sweep on our own prompts, the largest
    the highest tau (the shipped heads' cards); budgets 1..6 ran within noise of each other for
    eagle_lookup (1.19-1.25x plain in one interleaved run on the Spec-Bench dev prompts, two cores)."""
    if asked is not None:
        try:
            check_int("tree budget", asked, 1, MAX_TREE_BUDGET, note=" nodes")
        except SettingError as exc:
            raise EngineError(str(exc)) from exc
        return asked
    return 4 if device.type == "cpu" else 32


def eagle_top_k(budget: int) -> int:
    """Children per expanded node (and nodes expanded per depth) of the dynamic EAGLE tree for a budget:
    10 from 32 nodes, as EAGLE-2 grows its 60-token trees. On the Spec-Bench dev prompts with eagle13, 10
    against 8 gave tau 2.72 against 2.68 at 32 nodes and depth 4, and 2.93 against 2.89 at 64 nodes and
    depth 6 (README, "Wide trees")."""
    return 10 if budget >= 32 else 4 if budget >= 8 else 2


def _eos_ids(model: LoadedModel) -> tuple[int, ...]:
    ids: set[int] = set()
    if model.tokenizer.eos_token_id is not None:
        ids.add(int(model.tokenizer.eos_token_id))
    configured = getattr(getattr(model.model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    return tuple(sorted(ids))
