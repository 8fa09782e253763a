import json

import numpy as np
import pytest
import torch

from speclens.engine.runtime.models import ModelLoadError, check_pair, load_model
from speclens.engine.session import Engine, EngineError, ModelSettings
from speclens.engine.tools.cli import main
from tests.tiny import loaded, tiny_llama, tiny_tokenizer


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_llama(seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_cli_jsonl_output(model_folder, capsys):
    rc = main(["generate", "--target", str(model_folder), "--prompt", "one two three one two",
               "--method", "lookup", "-k", "3", "--max-new-tokens", "12", "--jsonl"])
    assert rc == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tokens, summary = lines[:-1], lines[-1]
    assert len(tokens) == 12 and all(t["type"] == "token" for t in tokens)
    assert {t["source"] for t in tokens} <= {"draft_accepted", "target_resampled", "bonus", "target"}
    assert all((t["proposer"] == "lookup") == (t["source"] == "draft_accepted") for t in tokens)
    assert sum(summary["accepted_by"].values()) == sum(t["source"] == "draft_accepted" for t in tokens)
    assert summary["accepted"] > 0  # the repeated prompt gives lookup something to accept
    assert summary["type"] == "summary" and summary["new_tokens"] == 12
    for key in ("steps", "drafted", "accepted", "mean_accepted_length", "tokens_per_s"):
        assert key in summary
    assert summary["mean_accepted_length"] == pytest.approx(12 / summary["steps"])


def test_cli_draft_model_matches_plain(model_folder, capsys):
    outputs = []
    for extra in (["--method", "ar"], ["--draft", str(model_folder)]):
        assert main(["generate", "--target", str(model_folder), "--prompt", "speculative decoding",
                     "--max-new-tokens", "10", "--jsonl", *extra]) == 0
        outputs.append([json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()[:-1]])
    assert outputs[0] == outputs[1]


def test_cli_head_and_tree_methods_match_plain_with_the_same_jsonl(model_folder, tmp_path, capsys):
    """`generate --method {eagle,eagle_chain,medusa} --drafter DIR` and `--method tree --draft MODEL` print
    the same JSONL as the other methods, and greedy, the same tokens as plain decoding."""
    from speclens.engine.drafters.eagle import EagleHead
    from speclens.engine.drafters.medusa import MedusaHeads

    target = tiny_llama(seed=0)
    torch.manual_seed(4)
    EagleHead.for_target(target.config).save(tmp_path / "eagle")
    MedusaHeads(target.config.hidden_size, target.config.vocab_size, num_heads=3).save(tmp_path / "medusa")
    common = ["generate", "--target", str(model_folder), "--prompt", "one two three one two", "-k", "3",
              "--max-new-tokens", "16", "--jsonl"]
    runs = {}
    for name, extra in {"ar": ["--method", "ar"],
                        # an asked budget is verified whole: a CPU would cut random heads' trees to nothing
                        "eagle": ["--method", "eagle", "--drafter", str(tmp_path / "eagle"), "--tree-budget", "6"],
                        "eagle_chain": ["--method", "eagle_chain", "--drafter", str(tmp_path / "eagle")],
                        "medusa": ["--method", "medusa", "--drafter", str(tmp_path / "medusa"), "--tree-budget", "6"],
                        "tree": ["--method", "tree", "--draft", str(model_folder)]}.items():
        assert main(common + extra) == 0, name
        runs[name] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    keys = {name: (frozenset(tuple(sorted(t)) for t in lines[:-1]), tuple(sorted(lines[-1]))) for name, lines in runs.items()}
    assert len(set(keys.values())) == 1, keys  # one token schema and one summary schema for every method
    ids = {name: [t["id"] for t in lines[:-1]] for name, lines in runs.items()}
    assert all(ids[name] == ids["ar"] for name in ids), ids
    assert all(runs[name][-1]["drafted"] > 0 for name in ("eagle", "eagle_chain", "medusa", "tree")), {n: r[-1]["drafted"] for n, r in runs.items()}


def test_a_system_prompt_enters_the_chat_template_or_is_refused_clearly(model_folder, capsys):
    engine = Engine.load(ModelSettings(str(model_folder)))
    tokenizer = engine.target.tokenizer
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tokenizer.decode(engine.encode_chat(turns)) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    args = ["generate", "--target", str(model_folder), "--prompt", "hi", "--method", "ar", "--max-new-tokens", "3",
            "--jsonl", "--system", "Be brief."]
    assert main(args) == 2 and "--system needs --chat" in capsys.readouterr().err
    assert main([*args, "--chat"]) == 0 and json.loads(capsys.readouterr().out.splitlines()[-1])["new_tokens"] == 3
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")  # as Gemma's template does
    with pytest.raises(EngineError, match="does not take a system prompt.*System role not supported"):
        engine.encode_chat(turns)
    assert tokenizer.decode(engine.encode_chat(turns[1:])) == "hi"  # without one the same template works


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="No model at"):
        load_model(str(tmp_path / "nowhere" / "model"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_corrupt_model_is_a_clear_error(tmp_path, model_folder):
    for item in model_folder.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 100)
    with pytest.raises(ModelLoadError, match="Could not load"):
        load_model(str(tmp_path))


def test_a_damaged_gguf_file_is_a_clear_error(tmp_path):
    import gguf

    whole = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(whole), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:50])  # a download that stopped early
    for damaged in (cut, tmp_path / "noise.gguf"):
        if damaged.name == "noise.gguf":
            damaged.write_bytes(bytes(range(256)) * 40)
        with pytest.raises(ModelLoadError, match="is not a valid, complete GGUF file"):
            load_model(str(damaged))


def test_cli_reports_load_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--target", str(tmp_path / "missing"), "--prompt", "hi"])
    assert exit_info.value.code == 2
    assert "No model at" in capsys.readouterr().err


def test_incompatible_pair_is_refused_with_reasons():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel()
    other.train_from_iterator(["completely different text " * 50],
                              trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False))
    other_tok = PreTrainedTokenizerFast(tokenizer_object=other, eos_token="</s>")
    draft = loaded(tiny_llama(seed=1, layers=1), "other-draft")
    draft.tokenizer = other_tok
    report = check_pair(loaded(tiny_llama(seed=0), "tiny-target"), draft)
    assert not report.ok
    assert any("Tokenizers differ in size" in line for line in report.lines)
    with pytest.raises(EngineError, match="cannot draft for"):
        Engine(loaded(tiny_llama(seed=0), "tiny-target"), draft)


def test_padding_ids_are_never_sampled():
    n_tokens = len(tiny_tokenizer())
    target = tiny_llama(seed=0, vocab=n_tokens + 32)
    with torch.no_grad():
        target.lm_head.weight[n_tokens:] = 0.0
        target.lm_head.bias = None
        target.lm_head.weight[n_tokens:, 0] = 1e4  # padding rows would dominate if not masked
    engine = Engine(loaded(target, "padded"), loaded(tiny_llama(seed=1, layers=1, vocab=n_tokens + 32), "d"))
    assert engine.compatibility.ok and engine.compatibility.n_vocab == n_tokens
    from speclens.engine.decoding.decode import GenerationConfig
    from speclens.engine.decoding.sampling import SamplingParams

    config = GenerationConfig(method="draft", max_new_tokens=30, sampling=SamplingParams(temperature=1.0), seed=0)
    summary = list(engine.generate_ids([5, 6, 7], config))[-1]
    assert max(summary.token_ids) < n_tokens
