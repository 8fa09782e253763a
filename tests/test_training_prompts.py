"""The synthetic training prompts (resources/prompts/train-synthetic.jsonl) and their generator."""

import importlib.util
import json
from pathlib import Path

import pytest

from speclens.engine.tools.train.options import load_prompts

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "resources" / "prompts" / "train-synthetic.jsonl"
SPEC_BENCH = ROOT.parent / "shared" / "data" / "spec-bench" / "question_dev.jsonl"  # beside the project, here and in CI
SELF_PROMPTS = ROOT / "resources" / "prompts" / "self-prompts-smollm2.jsonl"


def _generator():
    spec = importlib.util.spec_from_file_location("make_training_prompts", ROOT / "packaging" / "make_training_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generator_is_seeded_and_varied():
    make = _generator()
    rows = make.build(seed=0)
    assert rows == make.build(seed=0)
    assert rows != make.build(seed=1)
    texts = [r["instruction"] for r in rows]
    assert len(texts) == len(set(texts)) >= 600
    assert {r["category"] for r in rows} >= {"writing", "coding", "maths", "translation", "passage", "roleplay"}


def test_shipped_prompts_load_for_training():
    prompts = load_prompts((str(SHIPPED),))
    assert len(prompts) == len(set(prompts)) >= 600
    assert prompts == [json.loads(line)["instruction"] for line in SHIPPED.read_text().splitlines()]


def test_new_seeds_add_only_new_prompts_and_training_counts_each_prompt_once(tmp_path, monkeypatch):
    make = _generator()
    out = tmp_path / "more.jsonl"
    monkeypatch.setattr("sys.argv", ["make", "--seed", "1", "--exclude", str(SHIPPED), "--out", str(out)])
    make.main()
    more = [json.loads(line)["instruction"] for line in out.read_text().splitlines()]
    shipped = set(load_prompts((str(SHIPPED),)))
    assert len(more) >= 300 and not shipped & set(more)
    assert load_prompts((str(SHIPPED), str(SHIPPED))) == load_prompts((str(SHIPPED),))  # duplicates dropped


def test_shipped_self_prompts_load_for_training():
    """The user turns the default target wrote for the shipped heads' training (train-drafter --self-prompts)."""
    prompts = load_prompts((str(SELF_PROMPTS),))
    assert len(prompts) == 32000 == len(SELF_PROMPTS.read_text().splitlines())


@pytest.mark.parametrize("shipped", [SHIPPED, SELF_PROMPTS], ids=lambda path: path.name)
def test_no_shipped_training_prompt_is_a_benchmark_prompt(shipped):
    """Heads trained on benchmark prompts would report a tau they never earned."""
    if not SPEC_BENCH.exists():
        pytest.skip(f"the Spec-Bench prompts are not beside this checkout ({SPEC_BENCH})")
    prompts = load_prompts((str(shipped),))
    turns = {turn.strip() for line in SPEC_BENCH.read_text().splitlines() if line.strip()
             for turn in json.loads(line)["turns"]}
    assert len(turns) >= 240 and prompts
    assert not turns & set(prompts)
    assert not any(turn in prompt or prompt in turn for turn in turns for prompt in prompts if len(turn) > 40)
