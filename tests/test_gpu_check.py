"""The GPU device check (packaging/gpu_check.py) in its tiny CPU mode: every step runs through the
engine and the benchmark, and the JSON holds what the README's GPU section reports."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "packaging" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_tiny_cpu_mode_runs_every_part_and_writes_json(tmp_path, capsys):
    gpu_check = load_script()
    assert gpu_check.main(["--tiny", "--device", "cpu", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    big = report["8B shape, synthetic drafter"]
    assert "failed" not in big and big["runtime"] == "static-cache forward"
    assert set(big["verify_ms"]) == {"1", "2", "3", "5", "9"}
    for k in (4, 8):
        rows = big[f"k{k}"]
        assert rows["ar"]["tokens_per_s"] > 0
        for a in gpu_check.ACCEPTANCES:
            row = rows[f"synthetic@{a}"]
            assert row["E"] == gpu_check.expected_tokens(a, k) and 0 <= row["identical_share"] <= 1
            assert row["ceiling"] > 0 and row["speedup"] > 0
    costs = big["head_step_cost"]
    assert set(costs) == {"eagle1_shaped", "eagle3_shaped"} and all(c["c"] > 0 for c in costs.values())
    default = report["embedded default, shipped heads"]
    assert "failed" not in default and default["runtime"] == "native lean forward"
    assert {"eagle", "medusa", "lookup"} <= set(default["methods"])
    for name, result in default["methods"].items():  # the native path is batch invariant: all identical
        assert result["identical_share"] == 1.0, name
    assert (tmp_path / "random-k4.md").exists() and (tmp_path / "default.md").exists()
    assert "static-cache forward" in capsys.readouterr().out


def test_expected_tokens_is_leviathans_formula():
    gpu_check = load_script()
    assert gpu_check.expected_tokens(0.8, 4) == pytest.approx(1 + 0.8 + 0.8**2 + 0.8**3 + 0.8**4)
    assert gpu_check.expected_tokens(1.0, 4) == 5.0 and gpu_check.expected_tokens(0.0, 4) == 1.0
