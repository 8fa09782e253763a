"""The retrieval datastore: what it proposes, how it is stored, and that drafting from it stays exact."""

import pytest
import torch

from speclens.engine.decoding.decode import GenerationConfig
from speclens.engine.decoding.events import Summary, TokenEvent
from speclens.engine.drafters.datastore import Datastore, DatastoreDrafter
from speclens.engine.drafters.trees import DraftModelTreeDrafter, LookupGraftedDrafter
from speclens.engine.runtime.cache import CachedModel
from speclens.engine.session import Engine, EngineError
from tests.test_tree import _prompt_ids, _run
from tests.tiny import hf_greedy, loaded, tiny_llama


def test_most_frequent_continuation_of_the_longest_matching_tail():
    store = Datastore.build([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [9, 2, 3, 6, 7]])
    assert store.continuation([1, 2, 3], 3) == [4]  # 4 twice, 5 once; the sequences end after it
    assert store.continuation([9, 2, 3], 3) == [6, 7]  # the 3-token tail picks the one sequence
    assert store.continuation([8, 2, 3], 3) == [4]  # no [8, 2, 3]: the tail [2, 3] has 4, 4, 5, 6
    assert store.continuation([5, 2], 2) == [3, 4]  # after [2]: 3 every time, then the most frequent
    assert store.continuation([1, 2, 3], 0) == []
    assert store.continuation([8], 3) == []  # an id in range that the store never saw
    assert store.continuation([42], 3) == [] and store.continuation([-3], 3) == []  # ids no key can hold


def test_a_tail_whose_matches_all_end_falls_back_to_a_shorter_one():
    store = Datastore.build([[5, 6], [6, 7]])
    assert store.continuation([5, 6], 2) == [7]  # [5, 6] ends its answer; after [6], 7 follows


def test_keys_that_fill_all_63_bits_do_not_overflow():
    store = Datastore.build([list(range(7))] * 3)  # ids up to 7 after the +1: 3 bits, 21 tokens per key
    assert store.bits * store.ngram == 63
    assert store.continuation([6], 2) == [] and store.continuation([5], 3) == [6]
    assert Datastore.build([[1, 2], [5]]).continuation([6], 2) == []  # the widest id in a 3-bit key, unseen


def test_an_empty_datastore_is_refused():
    for sequences in ([], [[]], [[], []]):
        with pytest.raises(ValueError, match="at least one stored token"):
            Datastore.build(sequences)


def test_a_datastore_of_a_wider_vocabulary_is_refused(tmp_path):
    target = tiny_llama()
    Datastore.build([[1, target.config.vocab_size + 5]]).save(tmp_path, target="a bigger model")
    with pytest.raises(EngineError, match="built for another model"):
        Engine(loaded(target, "tiny-target"), heads=(str(tmp_path),))


def test_continuations_never_cross_into_the_next_sequence():
    store = Datastore.build([[5, 6], [7, 8, 9]])
    assert store.continuation([5, 6], 3) == []  # 6 ends its sequence; 7 belongs to the next one
    assert store.continuation([5], 3) == [6]


def test_a_chain_follows_only_the_matches_that_agree_so_far():
    store = Datastore.build([[1, 2, 3]] * 2 + [[1, 4, 5]] * 3 + [[2, 6]] * 4)
    # after 1: 4 (three times) beats 2 (twice); after [1, 4], only 5 follows, although 6 follows 2 more often
    assert store.continuation([1], 2) == [4, 5]


def test_wide_vocabularies_pack_fewer_tokens_per_key():
    big = 200_000  # 18 bits per token: three tokens per int64 key
    store = Datastore.build([[big, big - 1, big - 2, big - 3], [7, big - 1, big - 2, 11]])
    assert store.ngram == 3
    assert store.continuation([big, big - 1, big - 2], 1) == [big - 3]
    assert store.continuation([7, big - 1, big - 2], 1) == [11]


def test_save_and_load_round_trip(tmp_path):
    store = Datastore.build([[3, 1, 4, 1, 5], [9, 2, 6]])
    store.save(tmp_path, target="tiny")
    loaded = Datastore.load(tmp_path)
    assert loaded.tokens.tolist() == store.tokens.tolist() and loaded.sequences == 2
    assert loaded.continuation([1], 2) == store.continuation([1], 2)


def test_a_corrupt_datastore_is_a_clear_error(tmp_path):
    Datastore.build([[1, 2]]).save(tmp_path)
    (tmp_path / "datastore.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(EngineError, match="Could not load the datastore"):
        Engine(loaded(tiny_llama(), "tiny-target"), heads=(str(tmp_path),))


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(seed=0)


def _store_from_greedy(model, n=60):
    """A datastore holding the target's own greedy continuation of other prompts and of this one's tail."""
    answers = [hf_greedy(model, [7, 3, 11, 2], n), hf_greedy(model, _prompt_ids()[-3:], n)]
    return Datastore.build(answers)


def test_rest_and_grafted_datastore_greedy_equal_plain_decoding(target_model):
    n = 40
    reference = hf_greedy(target_model, _prompt_ids(), n)
    store = _store_from_greedy(target_model)
    draft = tiny_llama(seed=1, layers=1)
    drafters = [
        DatastoreDrafter(store),
        LookupGraftedDrafter(DraftModelTreeDrafter(CachedModel(draft), None, top_k=2, budget=4), "tree_lookup", store),
    ]
    for drafter in drafters:
        events, summary = _run(CachedModel(target_model), drafter, GenerationConfig(k=4, max_new_tokens=n))
        assert isinstance(summary, Summary)
        assert list(summary.token_ids) == reference, drafter.name
        # every accepted draft token names its proposer; the target's own tokens name none
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert all((t.proposer is not None) == (t.source == "draft_accepted") for t in tokens)
        by = dict(summary.accepted_by)
        assert sum(by.values()) == sum(t.source == "draft_accepted" for t in tokens) == summary.accepted
        assert by.get("rest", 0) > 0  # the store's continuations were accepted, not only proposed
        assert set(by) <= {"rest", "lookup", "tree"}


def test_a_wrong_datastore_costs_acceptance_not_exactness(target_model):
    n = 30
    reference = hf_greedy(target_model, _prompt_ids(), n)
    generator = torch.Generator().manual_seed(0)
    noise = torch.randint(0, target_model.config.vocab_size, (3, 80), generator=generator).tolist()
    _, summary = _run(CachedModel(target_model), DatastoreDrafter(Datastore.build(noise)),
                      GenerationConfig(k=4, max_new_tokens=n))
    assert list(summary.token_ids) == reference


def test_train_drafter_builds_a_datastore_of_the_distilled_answers(tmp_path, target_model):
    import json

    from speclens.engine.tools.cli import main
    from tests.tiny import tiny_tokenizer

    model_dir = tmp_path / "tiny-target"
    target_model.save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"one two three {i}" for i in range(7)))
    out = tmp_path / "store"
    assert main(["train-drafter", "--kind", "datastore", "--target", str(model_dir), "--prompts", str(prompts),
                 "--out", str(out), "--held-out", "2", "--answer-tokens", "8", "--eval-tokens", "8",
                 "--batch-size", "3"]) == 0
    distilled = torch.load(out / "distilled.pt", weights_only=True)
    answers = [s["tokens"][int(s["answer_start"]):].tolist() for s in distilled]
    assert len(answers) == 5 and all(answers)
    store = Datastore.load(out)
    assert store.tokens.tolist() == [t for a in answers for t in (*a, -1)]
    card = (out / "README.md").read_text()
    assert "Retrieval datastore" in card and "tau on held-out prompts, the datastore alone" in card
    assert set(json.loads((out / "training.json").read_text())["tau"]) == {"rest", "lookup"}

    engine = Engine(loaded(target_model, "tiny-target"), heads=(str(out),))
    assert "rest" in engine.methods and engine.drafter("rest").store.tokens.tolist() == store.tokens.tolist()
    import shutil

    shutil.copytree(out, tmp_path / "second")
    with pytest.raises(EngineError, match="at most one datastore"):
        Engine(loaded(target_model, "tiny-target"), heads=(str(out), str(tmp_path / "second")))


def test_eagle_lookup_grafts_the_datastore_it_is_given(tmp_path, target_model):
    from speclens.engine.drafters.eagle import EagleHead

    head_dir, store_dir = tmp_path / "eagle", tmp_path / "store"
    EagleHead.for_target(target_model.config).save(head_dir)
    Datastore.build([[1, 2, 3]]).save(store_dir)
    with_store = Engine(loaded(target_model, "tiny-target"), heads=(str(head_dir), str(store_dir)))
    without = Engine(loaded(target_model, "tiny-target"), heads=(str(head_dir),))
    assert with_store.drafter("eagle_lookup").store is with_store.drafter("rest").store
    assert without.drafter("eagle_lookup").store is None and "rest" not in without.methods
