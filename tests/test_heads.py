import pytest
import torch

from speclens.engine.decoding.decode import GenerationConfig, generate
from speclens.engine.decoding.drafter import StepCost
from speclens.engine.decoding.events import Summary, TokenEvent
from speclens.engine.decoding.sampling import SamplingParams
from speclens.engine.decoding.tree import TreeShape, keep_worthwhile
from speclens.engine.drafters.eagle import EagleDrafter, EagleHead
from speclens.engine.drafters.medusa import MedusaDrafter, MedusaHeads
from speclens.engine.drafters.trees import LookupGraftedDrafter
from speclens.engine.runtime.cache import AppendLayer, CachedModel
from speclens.engine.runtime.masks import node_depths
from tests.tiny import hf_greedy, tiny_llama, tiny_tokenizer

PROMPT = "one two three four five six one two three four"
PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


def _prompt_ids():
    return tiny_tokenizer()(PROMPT)["input_ids"]


def _run(target, drafter, config):
    events = list(generate(target, tiny_tokenizer(), _prompt_ids(), config, drafter))
    assert isinstance(events[-1], Summary)
    return events, events[-1]


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(seed=0)


def _random_medusa(model, seed=3, num_heads=4):
    torch.manual_seed(seed)
    heads = MedusaHeads(model.config.hidden_size, model.config.vocab_size, num_heads=num_heads)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.5)
    return heads


@pytest.mark.parametrize("k", [1, 2, 4])
def test_medusa_greedy_equality(target_model, k):
    n = 40
    reference = hf_greedy(target_model, _prompt_ids(), n)
    target = CachedModel(target_model)
    drafter = MedusaDrafter(_random_medusa(target_model), target, TreeShape.from_paths(PATHS))
    _, summary = _run(target, drafter, GenerationConfig(method="medusa", k=k, max_new_tokens=n))
    assert list(summary.token_ids) == reference
    assert summary.drafted > 0


def test_medusa_tree_values_are_head_probabilities_and_the_cut_stays_exact(target_model):
    """A node is worth the product of its heads' probabilities along its path; with a step cost the tree is
    keep_worthwhile of the whole shape, and greedy decoding still equals plain decoding."""
    n, shape = 40, TreeShape.from_paths(PATHS)
    target = CachedModel(target_model)
    heads = _random_medusa(target_model)
    whole = MedusaDrafter(heads, target, shape)
    _run(target, whole, GenerationConfig(method="medusa", k=4, max_new_tokens=8))  # leaves a hidden state to read
    ids = list(target.cached_ids) + [0]
    tree = whole.propose_tree(ids, 4, SamplingParams(), None)
    hidden = target.hidden_at(len(ids) - 2, len(ids) - 1)[0]
    with torch.inference_mode():
        probs = heads(hidden, None).float().softmax(-1)  # [heads, V]
    depths = node_depths(shape.parents)
    for node in range(1, len(shape.parents)):
        parent = shape.parents[node]
        assert tree.values[node] == pytest.approx(tree.values[parent] * float(probs[depths[node] - 1, tree.tokens[node]]))
    cut_drafter = MedusaDrafter(heads, target, shape, step_cost=StepCost.linear(4.0))
    cut = cut_drafter.propose_tree(ids, 4, SamplingParams(), None)
    want = keep_worthwhile(tree, StepCost.linear(4.0))
    assert cut.tokens.tolist() == want.tokens.tolist() and cut.parents == want.parents
    reference = hf_greedy(target_model, _prompt_ids(), n)
    target = CachedModel(target_model)
    sizes = []

    class Counting(MedusaDrafter):
        def propose_tree(self, *args):
            tree = super().propose_tree(*args)
            sizes.append(len(tree) - 1)
            return tree

    _, summary = _run(target, Counting(heads, target, shape, step_cost=StepCost.linear(20.0)),
                      GenerationConfig(method="medusa", k=4, max_new_tokens=n))
    assert list(summary.token_ids) == reference
    assert any(0 < size < len(PATHS) for size in sizes)  # trees cut, but not to nothing


def test_medusa_sampling_runs_and_keeps_cache(target_model):
    target = CachedModel(target_model)
    drafter = MedusaDrafter(_random_medusa(target_model), target, TreeShape.from_paths(PATHS))
    config = GenerationConfig(k=4, max_new_tokens=30, sampling=SamplingParams(temperature=0.8), seed=1)
    events, summary = _run(target, drafter, config)
    assert summary.new_tokens == 30
    assert target.cached_ids == (_prompt_ids() + list(summary.token_ids))[:-1]  # all but the last, not yet read
    assert all(isinstance(e.p_target, float) for e in events if isinstance(e, TokenEvent))


def test_medusa_save_load_roundtrip(tmp_path, target_model):
    heads = _random_medusa(target_model, num_heads=2)
    heads.save(tmp_path / "st")
    loaded = MedusaHeads.load(tmp_path / "st", target_model.config.hidden_size, target_model.config.vocab_size)
    x = torch.randn(3, target_model.config.hidden_size)
    torch.testing.assert_close(loaded(x), heads(x))
    # the published layout: config.json + medusa_lm_head.pt (a plain state dict)
    (tmp_path / "pt").mkdir()
    (tmp_path / "pt" / "config.json").write_text('{"medusa_num_heads": 2, "medusa_num_layers": 1}')
    torch.save(heads.state_dict(), tmp_path / "pt" / "medusa_lm_head.pt")
    assert set(heads.state_dict()) == {"0.0.linear.weight", "0.0.linear.bias", "0.1.weight",
                                       "1.0.linear.weight", "1.0.linear.bias", "1.1.weight"}
    loaded = MedusaHeads.load(tmp_path / "pt", target_model.config.hidden_size, target_model.config.vocab_size)
    torch.testing.assert_close(loaded(x), heads(x))


def test_medusa_shared_lm_head_roundtrip_and_greedy_equality(tmp_path, target_model):
    h, v = target_model.config.hidden_size, target_model.config.vocab_size
    torch.manual_seed(6)
    heads = MedusaHeads(h, v, num_heads=3, num_layers=2, shared_lm_head=True)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.5)
    assert not any(k.endswith("2.weight") for k in heads.state_dict())  # no vocabulary projections saved
    heads.save(tmp_path / "shared")
    loaded = MedusaHeads.load(tmp_path / "shared", h, v)
    lm_head = target_model.get_output_embeddings()
    x = torch.randn(3, h)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, lm_head), heads(x, lm_head))
        assert loaded(x, lm_head).shape == (3, 3, v)
    with pytest.raises(ValueError, match="share the target's LM head"):
        loaded(x)
    n = 30
    target = CachedModel(target_model)
    drafter = MedusaDrafter(loaded, target, TreeShape.from_paths(PATHS))
    _, summary = _run(target, drafter, GenerationConfig(method="medusa", k=3, max_new_tokens=n))
    assert list(summary.token_ids) == hf_greedy(target_model, _prompt_ids(), n)


def test_medusa_draft_vocabulary_scores_only_its_tokens_and_stays_exact(tmp_path, target_model):
    h, v = target_model.config.hidden_size, target_model.config.vocab_size
    torch.manual_seed(7)
    heads = MedusaHeads(h, v, num_heads=3, shared_lm_head=True)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.5)
    vocab = torch.arange(0, v, 3)  # every third token id
    heads.draft_vocab = vocab
    heads.save(tmp_path / "vocab")
    loaded = MedusaHeads.load(tmp_path / "vocab", h, v)
    assert torch.equal(loaded.draft_vocab, vocab)

    ids = _prompt_ids()
    target = CachedModel(target_model)
    shape = TreeShape.from_paths(PATHS)
    drafter = MedusaDrafter(loaded, target, shape)
    target.prefill(ids)
    tree = drafter.propose_tree(ids, 3, SamplingParams(), None)
    # rank 0 at each depth: the best token of the draft vocabulary under the full heads' logits
    with torch.no_grad():
        hidden = target.hidden_at(len(ids) - 2, len(ids) - 1)[0]
        full = heads(hidden, target_model.get_output_embeddings())  # [heads, V]
    best = vocab[full[:, vocab].argmax(-1)].tolist()
    paths = shape.truncated(3).paths
    assert len(tree.tokens) == 1 + len(paths)
    for path, token in zip(paths, tree.tokens[1:].tolist()):
        assert token % 3 == 0
        if path[-1] == 0:
            assert token == best[len(path) - 1]

    n = 30
    target = CachedModel(target_model)
    drafter = MedusaDrafter(loaded, target, shape)
    _, summary = _run(target, drafter, GenerationConfig(method="medusa", k=3, max_new_tokens=n))
    assert list(summary.token_ids) == hf_greedy(target_model, _prompt_ids(), n)
    penalised = GenerationConfig(method="medusa", k=3, max_new_tokens=n,
                                 sampling=SamplingParams(temperature=0.7, repetition_penalty=1.3), seed=2)
    _, summary = _run(CachedModel(target_model), MedusaDrafter(loaded, CachedModel(target_model), shape), penalised)
    assert summary.new_tokens == n

    own = _random_medusa(target_model, num_heads=2)  # heads with their own projections take no draft vocabulary
    own.draft_vocab = vocab
    own.save(tmp_path / "own")
    with pytest.raises(ValueError, match="share the target's LM head"):
        MedusaHeads.load(tmp_path / "own", h, v)
    # shared heads hold no vocabulary-sized weight, so their config is what says they fit another target
    with pytest.raises(ValueError, match=f"vocabulary of {v} tokens, the target has {v + 8}"):
        MedusaHeads.load(tmp_path / "vocab", h, v + 8)


def _random_eagle(model, seed=4):
    torch.manual_seed(seed)
    head = EagleHead.for_target(model.config)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    return head


@pytest.mark.parametrize("k", [1, 2, 4])
def test_eagle_greedy_equality(target_model, k):
    n = 40
    reference = hf_greedy(target_model, _prompt_ids(), n)
    for shape in (None, TreeShape.from_paths(PATHS)):
        target = CachedModel(target_model)
        drafter = EagleDrafter(_random_eagle(target_model), target, shape, top_k=3, budget=10)
        _, summary = _run(target, drafter, GenerationConfig(method="eagle", k=k, max_new_tokens=n))
        assert list(summary.token_ids) == reference
        assert summary.drafted > 0


def test_eagle_features_follow_the_committed_tokens(target_model):
    target = CachedModel(target_model)
    drafter = EagleDrafter(_random_eagle(target_model), target, None, top_k=2, budget=6)
    config = GenerationConfig(k=3, max_new_tokens=25, sampling=SamplingParams(temperature=1.0), seed=2)
    _, summary = _run(target, drafter, config)
    ids = _prompt_ids() + list(summary.token_ids)
    # features of every committed position equal a fresh target pass over the committed tokens
    with torch.inference_mode():
        fresh = target_model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    n = drafter.features.shape[0]
    assert drafter.feature_ids == ids[:n] and n >= len(ids) - 5
    torch.testing.assert_close(drafter.features, fresh[:n], atol=1e-4, rtol=1e-4)


def test_eagle_lookup_skipping_the_head_keeps_greedy_equality_and_costs_no_extra_target_pass(target_model):
    """With a lookup cost, steps whose lookup chain is worth verifying alone never ask the EAGLE head; its
    features still follow every committed token from the verifying forwards, so after the prompt the target
    runs only the one verify pass per step, and the head's later trees see the right features."""
    n = 60
    prompt = tiny_tokenizer()("the cat sat on the mat. the cat sat on the mat. the cat")["input_ids"]
    reference = hf_greedy(target_model, prompt, n)
    target = CachedModel(target_model)
    head = EagleDrafter(_random_eagle(target_model), target, None, top_k=2, budget=6, step_cost=StepCost.linear(4.0))
    drafter = LookupGraftedDrafter(head, "eagle_lookup", lookup_tokens=8, step_cost=StepCost.linear(4.0),
                                   lookup_cost=StepCost.linear(2.5))
    passes, trees = [], []
    forward, forward_tree, propose = target.forward, target.forward_tree, head.propose_tree
    target.forward = lambda *a, **k: passes.append("forward") or forward(*a, **k)
    target.forward_tree = lambda *a: passes.append("tree") or forward_tree(*a)
    head.propose_tree = lambda *a: trees.append(a[0]) or propose(*a)
    config = GenerationConfig(method="eagle_lookup", k=4, max_new_tokens=n)
    summary = list(generate(target, tiny_tokenizer(), prompt, config, drafter))[-1]
    assert list(summary.token_ids) == reference
    decoding = passes[passes.index("tree"):]  # one target pass per step; only a last step with one token
    assert len(decoding) == summary.steps and "forward" not in decoding[:-1]  # left to emit drafts nothing
    assert 0 < len(trees) < decoding.count("tree")  # some steps skipped the head, some asked it
    ids = prompt + list(summary.token_ids)
    with torch.inference_mode():
        fresh = target_model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    kept = head.features.shape[0]
    assert head.feature_ids == ids[:kept] and kept >= len(ids) - 5
    torch.testing.assert_close(head.features, fresh[:kept], atol=1e-4, rtol=1e-4)


def test_eagle_head_forward_equals_hf_decoder_layer(target_model):
    # the head writes its decoder layer's math out by hand; it must be HF's LlamaDecoderLayer exactly,
    # whole or fed in two parts through its cache, under a tree mask with non-linear positions
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head = _random_eagle(target_model)
    h = target_model.config.hidden_size
    torch.manual_seed(1)
    x, f = torch.randn(9, h), torch.randn(9, h)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6, 7])  # nodes 7 and 8: siblings-and-child below 6
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    mask[7, 6] = False  # node 7 is node 6's sibling
    mask[8, 6] = False  # node 8 is node 7's child
    with torch.no_grad():
        hidden = head.fc(torch.cat([x, f], -1))[None]  # [1, 9, H]
        additive = torch.zeros(9, 9).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]
        rotary = LlamaRotaryEmbedding(head.config)(hidden, positions[None])
        want = head.layer(hidden, attention_mask=additive, position_ids=positions[None], position_embeddings=rotary)
        want = want[0] if isinstance(want, tuple) else want
        # float32 rounding of two attention kernels: up to 2e-5 seen on an Intel Xeon; a wrong mask,
        # position or scale moves outputs by 1e-2 and more
        torch.testing.assert_close(head(x, f, positions, mask), want[0], atol=1e-4, rtol=1e-4)
        cache = AppendLayer()
        first = head(x[:6], f[:6], positions[:6], mask[:6, :6], cache)
        second = head(x[6:], f[6:], positions[6:], mask[6:], cache)
        torch.testing.assert_close(torch.cat([first, second]), want[0], atol=1e-4, rtol=1e-4)
        assert cache.get_seq_length() == 9
        cache.crop(-3)  # a rollback to 6 entries, then a different continuation
        torch.testing.assert_close(head(x[8:], f[8:], positions[8:], mask[8:, [0, 1, 2, 3, 4, 5, 8]], cache),
                                   head(x[[0, 1, 2, 3, 4, 5, 8]], f[[0, 1, 2, 3, 4, 5, 8]],
                                        positions[[0, 1, 2, 3, 4, 5, 8]],
                                        mask[[0, 1, 2, 3, 4, 5, 8]][:, [0, 1, 2, 3, 4, 5, 8]])[-1:],
                                   atol=1e-4, rtol=1e-4)


def test_eagle_draft_vocabulary_candidates_equal_full_row_processing(target_model):
    # the dynamic tree ranks candidates within the draft vocabulary; the base class's full-vocabulary
    # path (logits -inf outside it, then processed) must give the same tokens and probabilities
    from speclens.engine.drafters.trees import DraftModelTreeDrafter

    target = CachedModel(target_model)
    drafter = EagleDrafter(_draft_vocab_eagle(target_model), target, None, top_k=4, budget=8)
    ids = _prompt_ids()
    target.prefill(ids)
    drafter.propose_tree(ids, 3, SamplingParams(), None)  # syncs the features and the head's cache
    tokens, parents, nodes = [ids[-1]], [-1], [0]
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.3, top_k=5)):
        drafter._f_hat = {0: drafter._feed_committed(ids, drafter._sync(ids))[-1]}
        drafter._fed = []
        got = drafter._top_candidates(ids, tokens, parents, nodes, params)
        want = DraftModelTreeDrafter._top_candidates(drafter, ids, tokens, parents, nodes, params)
        assert [[t for _, t in row] for row in got] == [[t for _, t in row] for row in want]
        torch.testing.assert_close([[p for p, _ in row] for row in got], [[p for p, _ in row] for row in want])
        drafter._crop(len(ids) - 1)


def test_eagle_save_load_roundtrip(tmp_path, target_model):
    head = _random_eagle(target_model)
    head.save(tmp_path / "eagle")
    loaded = EagleHead.load(tmp_path / "eagle")
    h = target_model.config.hidden_size
    x, f = torch.randn(5, h), torch.randn(5, h)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, f, torch.arange(5), mask), head(x, f, torch.arange(5), mask))


def test_a_public_eagle1_checkpoint_loads_and_drafts_exactly(tmp_path, target_model):
    """SafeAILab's EAGLE-1 layout (its cnets.Model state dict in float16 as pytorch_model.bin): `layers.0.*`
    with no input norm on that layer (its output of fc goes to attention as it is), a copy of
    `embed_tokens`, and fc with or without a bias. It loads, computes what that model computes, and drafts
    for plain decoding's exact output."""
    import json

    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from speclens.engine.session import Engine, EngineError
    from tests.tiny import loaded

    reference = _random_eagle(target_model, seed=7)
    config = {**target_model.config.to_dict(), "num_hidden_layers": 1, "architectures": ["LlamaForCausalLM"]}
    for bias in (True, False):
        state = {"fc.weight": reference.fc.weight, "embed_tokens.weight": torch.randn(
            target_model.config.vocab_size, target_model.config.hidden_size)}
        if bias:
            state["fc.bias"] = reference.fc.bias
        state |= {f"layers.0.{k}": v for k, v in reference.layer.state_dict().items() if "input_layernorm" not in k}
        folder = tmp_path / f"eagle-bias-{bias}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        torch.save({k: v.detach().half() for k, v in state.items()}, folder / "pytorch_model.bin")

        head = EagleHead.load(folder)
        assert not head.has_input_norm
        h = target_model.config.hidden_size
        torch.manual_seed(2)
        x, f, positions = torch.randn(5, h), torch.randn(5, h), torch.arange(5)
        mask = torch.ones(5, 5, dtype=torch.bool).tril()
        with torch.no_grad():  # EAGLE-1's forward: fc, then the decoder layer without its input norm
            layer = reference.layer
            layer.input_layernorm, norm = torch.nn.Identity(), layer.input_layernorm
            weights = {k: v.half().float() for k, v in reference.state_dict().items() if "input_layernorm" not in k}
            as_stored = EagleHead.for_target(target_model.config)
            as_stored.layer.input_layernorm = torch.nn.Identity()
            as_stored.load_state_dict({**weights, **({} if bias else {"fc.bias": torch.zeros(h)})})
            hidden = as_stored.fc(torch.cat([x, f], -1))[None]
            additive = torch.zeros(5, 5).masked_fill(~mask, torch.finfo(torch.float32).min)[None, None]
            rotary = LlamaRotaryEmbedding(as_stored.config)(hidden, positions[None])
            want = as_stored.layer(hidden, attention_mask=additive, position_ids=positions[None],
                                   position_embeddings=rotary)
            want = want[0] if isinstance(want, tuple) else want
            layer.input_layernorm = norm
            torch.testing.assert_close(head(x, f, positions, mask), want[0], atol=1e-4, rtol=1e-4)

        engine = Engine(loaded(target_model, "tiny"), heads=(str(folder),))
        ids = _prompt_ids()
        plain = list(engine.generate_ids(ids, GenerationConfig(method="ar", max_new_tokens=30)))[-1]
        for method in ("eagle", "eagle_chain", "eagle_lookup"):
            summary = list(engine.generate_ids(ids, GenerationConfig(method=method, k=3, max_new_tokens=30)))[-1]
            assert summary.token_ids == plain.token_ids, (bias, method)
    wrong = tmp_path / "other-vocabulary"
    wrong.mkdir()
    (wrong / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    torch.save({k: v.half() for k, v in state.items() if k != "embed_tokens.weight"}, wrong / "pytorch_model.bin")
    with pytest.raises(EngineError, match="vocabulary"):
        Engine(loaded(target_model, "tiny"), heads=(str(wrong),))


def _draft_vocab_eagle(model):
    head = _random_eagle(model)
    head.draft_vocab = torch.arange(0, model.config.vocab_size, 3)  # a third of the vocabulary
    return head


def test_eagle_draft_vocabulary_keeps_greedy_equality_and_restricts_drafts(target_model):
    n = 40
    reference = hf_greedy(target_model, _prompt_ids(), n)
    allowed = set(_draft_vocab_eagle(target_model).draft_vocab.tolist())
    for shape in (None, TreeShape.from_paths(PATHS)):
        target = CachedModel(target_model)
        drafter = EagleDrafter(_draft_vocab_eagle(target_model), target, shape, top_k=3, budget=10)
        _, summary = _run(target, drafter, GenerationConfig(method="eagle", k=3, max_new_tokens=n))
        assert list(summary.token_ids) == reference
        ids = _prompt_ids() + reference[:10]
        target.prefill(ids)
        drafter.prefill(ids)
        for params in (SamplingParams(), SamplingParams(temperature=1.0)):
            tree = drafter.propose_tree(ids, 3, params, torch.Generator().manual_seed(0))
            assert len(tree) > 1 and set(tree.tokens[1:].tolist()) <= allowed
            if tree.probs is not None:  # sampled drafts carry the restricted q they came from
                outside = torch.ones(tree.probs.shape[-1], dtype=torch.bool)
                outside[sorted(allowed)] = False
                assert float(tree.probs[1:, outside].abs().max()) == 0.0
                torch.testing.assert_close(tree.probs[1:].sum(-1), torch.ones(len(tree) - 1))


def test_eagle_draft_vocabulary_survives_save_and_load(tmp_path, target_model):
    head = _draft_vocab_eagle(target_model)
    head.save(tmp_path / "eagle")
    loaded = EagleHead.load(tmp_path / "eagle")
    assert torch.equal(loaded.draft_vocab, head.draft_vocab)
    assert EagleHead.load(_saved(tmp_path / "plain", _random_eagle(target_model))).draft_vocab is None


def _saved(folder, head):
    head.save(folder)
    return folder


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_train_drafter_end_to_end_on_a_tiny_target(tmp_path, target_model, kind):
    import json

    from speclens.engine.tools.cli import main

    model_dir = tmp_path / "tiny-target"
    target_model.save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"instruction": f"Count to {i}.", "instances": [{"input": "one two", "output": ""}]} for i in range(8)]
    prompts.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "heads"
    args = ["train-drafter", "--kind", kind, "--target", str(model_dir), "--prompts", str(prompts), "--out", str(out),
            "--max-prompts", "5", "--held-out", "2", "--answer-tokens", "6", "--epochs", "2", "--eval-tokens", "8",
            "--depth", "3", "--medusa-heads", "2", "--sampled-answers", "1", "--batch-size", "3"]
    extra = tmp_path / "extra.pt"  # another prompt set, distilled by its own run, trains the head too
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps({"instruction": f"Name {i} colours."}) for i in range(3)))
    assert main(args[:5] + ["--prompts", str(other), "--out", str(tmp_path / "other"), "--data", str(extra), "--held-out", "0",
                            "--answer-tokens", "6", "--distil-only"]) == 0
    assert not (tmp_path / "other" / "model.safetensors").exists()
    assert len(torch.load(extra, weights_only=True)) == 3
    args += ["--extra-data", str(extra)]
    assert main(args) == 0
    for name in ("config.json", "model.safetensors", "README.md", "checkpoint.pt", "distilled.pt", "held-out.pt"):
        assert (out / name).exists(), name
    distilled = torch.load(out / "distilled.pt", weights_only=True)  # a greedy and a sampled answer per prompt
    assert sorted((int(s["prompt"]), int(s["variant"])) for s in distilled) == [(i, v) for i in range(5) for v in (0, 1)]
    for sample in distilled[:3]:  # features: the target's final hidden states over the distilled tokens
        with torch.inference_mode():
            fresh = target_model(input_ids=sample["tokens"][None], output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(sample["features"].float(), fresh, atol=0.05, rtol=0.02)
    # both kinds draft from the answers' tokens (these Medusa heads share the target's LM head)
    h, v = target_model.config.hidden_size, target_model.config.vocab_size
    vocab = (EagleHead.load(out) if kind == "eagle" else MedusaHeads.load(out, h, v)).draft_vocab
    trained_on = distilled + torch.load(extra, weights_only=True)
    answers = {int(t) for s in trained_on for t in s["tokens"][int(s["answer_start"]) :]}
    assert vocab is not None and set(vocab.tolist()) == answers
    assert "draft vocabulary" in (out / "README.md").read_text()
    record = json.loads((out / "training.json").read_text())
    assert len(record["history"]) == 2
    assert all(0.0 <= epoch["held_out_top1"] <= 1.0 for epoch in record["history"])
    card = (out / "README.md").read_text()
    assert "13 / " in card and "3 sequences distilled the same way from other prompts: extra.pt" in card
    assert "--extra-data extra.pt" in card and "held-out top-1" in card
    assert set(record["tau"]) == ({"chain", "tree"} if kind == "eagle" else {"tree", "sparse"})
    assert all(r["tau"] >= 1.0 for r in record["tau"].values())
    assert "tau on held-out prompts" in (out / "README.md").read_text()
    # a rerun resumes: nothing left to distil or train, same weights
    before = (out / "model.safetensors").read_bytes()
    assert main(args) == 0
    assert (out / "model.safetensors").read_bytes() == before
    # a trained head can be continued on more data; it starts from the saved weights
    again = tmp_path / "continued"
    continued = [str(again) if a == str(out) else "1" if prev == "--epochs" else a for prev, a in zip([""] + args, args)]
    unroll = ["--unroll", "2"] if kind == "eagle" else []  # EAGLE: continued with training-time test
    assert main(continued + ["--init-from", str(out)] + unroll) == 0
    assert f"continued from {out.name}" in (again / "README.md").read_text()
    if unroll:
        assert "--unroll 2" in (again / "README.md").read_text()
    assert (again / "model.safetensors").read_bytes() != before


def test_train_drafter_measures_tau_later_with_evaluate_only(tmp_path, target_model, capsys):
    """A run with --eval-tokens 0 (as on a GPU machine) trains and writes a card that says tau is not
    measured; --evaluate-only with the same arguments then measures it on the CPU on the run's own
    held-out prompts, the same tau an evaluating run reports, and rewrites the card."""
    import json
    import shutil

    from speclens.engine.tools.cli import main

    model_dir = tmp_path / "tiny-target"
    target_model.save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"instruction": f"Count to {i}."}) for i in range(6)))
    out = tmp_path / "head"
    args = ["train-drafter", "--kind", "eagle", "--target", str(model_dir), "--prompts", str(prompts), "--out", str(out),
            "--held-out", "2", "--answer-tokens", "6", "--epochs", "1", "--depth", "3", "--batch-size", "4",
            "--device", "cpu", "--eval-tokens", "0"]
    assert main(args) == 0
    record = json.loads((out / "training.json").read_text())
    assert record["tau"] == {} and record["run"]["device"] == "cpu" and len(record["history"]) == 1
    assert "not measured yet" in (out / "README.md").read_text()
    weights = (out / "model.safetensors").read_bytes()

    shipped = tmp_path / "shipped"  # evaluated where it was copied to, as a head trained elsewhere is
    shutil.copytree(out, shipped)
    args = [str(shipped) if a == str(out) else a for a in args]
    out = shipped
    assert main(args + ["--evaluate-only", "--eval-tokens", "8"]) == 0
    measured = json.loads((out / "training.json").read_text())
    assert set(measured["tau"]) == {"chain", "tree"} and all(r["tau"] >= 1.0 for r in measured["tau"].values())
    assert measured["history"] == record["history"] and (out / "model.safetensors").read_bytes() == weights
    card = (out / "README.md").read_text()
    assert "not measured yet" not in card and "tau on held-out prompts, EAGLE chain" in card
    assert "--evaluate-only" not in card and "--device cpu" in card and "--eval-tokens 0" in card
    assert "epochs, optimiser steps, tokens per step | 1, " in card  # the run's options, not this command's defaults
    assert '"out": "head"' in card and '"evaluate_only": false' in card and '"eval_tokens": 8' in card

    again = tmp_path / "head"  # the same run measuring tau itself gives the same numbers
    shutil.rmtree(again)
    assert main([str(again) if a == str(out) else "8" if a == "0" else a for a in args]) == 0
    direct = json.loads((again / "training.json").read_text())["tau"]
    assert {k: (r["tau"], r["tokens"]) for k, r in direct.items()} == {
        k: (r["tau"], r["tokens"]) for k, r in measured["tau"].items()}
    # refusals are one line and exit 2 (no traceback)
    assert main(args[:6] + [str(tmp_path / "other.jsonl")] + args[7:] + ["--evaluate-only"]) == 2
    assert "give the run's --prompts files" in capsys.readouterr().err
    assert main(["train-drafter", "--kind", "eagle", "--target", str(model_dir), "--prompts", str(prompts),
                 "--out", str(tmp_path / "empty"), "--evaluate-only"]) == 2
    assert "no head trained" in capsys.readouterr().err


def test_packed_steps_are_block_diagonal_causal():
    """Packed training steps: per-sample positions, a causal mask within each sample and none across,
    and the answer region starting two tokens before each sample's answer."""
    from speclens.engine.tools.train.loop import packed

    step = [{"tokens": torch.arange(n), "answer_start": torch.tensor(a)} for n, a in ((5, 3), (1, 0), (4, 2))]
    positions, mask, answer = packed(step)
    assert positions.tolist() == [0, 1, 2, 3, 0, 1, 2]
    blocks = [torch.ones(n, n, dtype=torch.bool).tril() for n in (4, 0, 3)]
    assert torch.equal(mask, torch.block_diag(*blocks))
    assert answer.tolist() == [False, True, True, True, True, True, True]


def _assert_tree_features_equal_linear_runs(drafter, head, target_model, ids, tokens, parents):
    """Every memoised node feature equals an uncached linear EAGLE run: context inputs (f_i, t_{i+1}),
    then (f_hat(parent), x) along the node's path."""
    from speclens.engine.runtime.masks import ancestor_path

    embed = target_model.get_input_embeddings()
    features = drafter.features[: len(ids) - 1]  # [L-1, H]
    checked = 0
    with torch.inference_mode():
        for node in range(len(tokens)):
            if node not in drafter._f_hat:
                continue  # leaves are never expanded, so their features are not computed
            path = ancestor_path(parents, node)
            steps = []
            for depth in range(len(path) + 1):
                f = torch.cat([features, *([torch.stack(steps)] if steps else [])])
                x_ids = ids[1:] + [tokens[m] for m in path[:depth]]
                n = f.shape[0]
                out = head(embed(torch.tensor(x_ids)), f, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
                steps.append(out[-1])
            torch.testing.assert_close(drafter._f_hat[node], steps[-1], atol=1e-3, rtol=1e-3)  # a random head amplifies
            checked += 1
    assert checked >= 2


def test_eagle_tree_features_equal_linear_runs_along_each_path(target_model):
    head = _random_eagle(target_model)
    target = CachedModel(target_model)
    ids = _prompt_ids()
    target.prefill(ids)
    drafter = EagleDrafter(head, target, TreeShape.from_paths(PATHS))
    drafter.prefill(ids)
    tree = drafter.propose_tree(ids, 4, SamplingParams(), None)
    _assert_tree_features_equal_linear_runs(drafter, head, target_model, ids, tree.tokens.tolist(), list(tree.parents))


@pytest.mark.parametrize("shape", [None, TreeShape.from_paths(PATHS)], ids=["dynamic", "static"])
def test_eagle_cached_drafting_after_rollbacks_equals_uncached(target_model, shape):
    # sampled steps reject drafts, so the head's KV cache is cropped back and refilled many times
    head = _random_eagle(target_model)
    target = CachedModel(target_model)
    drafter = EagleDrafter(head, target, shape, top_k=3, budget=8)
    config = GenerationConfig(k=4, max_new_tokens=30, sampling=SamplingParams(temperature=1.0), seed=5)
    _, summary = _run(target, drafter, config)
    assert summary.accepted < summary.drafted  # some drafts were rejected
    ids = _prompt_ids() + list(summary.token_ids)
    # the head's cache holds exactly one entry per committed input pair (f_i, t_{i+1}), no tree nodes
    assert drafter.cache.get_seq_length() == len(drafter.cache_ids) - 1
    assert drafter.cache_ids == ids[: len(drafter.cache_ids)]
    target.forward(ids[:-1], [], 1)  # the target state generate() would leave before the next step
    drafter.shape = TreeShape.from_paths(PATHS)  # static: the checked node indices are the tree's own
    tree = drafter.propose_tree(ids, 4, SamplingParams(), None)
    assert drafter.cache.get_seq_length() == len(ids) - 1  # the tree was cropped off again
    _assert_tree_features_equal_linear_runs(drafter, head, target_model, ids, tree.tokens.tolist(), list(tree.parents))


def test_corrupt_head_weights_are_a_clear_error(tmp_path, target_model):
    from speclens.engine.session import Engine, EngineError
    from tests.tiny import loaded

    EagleHead.for_target(target_model.config).save(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)  # a truncated or damaged download
    with pytest.raises(EngineError, match="Could not load the heads"):
        Engine(loaded(target_model, "tiny-target"), heads=(str(tmp_path),))


def test_sampled_answers_take_their_temperatures_in_turn(tmp_path, monkeypatch):
    import argparse

    from speclens.engine.tools.train import distil
    from speclens.engine.tools.train.card import sampled_phrase
    from speclens.engine.tools.train.options import TrainOptions, add_train_arguments, command_line

    seen = []

    def fake_batch(model, prompts, eos_ids, options, temperature, features=True, layers=()):
        seen.append((len(prompts), temperature))
        return [{"tokens": torch.tensor([1, 2, 3]), "features": torch.zeros(3, 4), "answer_start": torch.tensor(1)}
                for _ in prompts]

    monkeypatch.setattr(distil, "_distil_batch", fake_batch)
    options = TrainOptions("eagle", "default", (), str(tmp_path), sampled_answers=3,
                                 sample_temperatures=(0.5, 1.3), batch_size=10)
    samples = distil.distil(None, [[1, 2], [3, 4]], (0,), options)
    assert seen == [(2, None), (2, 0.5), (2, 1.3), (2, 0.5)]  # greedy, then the temperatures in turn
    assert sorted((int(s["prompt"]), int(s["variant"])) for s in samples) == [(p, v) for p in (0, 1) for v in range(4)]
    assert "sampled at temperature 0.5, 1.3 in turn" in sampled_phrase(options)
    assert "--sampled-answers 3 --sample-temperatures 0.5,1.3" in command_line(options)
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    common = ["--kind", "eagle", "--prompts", "p.jsonl", "--out", "o"]
    assert parser.parse_args(common).sample_temperatures == (0.7,)
    assert parser.parse_args(common + ["--sample-temperatures", "0.5,1.3"]).sample_temperatures == (0.5, 1.3)
    with pytest.raises(SystemExit):
        parser.parse_args(common + ["--sample-temperatures", "0,1"])


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_training_killed_after_an_epoch_resumes_to_the_same_head(tmp_path, target_model, kind, monkeypatch):
    """A run stopped right after its epoch-1 checkpoint, then started again with the same command, ends
    with the weights, bit for bit, of a run that was never stopped."""
    import json

    from speclens.engine.tools.cli import main

    model_dir = tmp_path / "tiny-target"
    target_model.save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"instruction": f"Count to {i}."}) for i in range(8)))

    def args(out):
        return ["train-drafter", "--kind", kind, "--target", str(model_dir), "--prompts", str(prompts), "--out", str(out),
                "--held-out", "2", "--answer-tokens", "6", "--epochs", "3", "--eval-tokens", "0", "--depth", "3",
                "--medusa-heads", "2", "--batch-size", "3", "--tokens-per-step", "16"]

    assert main(args(tmp_path / "whole")) == 0
    save = torch.save

    class Killed(Exception):
        pass

    def save_then_die_after_epoch_1(obj, path, *rest, **options):
        save(obj, path, *rest, **options)
        if isinstance(obj, dict) and obj.get("epoch") == 1:
            raise Killed

    monkeypatch.setattr(torch, "save", save_then_die_after_epoch_1)
    with pytest.raises(Killed):
        main(args(tmp_path / "stopped"))
    assert not (tmp_path / "stopped" / "model.safetensors").exists()
    epochs_saved = []

    def save_and_note(obj, path, *rest, **options):
        save(obj, path, *rest, **options)
        if isinstance(obj, dict) and "epoch" in obj:
            epochs_saved.append(obj["epoch"])

    monkeypatch.setattr(torch, "save", save_and_note)
    assert main(args(tmp_path / "stopped")) == 0
    assert epochs_saved == [2, 3]  # it went on from its checkpoint; a fresh start would have redone epoch 1
    assert ((tmp_path / "stopped" / "model.safetensors").read_bytes()
            == (tmp_path / "whole" / "model.safetensors").read_bytes())
