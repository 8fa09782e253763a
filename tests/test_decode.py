import random

import pytest
import torch

from speclens.engine.decoding.decode import GenerationConfig, generate
from speclens.engine.decoding.events import StepEvent, Summary, TokenEvent
from speclens.engine.decoding.sampling import SamplingParams
from speclens.engine.decoding.step import speculative_step
from speclens.engine.drafters.draft_model import DraftModelDrafter
from speclens.engine.drafters.lookup import PromptLookupDrafter, lookup
from speclens.engine.runtime.cache import CachedModel
from speclens.engine.runtime.detok import IncrementalDetokenizer, StreamDetokenizer, make_detokenizer
from tests.tiny import assert_cache_matches_fresh_prefill, hf_greedy, tiny_llama, tiny_tokenizer

PROMPT = "one two three four five six one two three four"


def prompt_ids():
    return tiny_tokenizer()(PROMPT)["input_ids"]


def run(target, drafter, config, eos_ids=(), prompt=None):
    events = list(generate(target, tiny_tokenizer(), prompt or prompt_ids(), config, drafter, eos_ids))
    summary = events[-1]
    assert isinstance(summary, Summary)
    return events, summary


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def draft_model():
    return tiny_llama(seed=1, layers=1)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_equality_all_methods(target_model, draft_model, k):
    n = 48
    reference = hf_greedy(target_model, prompt_ids(), n)
    config = GenerationConfig(k=k, max_new_tokens=n)
    _, plain = run(CachedModel(target_model), None, config)
    _, by_lookup = run(CachedModel(target_model), PromptLookupDrafter(), config)
    _, by_draft = run(CachedModel(target_model), DraftModelDrafter(CachedModel(draft_model)), config)
    assert list(plain.token_ids) == reference
    assert list(by_lookup.token_ids) == reference
    assert list(by_draft.token_ids) == reference
    assert by_lookup.drafted > 0 and by_draft.drafted > 0


@pytest.mark.parametrize("k", [1, 4])
def test_draft_equal_to_target_accepts_everything(target_model, k):
    config = GenerationConfig(k=k, max_new_tokens=41)
    events, summary = run(CachedModel(target_model), DraftModelDrafter(CachedModel(target_model)), config)
    assert summary.accepted == summary.drafted > 0
    assert summary.per_position_acceptance == (1.0,) * k
    sources = {e.source for e in events if isinstance(e, TokenEvent)}
    assert sources <= {"draft_accepted", "bonus", "target"} and "target_resampled" not in sources
    assert summary.mean_accepted_length == pytest.approx(summary.new_tokens / summary.steps)


def test_eos_inside_an_accepted_block_stops_there(target_model):
    plain = hf_greedy(target_model, prompt_ids(), 30)
    # pick a token as EOS whose first occurrence lies inside a block of 4
    index = next(i for i in range(6, 30) if plain[i] not in plain[:i] and i % 5 != 0)
    eos = plain[index]
    config = GenerationConfig(k=4, max_new_tokens=60)
    events, summary = run(CachedModel(target_model), DraftModelDrafter(CachedModel(target_model)), config, (eos,))
    assert list(summary.token_ids) == plain[: index + 1]
    assert summary.stop_reason == "eos"
    last_token = [e for e in events if isinstance(e, TokenEvent)][-1]
    assert last_token.token_id == eos and last_token.text == ""


@pytest.mark.parametrize("max_new", [1, 2, 5, 17])
def test_max_new_tokens_never_exceeded(target_model, max_new):
    drafter = DraftModelDrafter(CachedModel(target_model))
    for temperature in (0.0, 1.0):
        config = GenerationConfig(k=4, max_new_tokens=max_new, sampling=SamplingParams(temperature=temperature), seed=0)
        events, summary = run(CachedModel(target_model), drafter, config)
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert summary.new_tokens == len(tokens) == max_new
        assert summary.stop_reason == "max_new_tokens"


def test_seeded_runs_are_reproducible(target_model, draft_model):
    config = GenerationConfig(k=3, max_new_tokens=40, sampling=SamplingParams(temperature=1.0, top_k=50), seed=7)
    runs = [
        run(CachedModel(target_model), DraftModelDrafter(CachedModel(draft_model)), config)[1].token_ids
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    other = run(CachedModel(target_model), DraftModelDrafter(CachedModel(draft_model)),
                GenerationConfig(k=3, max_new_tokens=40, sampling=SamplingParams(temperature=1.0, top_k=50), seed=8))
    assert other[1].token_ids != runs[0]


def test_events_are_consistent(target_model, draft_model):
    config = GenerationConfig(k=4, max_new_tokens=40, sampling=SamplingParams(temperature=0.8), seed=3)
    events, summary = run(CachedModel(target_model), DraftModelDrafter(CachedModel(draft_model)), config)
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert "".join(t.text for t in tokens) == summary.text
    assert len(steps) == summary.steps
    assert sum(s.accepted for s in steps) == summary.accepted
    assert sum(s.emitted for s in steps) == summary.new_tokens
    assert sum(summary.accepted_length_histogram) == summary.steps
    for t in tokens:
        assert 0.0 <= t.p_target <= 1.0
        if t.source == "draft_accepted":
            assert t.p_draft is not None and t.p_target > 0
        if t.source == "bonus":
            assert t.p_draft is None


def test_cancel_stops_between_steps(target_model):
    import threading

    cancel = threading.Event()
    seen = 0
    gen = generate(CachedModel(target_model), tiny_tokenizer(), prompt_ids(), GenerationConfig(max_new_tokens=200),
                   PromptLookupDrafter(), cancel=cancel)
    summaries = []
    for event in gen:
        if isinstance(event, StepEvent):
            seen += 1
            if seen == 3:
                cancel.set()
        if isinstance(event, Summary):
            summaries.append(event)
    assert len(summaries) == 1 and summaries[0].stop_reason == "cancelled" and summaries[0].steps == 3


def test_stop_string_cuts_text(target_model):
    _, full = run(CachedModel(target_model), None, GenerationConfig(max_new_tokens=30))
    stop = full.text[10:13]
    _, cut = run(CachedModel(target_model), PromptLookupDrafter(), GenerationConfig(max_new_tokens=30, stop_strings=(stop,)))
    assert cut.stop_reason == "stop_string"
    assert cut.text == full.text[: full.text.index(stop)]


def test_cache_consistent_over_random_rollbacks(target_model):
    rng = random.Random(0)
    lm = CachedModel(target_model)
    vocab = target_model.config.vocab_size
    ids = prompt_ids()
    lm.prefill(ids)
    for round_ in range(1000):
        k = rng.randint(0, 5)
        block = [rng.randrange(vocab) for _ in range(k)]
        lm.forward(ids, block, k + 1)
        n = rng.randint(0, k)
        ids = ids + block[:n] + [rng.randrange(vocab)]
        lm.truncate(len(ids) - 1)
        assert lm.cached_ids == ids[:-1]
        if round_ % 100 == 99:
            assert_cache_matches_fresh_prefill(target_model, lm)
        if len(ids) > 300:
            ids = ids[:20]
            lm.truncate(lm.common_prefix(ids))


def test_speculative_steps_keep_both_caches_committed(target_model, draft_model):
    target, draft = CachedModel(target_model), CachedModel(draft_model)
    drafter = DraftModelDrafter(draft)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=1.0)
    ids = prompt_ids()
    target.prefill(ids)
    drafter.prefill(ids)
    for step in range(300):
        result = speculative_step(target, drafter, ids, 1 + step % 5, params, gen)
        ids = ids + result.tokens
        assert target.cached_ids == ids[:-1]
        assert draft.cached_ids == ids[: len(draft.cached_ids)] and len(draft.cached_ids) >= len(ids) - 2
        if len(ids) > 400:
            ids = prompt_ids()
            target.prefill(ids)
            drafter.prefill(ids)
    assert_cache_matches_fresh_prefill(target_model, target)
    assert_cache_matches_fresh_prefill(draft_model, draft)


def test_lookup_finds_latest_longest_match():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]
    assert lookup([5, 6, 7], 3) == []
    assert lookup([4, 4], 3) == [4]


def test_lookup_with_a_cost_cut_drafts_only_the_tokens_worth_verifying():
    from itertools import accumulate

    from speclens.engine.decoding.drafter import StepCost, worth_floor, worthwhile_count
    from speclens.engine.drafters.lookup import LOOKUP_ACCEPTANCE, PromptLookupDrafter

    # against brute force over every prefix of a non-increasing chain of values, for linear costs and for
    # random convex ones (flat stretches included, as measured forwards have)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        values = sorted(torch.rand(int(torch.randint(0, 8, (1,), generator=generator)), generator=generator).tolist(),
                        reverse=True)
        steps = sorted((torch.rand(4, generator=generator) * (torch.rand(4, generator=generator) > 0.3)).tolist())
        convex = StepCost(tuple(accumulate([float(torch.rand(1, generator=generator)) + 0.1, *steps])))
        for cost in (StepCost.linear(0.7), StepCost.linear(2.5), StepCost.linear(6.0), convex):
            ratios = [(1 + total) / cost(n) for n, total in enumerate([0.0, *accumulate(values)])]
            kept = worthwhile_count(values, cost)
            assert ratios[kept] == pytest.approx(max(ratios), rel=1e-12), (values, cost)
            assert all(v > worth_floor(cost) for v in values[:kept])  # nothing at or below the floor
    params = SamplingParams()
    strong = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]  # the tail 1 2 3 matches 3 tokens
    weak = [5, 9, 8, 7, 6, 4, 5]  # the tail 5 matches 1 token
    uncut = PromptLookupDrafter()
    assert uncut.propose(strong, 6, params, None).tokens.tolist() == [4, 5, 6, 7, 8, 9]
    assert uncut.propose(weak, 3, params, None).tokens.tolist() == [9, 8, 7]
    cut = PromptLookupDrafter(step_cost=StepCost.linear(2.5))
    # a 3-token match's chain is worth 0.86 0.75 0.68 0.55 0.50 0.48: at 2.5 rows a step the fourth does
    # not pay (0.55 < 3.29 / 5.5), at 8 rows all six do (the last: 0.48 > 4.34 / 13)
    assert cut.propose(strong, 6, params, None).tokens.tolist() == [4, 5, 6]
    assert PromptLookupDrafter(step_cost=StepCost.linear(8.0)).propose(strong, 6, params, None).tokens.tolist() == [
        4, 5, 6, 7, 8, 9]
    assert LOOKUP_ACCEPTANCE[1][0] <= 1 / 2.5  # so a 1-token match's first token (0.25) never pays
    assert cut.propose(weak, 3, params, None).tokens.tolist() == []
    assert PromptLookupDrafter(step_cost=StepCost.linear(1.0)).propose(strong, 6, params, None).tokens.tolist() == []
    # a flat cost (the first verified tokens free, as where a one-token forward waits on memory) keeps them all
    flat = StepCost((1.0, 1.0, 1.0, 1.0, 1.1))  # three tokens free, then a tenth of the step each
    assert PromptLookupDrafter(step_cost=flat).propose(weak, 3, params, None).tokens.tolist() == [9, 8, 7]
    assert PromptLookupDrafter(step_cost=flat).propose(strong, 6, params, None).tokens.tolist() == [4, 5, 6, 7, 8, 9]
    steep = StepCost((1.0, 1.0, 1.0, 1.0, 2.0))  # the same free tokens, then a whole step each
    assert PromptLookupDrafter(step_cost=steep).propose(strong, 6, params, None).tokens.tolist() == [4, 5, 6]


def test_step_costs_from_measured_forwards_are_rising_and_convex():
    """Timed forwards are noisy: StepCost.measured takes the running maximum, then its lower convex hull,
    which keeps the measured points it can and lies at or under the others; costs that fall or bend the
    wrong way are refused outright."""
    from speclens.engine.decoding.drafter import StepCost

    seconds = [6.2, 6.5, 5.9, 6.4, 7.0, 8.0, 8.5, 9.4, 10.3]  # ms: a CPU's forwards of 1 .. 9 tokens
    cost = StepCost.measured(seconds)
    assert len(cost.costs) == len(seconds) and cost(0) == 6.2 and cost(8) == 10.3
    steps = [b - a for a, b in zip(cost.costs, cost.costs[1:])]
    assert all(d >= 0 for d in steps) and all(e >= d - 1e-9 for d, e in zip(steps, steps[1:]))
    rising = [max(seconds[: n + 1]) for n in range(len(seconds))]
    assert all(c <= r + 1e-9 for c, r in zip(cost.costs, rising))
    assert cost(10) == pytest.approx(10.3 + 2 * (10.3 - 9.4))  # past the end, the last step continues
    assert StepCost.linear(4.0)(6) == 10.0
    for bad in ((0.0, 1.0), (2.0, 1.0), (1.0, 2.0, 2.5), (1.0,)):
        with pytest.raises(ValueError):
            StepCost(bad)
    with pytest.raises(ValueError):
        StepCost.linear(0.0)


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace: a word's leading space is part of its piece and the
    decoder drops it at the start of a text), with byte fallback for characters it never saw."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny import CORPUS

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "</s>", *alphabet], show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


class _SlowTokenizer:
    """Just `decode`: what the window-diff fallback needs, as a tokenizer without a Rust backend offers."""

    is_fast = False

    def __init__(self, fast):
        self.fast = fast

    def decode(self, ids, **kwargs):
        return self.fast.decode(ids, **kwargs)


@pytest.mark.parametrize("make_tokenizer", [tiny_tokenizer, _metaspace_tokenizer], ids=["byte-level", "metaspace"])
@pytest.mark.parametrize("stream", [True, False], ids=["DecodeStream", "window-diff"])
def test_streamed_text_is_the_full_decode(make_tokenizer, stream):
    """Token by token, after a prompt, the deltas join into exactly the answer's full decode: spaces
    kept, multi-byte characters (split over byte tokens) emitted whole, on both detokenisers."""
    tok = make_tokenizer()
    prompt = tok("The capital of France", add_special_tokens=False)["input_ids"]
    text = " is Café, naïve, 東京 🙂 and spaces   here\n  def f():"
    answer = tok(text, add_special_tokens=False)["input_ids"]
    detok = make_detokenizer(tok if stream else _SlowTokenizer(tok), prompt)
    assert isinstance(detok, StreamDetokenizer if stream else IncrementalDetokenizer)
    deltas = [detok.add(i) for i in answer]
    full = tok.decode(prompt + answer, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    head = tok.decode(prompt, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(deltas) == full[len(head):]
    assert "".join(deltas).startswith(" is")  # the leading space of the first answer token survives
    assert all("\ufffd" not in d for d in deltas)  # no half characters on the way
    if make_tokenizer is tiny_tokenizer:  # byte-level: the emoji spans several tokens, so some deltas wait
        assert "" in deltas


def test_streaming_skips_special_tokens_like_the_full_decode():
    tok = tiny_tokenizer()
    ids = tok("Paris Rome", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    for detok in (make_detokenizer(tok), IncrementalDetokenizer(tok)):
        assert "".join(detok.add(i) for i in ids) == tok.decode(ids, skip_special_tokens=True) == "Paris Rome"


def test_a_step_cut_short_counts_only_the_drafts_it_used():
    """eagle_lookup's lookup chain may reach past max_new_tokens (its own length); the step is cut there,
    and the statistics count the accepted drafts that were emitted, as accepted_by does."""
    from speclens.engine.drafters.eagle import EagleDrafter, EagleHead
    from speclens.engine.drafters.trees import LookupGraftedDrafter
    from speclens.engine.session import LOOKUP_CHAIN_TOKENS, STORE_CHAIN_TOKENS

    target_model = tiny_llama(seed=0)
    torch.manual_seed(4)
    head = EagleHead.for_target(target_model.config)
    prompt = tiny_tokenizer()("Paris Rome")["input_ids"]
    prompt = prompt + hf_greedy(target_model, prompt, 9)  # the greedy answer repeats: lookup's chain is right
    target = CachedModel(target_model)
    drafter = LookupGraftedDrafter(EagleDrafter(head, target, None, top_k=2, budget=4), "eagle_lookup", None,
                                   LOOKUP_CHAIN_TOKENS, STORE_CHAIN_TOKENS)
    events = list(generate(target, tiny_tokenizer(), prompt, GenerationConfig(k=4, max_new_tokens=2), drafter))
    (step,), summary = [e for e in events if isinstance(e, StepEvent)], events[-1]
    assert list(summary.token_ids) == hf_greedy(target_model, prompt, 2)
    assert step.emitted == 2 and step.accepted == 2 == summary.accepted == sum(n for _, n in summary.accepted_by)
    assert step.drafted == summary.drafted == 2 and summary.accepted_length_histogram == (0, 0, 1)
    assert summary.per_position_acceptance == (1.0, 1.0)


def test_an_unseeded_generation_leaves_torchs_global_generator_alone(target_model):
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    list(generate(CachedModel(target_model), tiny_tokenizer(), prompt_ids(),
                  GenerationConfig(max_new_tokens=3, seed=None, sampling=SamplingParams(temperature=1.0))))
    assert torch.equal(torch.rand(3), expected)
