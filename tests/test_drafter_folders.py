"""Which drafter folders fit a target, from their configs (engine/drafters/folders.py), and what
`speclens doctor` says of them."""

from __future__ import annotations

import json

from speclens.engine.drafters.folders import drafter_fit
from speclens.engine.tools.doctor import drafter_rows
from tests.test_dflash import write_zlab_checkpoint
from tests.test_eagle3 import write_specforge_checkpoint
from tests.tiny import tiny_llama


def test_each_kind_is_told_apart_and_checked_against_the_target(tmp_path):
    target = tiny_llama(layers=4)
    write_specforge_checkpoint(tmp_path / "eagle3", target, layers=(1, 2, 4))
    write_zlab_checkpoint(tmp_path / "dflash", target)
    (tmp_path / "medusa").mkdir()
    (tmp_path / "medusa" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "hidden_size": 64,
                                                                 "vocab_size": target.config.vocab_size}))
    (tmp_path / "eagle1").mkdir()
    (tmp_path / "eagle1" / "config.json").write_text(json.dumps({"hidden_size": 576, "vocab_size": 49152}))
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "config.json").write_text(json.dumps({"speclens_datastore": 1, "target": "tiny"}))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    fits = {name: drafter_fit(tmp_path / name, target.config, "tiny")
            for name in ("eagle3", "dflash", "medusa", "eagle1", "store", "broken")}
    assert [fits[n].kind for n in fits] == ["EAGLE-3", "DFlash", "Medusa", "EAGLE-1", "datastore", "?"]
    assert [fits[n].fits for n in fits] == [True, True, True, False, True, False]
    assert fits["eagle1"].reason == "width 576, tiny has 64; vocabulary 49152, tiny has 400"
    assert fits["eagle3"].reason == "width 64, vocabulary 400, hidden-state layers (1, 2, 4)"
    assert not drafter_fit(tmp_path / "store", target.config, "another").fits
    shallow = tiny_llama(layers=2)  # the DFlash drafter reads the output of layer 2: past a 2-layer target
    assert drafter_fit(tmp_path / "dflash", shallow.config, "shallow").reason == "target layers (0, 2), shallow has 0..1"
    assert "no readable config.json" in fits["broken"].reason


def test_doctor_lists_the_shipped_drafters_and_the_ones_asked_for(tmp_path):
    target = tiny_llama(layers=4)
    target.save_pretrained(tmp_path / "target")
    write_specforge_checkpoint(tmp_path / "eagle3", target, layers=(1, 2, 3))
    write_zlab_checkpoint(tmp_path / "dflash-wide", tiny_llama(layers=4), hidden=32)
    rows = drafter_rows(str(tmp_path / "target"), (str(tmp_path / "eagle3"), str(tmp_path / "dflash-wide")))
    assert [(label, ok) for label, _, ok in rows] == [("drafter eagle3 (EAGLE-3)", True),
                                                       ("drafter dflash-wide (DFlash)", False)]
    assert rows[1][1] == "does not fit: width 32, target has 64"
    assert drafter_rows(str(tmp_path / "nowhere"), (str(tmp_path / "eagle3"),))[0][2] is False
