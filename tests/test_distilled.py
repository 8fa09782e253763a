"""Distilled data as committed token-id shards: round trip, size cap, damage, reruns, and training from them."""

import json

import pytest
import torch
from safetensors.numpy import save_file

from speclens.engine.tools.train.shards import (
    MAX_SHARD_BYTES,
    DistilledSequence,
    read_all,
    read_shard,
    run_id,
    shard_paths,
    write_shards,
)
from tests.tiny import tiny_llama as tiny_model
from tests.tiny import tiny_tokenizer


def _sequences(n, length=7, top=300):
    return [DistilledSequence(tuple((i * 31 + j * 7) % top for j in range(length + i % 3)), 2 + i % 2,
                              0.0 if i % 2 == 0 else 0.7) for i in range(n)]


def test_shards_round_trip_token_ids_answer_starts_and_temperatures(tmp_path):
    rows = _sequences(9)
    paths = write_shards(tmp_path, rows, "run-a", {"target": "tiny"})
    assert [p.name for p in paths] == ["run-a-0000.safetensors"]
    back, meta = read_shard(paths[0])
    assert back == rows
    assert meta["target"] == "tiny" and meta["run"] == "run-a"
    from safetensors import safe_open

    with safe_open(str(paths[0]), framework="numpy") as f:
        assert str(f.get_tensor("tokens").dtype) == "uint16"  # 2 bytes a token while the vocabulary fits


def test_a_large_vocabulary_is_stored_as_uint32(tmp_path):
    rows = [DistilledSequence((5, 70_000, 3), 1, 0.0)]
    back, _ = read_shard(write_shards(tmp_path, rows, "big", {})[0])
    assert back == rows


def test_shards_are_cut_at_the_size_cap_and_a_rerun_keeps_other_runs(tmp_path):
    rows = _sequences(50, length=20)
    paths = write_shards(tmp_path, rows, "r1", {"target": "t"}, max_bytes=200)
    assert len(paths) > 5 and all(p.stat().st_size < 200 + 1024 for p in paths)
    other = write_shards(tmp_path, _sequences(3), "r2", {"target": "t"})
    everything, metas = read_all([tmp_path])
    assert everything == rows + _sequences(3)
    assert {m["run"] for m in metas} == {"r1", "r2"}
    # a rerun of r1 that now fits in one part removes its own stale parts, never r2's
    write_shards(tmp_path, rows[:2], "r1", {"target": "t"})
    assert [p.name for p in shard_paths([tmp_path])] == ["r1-0000.safetensors", other[0].name]
    assert read_all([tmp_path], skip_run="r1")[0] == _sequences(3)
    assert read_all([tmp_path], target="other")[0] == []
    assert MAX_SHARD_BYTES < 20 * 10**6  # committed files stay under 20 MB


def test_foreign_and_damaged_files_are_refused_with_their_name(tmp_path):
    import numpy as np

    save_file({"x": np.zeros(3, dtype=np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="other.safetensors: not a SpecLens distilled-data shard"):
        read_shard(tmp_path / "other.safetensors")
    save_file({"tokens": np.zeros(4, dtype=np.uint16), "offsets": np.array([0, 9]),
               "answer_start": np.zeros(1, dtype=np.int32), "temperature": np.zeros(1, dtype=np.float64)},
              str(tmp_path / "bad.safetensors"), metadata={"format": "speclens-distilled-1"})
    with pytest.raises(ValueError, match="bad.safetensors: damaged shard"):
        read_shard(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="run name"):
        write_shards(tmp_path, _sequences(1), "../escape", {})


def test_run_id_is_stable_and_depends_on_the_settings():
    assert run_id({"a": 1, "b": [2]}) == run_id({"b": [2], "a": 1})
    assert run_id({"a": 1}) != run_id({"a": 2})


def test_train_drafter_writes_shards_and_trains_on_every_shard(tmp_path):
    from speclens.engine.tools.cli import main

    model = tiny_model(seed=0)
    model_dir = tmp_path / "tiny-target"
    model.save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"instruction": f"Count to {i}."}) for i in range(6)))
    shards = tmp_path / "shards"
    base = ["train-drafter", "--kind", "eagle", "--target", str(model_dir), "--prompts", str(prompts),
            "--answer-tokens", "5", "--batch-size", "4", "--shards", str(shards)]
    # a first run distils greedy and sampled answers into shards and stops
    assert main(base + ["--out", str(tmp_path / "d1"), "--held-out", "0", "--sampled-answers", "1",
                        "--sample-temperatures", "0.9", "--distil-only"]) == 0
    first = shard_paths([shards])
    assert len(first) == 1
    rows, meta = read_shard(first[0])
    distilled = torch.load(tmp_path / "d1" / "distilled-ids.pt", weights_only=True)  # ids only: no features
    assert len(rows) == len(distilled) == 12 and "features" not in distilled[0]
    assert not (tmp_path / "d1" / "distilled.pt").exists()
    assert sorted(r.temperature for r in rows) == [0.0] * 6 + [pytest.approx(0.9)] * 6
    assert {r.tokens for r in rows} == {tuple(s["tokens"].tolist()) for s in distilled}
    assert "--distil-only" in meta["command"] and "--shards data/distilled/shards" in meta["command"]
    # a training run on other prompts adds its own shard and trains on both runs' sequences
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps({"instruction": f"Name {i} colours."}) for i in range(5)))
    out = tmp_path / "head"
    argv = [other if a == str(prompts) else a for a in base]
    assert main([str(a) for a in argv] + ["--out", str(out), "--held-out", "2", "--epochs", "1", "--eval-tokens", "0",
                                          "--seed", "5"]) == 0
    assert len(shard_paths([shards])) == 2
    record = json.loads((out / "training.json").read_text())
    assert record["run"]["n_samples"] == [3, 12]  # its own 3 answers + the 12 of the first run's shard
    # a rerun of the first prompts with another seed makes no greedy answer the shards already hold
    assert main(base + ["--out", str(tmp_path / "d2"), "--held-out", "0", "--seed", "9", "--distil-only"]) == 0
    assert len(shard_paths([shards])) == 2 and len(read_shard(first[0])[0]) == 12


def test_features_recomputed_from_a_shard_equal_the_distilled_ones(tmp_path):
    from speclens.engine.tools.train import distil as train

    model = tiny_model(seed=0)
    sequences = [DistilledSequence(tuple(range(3, 3 + n)), 2, 0.0) for n in (4, 9, 6)]
    samples = train.shard_samples(model, sequences, pad=0, batch_size=2, first_prompt=10)
    assert [int(s["prompt"]) for s in samples] == [10, 11, 12]
    for seq, sample in zip(sequences, samples):
        assert sample["tokens"].tolist() == list(seq.tokens)
        with torch.inference_mode():
            fresh = model(input_ids=torch.tensor([seq.tokens]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(sample["features"].float(), fresh, atol=0.05, rtol=0.02)


def test_a_distillation_stopped_midway_keeps_its_answers_in_shards(tmp_path, monkeypatch):
    from speclens.engine.tools.cli import main
    from speclens.engine.tools.train import distil

    model_dir = tmp_path / "tiny-target"
    tiny_model(seed=0).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"instruction": f"Count to {i}."}) for i in range(8)))
    monkeypatch.setattr(distil, "IDS_SAVE_EVERY_S", 0.0)  # save after every batch
    real_batch, calls = distil._distil_batch, []

    def killed_after_two(*args, **kwargs):
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt  # Ctrl-C, or the session ending
        return real_batch(*args, **kwargs)

    monkeypatch.setattr(distil, "_distil_batch", killed_after_two)
    shards = tmp_path / "shards"
    argv = ["train-drafter", "--kind", "eagle", "--target", str(model_dir), "--prompts", str(prompts),
            "--answer-tokens", "4", "--batch-size", "2", "--shards", str(shards), "--out", str(tmp_path / "run"),
            "--held-out", "0", "--distil-only"]
    assert main(argv) == 130
    (shard,) = shard_paths([shards])
    rows, _ = read_shard(shard)
    assert len(rows) == 4  # the two batches that finished
    monkeypatch.setattr(distil, "_distil_batch", real_batch)
    assert main(argv) == 0  # a rerun resumes, and its shard then holds all eight
    (shard,) = shard_paths([shards])
    assert len(read_shard(shard)[0]) == 8
    kept = shard.read_bytes()
    # the resumable state lost (a new session's /tmp): a rerun writes beside the shard, never over it,
    # and makes none of the answers it holds again
    (tmp_path / "run" / "distilled-ids.pt").unlink()
    monkeypatch.setattr(distil, "_distil_batch", lambda *a, **k: pytest.fail("an answer was made again"))
    assert main(argv) == 0
    assert shard_paths([shards]) == [shard] and shard.read_bytes() == kept
