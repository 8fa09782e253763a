"""`speclens train-drafter`: train EAGLE-1 or Medusa-1 heads for a target by self-distillation, or
build a retrieval datastore of its answers.

1. distil (distil.py): the target answers the training prompts (chat template) in left-padded
   batches, greedily and optionally also sampled; one teacher-forced pass over each batch of prompt
   + answer then gives the target's final hidden states (features) at every position. Committed
   token-id shards (shards.py) let distilled answers accumulate across runs and machines.
2. train (loop.py): one loop for every head kind; the kind (eagle.py, medusa.py) gives the head and
   its loss. Sequences are packed into steps of about `tokens_per_step` tokens (block-diagonal
   causal attention), in bfloat16 autocast.
3. evaluate (evaluate.py): mean accepted length tau (emitted tokens / target passes, greedy) on
   held-out prompts, for each decoding setup of the head, written into a model card (card.py).

run.py ties the stages together (and is the only place that knows the datastore, datastore.py,
trains nothing); options.py holds TrainOptions and the command line.

Other prompt sets can join a run: `--distil-only` distils them into a data file that another run
adds with `--extra-data`. The held-out prompts' greedy answers are distilled too
(OUT/held-out.pt), so every epoch also records the head's top-1 agreement on them.

Distillation and training run on `device` (a CUDA GPU when there is one). On a GPU the tau
measurement can wait (`eval_tokens` 0) for `evaluate_only`, which decodes the run's held-out
prompts on the CPU where the head will be used.

Stages are resumable: the distilled data (DATA, by default OUT/distilled.pt, saved every
SAVE_EVERY_S and after the last batch) and a checkpoint (weights, optimiser, epoch) are picked up by
a rerun with the same arguments. Output: config.json + model.safetensors + README.md + training.json
(whose "run" record lets `evaluate_only` rebuild the card).

Adding a head type (EAGLE-3, Hydra, ...): one module with a `kind.HeadKind` subclass (its head,
loss, decoding setups and card line), registered in registry.py and named in options.KINDS.

Only the standard library is imported at module level, so that `speclens --help` stays fast.
"""
