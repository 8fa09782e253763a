"""Which drafter folders fit a target, and why others do not, from their config.json alone.

A drafter folder (EAGLE-1, EAGLE-3, DFlash or Medusa heads, or a datastore) is trained for one target:
its width, vocabulary and the target layers it reads must match. `drafter_fit` says so in one phrase
without loading weights, for `speclens doctor` and the window's Settings (which leaves unfitting
folders out and says why); loading a folder checks the same again on the weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from speclens.engine.drafters.datastore import is_datastore
from speclens.engine.drafters.dflash import default_target_layers, is_dflash
from speclens.engine.drafters.eagle3 import default_feature_layers, is_eagle3


@dataclass(frozen=True)
class DrafterFit:
    folder: str
    kind: str  # EAGLE-1, EAGLE-3, DFlash, Medusa, datastore, or "?" when unreadable
    fits: bool
    reason: str  # what was checked (fits) or what does not match (does not)

    def line(self) -> str:
        mark = "fits" if self.fits else "does not fit"
        return f"{Path(self.folder).name} ({self.kind}): {mark}: {self.reason}"


def drafter_fit(folder: str | Path, target_config, target_name: str = "the target") -> DrafterFit:
    """Whether the drafter in `folder` fits a target with this (HF) config."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return DrafterFit(str(folder), "?", False, f"no readable config.json ({type(exc).__name__})")
    text = target_config.get_text_config()
    width, vocab, layers = text.hidden_size, text.vocab_size, text.num_hidden_layers
    if is_datastore(config):
        made_for = config.get("target")
        ok = made_for in (None, target_name)
        return DrafterFit(str(folder), "datastore", ok, f"answers of {made_for or 'an unnamed target'}"
                          + ("" if ok else f", not {target_name}"))
    if "medusa_num_heads" in config:
        kind, checks = "Medusa", [("width", config.get("hidden_size"), width), ("vocabulary", config.get("vocab_size"), vocab)]
    elif is_dflash(config):
        extra = config.get("dflash_config") or {}
        ids = tuple(extra.get("target_layer_ids") or config.get("target_layer_ids")
                    or default_target_layers(layers, int(config.get("num_hidden_layers", 1))))
        mask = extra.get("mask_token_id", config.get("mask_token_id"))
        kind = "DFlash"
        checks = [("width", config.get("target_hidden_size") or config.get("hidden_size"), width),
                  ("target layers", ids, ids if all(0 <= i < layers for i in ids) else f"0..{layers - 1}"),
                  ("mask token", mask, mask if isinstance(mask, int) and 0 <= mask < vocab else f"0..{vocab - 1}")]
    elif is_eagle3(config):
        ids = tuple(config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids") or default_feature_layers(layers))
        kind = "EAGLE-3"
        checks = [("width", config.get("target_hidden_size") or config.get("hidden_size"), width),
                  ("vocabulary", config.get("vocab_size"), vocab),
                  ("hidden-state layers", ids, ids if all(0 <= i <= layers for i in ids) else f"0..{layers}")]
    elif "hidden_size" in config:
        kind, checks = "EAGLE-1", [("width", config.get("hidden_size"), width), ("vocabulary", config.get("vocab_size"), vocab)]
    else:
        return DrafterFit(str(folder), "?", False, "its config.json names no known drafter kind")
    wrong = [f"{what} {own}, {target_name} has {want}" for what, own, want in checks if own != want]
    if wrong:
        return DrafterFit(str(folder), kind, False, "; ".join(wrong))
    return DrafterFit(str(folder), kind, True, ", ".join(f"{what} {own}" for what, own, _ in checks))
