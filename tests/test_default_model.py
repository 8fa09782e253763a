"""Integration tests on the embedded default model (fetched from PyPI on first use, then cached)."""

import pytest
import torch

from speclens.engine.decoding.decode import GenerationConfig
from speclens.engine.decoding.events import Summary
from speclens.engine.runtime.native_kernels import native_build
from speclens.engine.session import Engine, ModelSettings

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    return Engine.load(ModelSettings())


def summary_of(engine, prompt_ids, method, k=4, n=64):
    events = list(engine.generate_ids(prompt_ids, GenerationConfig(method=method, k=k, max_new_tokens=n)))
    assert isinstance(events[-1], Summary)
    return events[-1]


def test_answers_the_obvious_question(engine):
    ids = engine.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in summary_of(engine, ids, "ar", n=20).text
    build = native_build()
    if build is not None and build.integer:  # auto picks the integer kernels where their check passes; the
        assert "integer kernels" in engine.describe()  # window and the logs say which run


@pytest.mark.parametrize("k", [2, 5])
def test_prompt_lookup_greedy_equals_plain_decoding(engine, k):
    ids = engine.encode_chat([{"role": "user", "content": "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."}])
    plain = summary_of(engine, ids, "ar")
    lookup = summary_of(engine, ids, "lookup", k=k)
    assert lookup.token_ids == plain.token_ids
    assert lookup.accepted > 0  # the repetition gives lookup something to accept


def test_multi_turn_reuses_cache_and_stays_exact(engine):
    first = [{"role": "user", "content": "Name a fruit."}]
    answer = summary_of(engine, engine.encode_chat(first), "lookup", n=16).text
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And a vegetable?"}]
    ids = engine.encode_chat(second)
    warm = summary_of(engine, ids, "lookup", n=24)
    engine.target_lm.reset()
    cold = summary_of(engine, ids, "ar", n=24)
    assert warm.token_ids == cold.token_ids


def test_every_method_greedy_equals_plain_decoding(engine):
    if native_build().integer:  # where the integer kernels passed their check, `auto` runs them: this is their test too
        assert engine.target.model.lm_head.integer and engine.target.model.model.layers[0].mlp.down_proj.integer
    assert {"eagle", "eagle_chain", "eagle_lookup", "medusa", "rest"} <= set(engine.methods)  # the shipped ones load
    assert engine.drafter("eagle_lookup").store is engine.drafter("rest").store  # the datastore is grafted too
    ids = engine.encode_chat([{"role": "user", "content": "List the days of the week."}])
    plain = summary_of(engine, ids, "ar", n=48)
    for method in engine.methods:
        result = summary_of(engine, ids, method, k=4, n=48)
        assert result.token_ids == plain.token_ids, method


def test_draft_model_methods_greedy_equal_plain_decoding_on_the_default_pair(engine):
    """`draft` and `tree` need a second model: the default model drafting for itself, which should accept
    nearly every draft, and must still give plain decoding's tokens."""
    from speclens.engine.runtime.models import DEFAULT_MODEL

    paired = Engine.load(ModelSettings(draft=DEFAULT_MODEL))
    assert {"draft", "tree"} <= set(paired.methods)
    ids = paired.encode_chat([{"role": "user", "content": "List the days of the week."}])
    plain = summary_of(engine, ids, "ar", n=32)
    for method in ("draft", "tree"):
        result = summary_of(paired, ids, method, k=4, n=32)
        assert result.token_ids == plain.token_ids, method
        assert result.accepted > 0, method


def test_verification_scores_every_token_exactly_as_plain_decoding(engine):
    """Where the native kernels are built the default model's forward is batch invariant: the logits of
    an eagle_lookup tree's nodes equal, bit for bit, those plain decoding computes for the same tokens,
    so at any temperature verification samples from exactly plain decoding's distributions."""
    from speclens.engine.drafters.trees import LookupGraftedDrafter
    from speclens.engine.runtime.cache import CachedModel
    from speclens.engine.runtime.cpu_kernels import native_kernel_of
    from speclens.engine.runtime.masks import ancestor_path
    from tests.native import native_or_skip

    native_or_skip()
    assert native_kernel_of(engine.target.model) is not None  # built, so the default model computes with it
    assert engine.target.model.config._attn_implementation == "speclens_native"
    ids = engine.encode_chat([{"role": "user", "content": "Write a short poem about the sea."}])
    target = CachedModel(engine.target.model, engine.target_lm.n_vocab)
    target.prefill(ids)
    shipped = engine.drafter("eagle_lookup")
    uncut = LookupGraftedDrafter(shipped.base, "eagle_lookup", shipped.store, shipped.lookup_tokens,
                                 shipped.store_tokens)  # the whole merged tree, not the CPU's few nodes
    tree = uncut.propose_tree(ids, 4, GenerationConfig().sampling, None)
    tokens, parents = tree.tokens.tolist(), list(tree.parents)
    assert len(tokens) > 4
    logits = target.forward_tree(ids, tokens, parents)  # [N, V]
    for node in range(len(tokens)):
        context = ids + [tokens[m] for m in ancestor_path(parents, node)]  # the node decoded after its path
        plain = CachedModel(engine.target.model, engine.target_lm.n_vocab)
        plain.prefill(context)
        assert torch.equal(plain.forward(context, [], 1)[0], logits[node]), node


@pytest.mark.parametrize("blocks", ["onednn", "mkl"])
def test_every_method_greedy_equals_plain_decoding_with_one_row_stock_kernels(blocks):
    """Plain decoding's single rows on stock F.linear, verification blocks on packed oneDNN or MKL
    kernels (what `auto` does where stock measures faster one row at a time, and MKL faster for
    blocks): greedy outputs still agree."""
    from speclens.engine.runtime.cpu_kernels import PackedLinear, mkl_blocks_work, pack_model, packed_kernels_work
    from speclens.engine.runtime.models import DEFAULT_MODEL, LoadOptions, load_model
    from speclens.engine.session import DEFAULT_HEADS, SHIPPED_HEADS

    if not packed_kernels_work(torch.float32):
        pytest.skip("no oneDNN packed linear in this torch")
    if blocks == "mkl" and not mkl_blocks_work():
        pytest.skip("no MKL packed linear in this torch")
    target = load_model(DEFAULT_MODEL, LoadOptions(device="cpu", dtype="float32", cpu_kernels="stock"))
    assert pack_model(target.model, one_row="stock", blocks=blocks)
    layers = [m for m in target.model.modules() if isinstance(m, PackedLinear)]
    assert all(m.one_row_stock and m.mkl_blocks == (blocks == "mkl") for m in layers)
    mixed = Engine(target, None, tuple(str(SHIPPED_HEADS / name) for name in DEFAULT_HEADS))
    prompts = ["List the days of the week.", "Write a short poem about the sea."]
    for prompt in prompts:
        ids = mixed.encode_chat([{"role": "user", "content": prompt}])
        plain = summary_of(mixed, ids, "ar", n=48)
        for method in mixed.methods:
            result = summary_of(mixed, ids, method, k=4, n=48)
            assert result.token_ids == plain.token_ids, (prompt, method)


def test_head_methods_use_the_device_tree_budget(engine, monkeypatch):
    from speclens.engine.decoding.drafter import StepCost
    from speclens.engine.session import (
        CPU_STEP_ROWS,
        LOOKUP_COST_TOKENS,
        LOOKUP_CPU_STEP_ROWS,
        EngineError,
        eagle_top_k,
        head_step_cost,
        tree_budget,
    )

    assert tree_budget(torch.device("cpu")) == 4 and tree_budget(torch.device("cuda")) == 32
    assert tree_budget(torch.device("cpu"), 16) == 16
    assert tree_budget(torch.device("cpu"), 128) == 128
    for wrong in (0, 129):
        with pytest.raises(EngineError, match="1..128"):
            tree_budget(torch.device("cpu"), wrong)
    assert [eagle_top_k(b) for b in (4, 7, 8, 16, 31, 32, 128)] == [2, 2, 4, 4, 4, 10, 10]
    # the EAGLE trees: cut to the nodes worth verifying on a CPU unless a budget is asked, whole on a GPU
    assert CPU_STEP_ROWS == 4.0 and head_step_cost(torch.device("cpu")) == StepCost.linear(4.0)
    assert head_step_cost(torch.device("cpu"), 16) is None
    assert head_step_cost(torch.device("cuda")) is None and head_step_cost(torch.device("cuda"), 16) is None
    assert engine.target.device.type == "cpu"
    eagle = engine.drafter("eagle")
    assert (eagle.budget, eagle.top_k) == (4, 2)
    assert engine.drafter("eagle_lookup").base is eagle  # one EAGLE drafter, with or without lookup
    linear = StepCost.linear(CPU_STEP_ROWS)
    assert eagle.step_cost == engine.drafter("eagle_lookup").step_cost == linear  # the trees cut on a CPU
    assert engine.drafter("medusa").step_cost == linear
    # prompt lookup's chain is cut by the target's forwards as timed at load, and eagle_lookup verifies a
    # chain worth verifying at that cost alone
    lookup_cost = engine.drafter("lookup").step_cost
    assert isinstance(lookup_cost, StepCost) and lookup_cost is engine.lookup_cost  # its times are the machine's
    assert engine.drafter("eagle_lookup").lookup_cost is lookup_cost
    # measured again, as after a change of threads, for both; the forwards' times are fixed here, so what
    # is checked is what the engine builds from them, not how fast this machine is
    times = {t: 0.008 if t <= 3 else 0.008 + 0.002 * (t - 3) for t in range(1, LOOKUP_COST_TOKENS + 1)}
    monkeypatch.setattr(type(engine.target_lm), "time_forwards",
                        lambda self, ids, sizes, rounds=5: {t: times[t] for t in sizes})
    engine.remeasure_lookup_cost()
    assert engine.drafter("lookup").step_cost is engine.drafter("eagle_lookup").lookup_cost is engine.lookup_cost
    assert engine.lookup_cost.costs == StepCost.measured([times[t] for t in sorted(times)]).costs
    assert engine.lookup_cost(0) == 0.008 and engine.lookup_cost(8) == pytest.approx(0.008 + 0.002 * 6)
    times.update({1: 0.06})  # a target too slow to time quickly: the fixed rows besides the chain instead
    engine.remeasure_lookup_cost()
    assert engine.lookup_cost == StepCost.linear(LOOKUP_CPU_STEP_ROWS) == engine.drafter("lookup").step_cost
    monkeypatch.undo()
    engine.remeasure_lookup_cost()  # the module's engine goes on with this machine's own times
    assert engine.drafter("eagle_chain").step_cost is None  # a static chain has no values to cut by
    assert len(engine.drafter("medusa").shape.parents) == 1 + 4  # a sparse tree of 4 nodes below the root
    # the shipped heads draft from the 8192 most frequent answer tokens: a sixth of the LM head per step
    hidden = torch.zeros(1, engine.target.model.config.hidden_size)
    with torch.inference_mode():
        assert engine.drafter("medusa").lm_head(hidden).shape == engine.drafter("eagle")._rows(hidden).shape == (1, 8192)
