"""Medusa-1 heads (Cai et al. 2024): extra decoding heads on the target's last hidden state.

Head i (0-based) is a residual block x + SiLU(W x) (repeated medusa_num_layers times) followed by a
vocabulary projection; from the hidden state at position t (whose own LM head gives token t+1) it
predicts token t+2+i. Head i's top-r tokens become the candidates at tree depth i+1, the same for
every node at that depth (heads do not see the tree path), so children are deterministic and are
verified as one-hot drafts.

Checkpoint layout (as published): config.json with medusa_num_heads, medusa_num_layers,
base_model_name_or_path; weights in medusa_lm_head.pt (loaded with weights_only=True) or
model.safetensors, keys "{head}.{layer}.linear.weight|bias" and "{head}.{medusa_num_layers}.weight".
With "medusa_shared_lm_head": true in config.json the heads reuse the target's LM head (no
"{head}.{medusa_num_layers}.weight" keys), which keeps small-target checkpoints small. Such a checkpoint
may also hold "draft_vocab" [N] (ours, as for EAGLE heads): the token ids the heads may draft. Scoring
only those rows of the shared LM head streams a sixth of its weights per step for N = 8192 of 49152;
exactness never depends on it (a draft outside the target's choice is simply rejected).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from speclens.engine.decoding.drafter import StatelessDrafter, StepCost
from speclens.engine.decoding.sampling import SamplingParams, process_logits
from speclens.engine.decoding.tree import DraftTree, TreeShape, keep_worthwhile
from speclens.engine.drafters.vocab import draft_vocab_rows, full_vocab_logits
from speclens.engine.runtime.cache import CachedModel
from speclens.engine.runtime.cpu_kernels import drafter_module, drafting_dtype
from speclens.engine.runtime.masks import node_depths


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as the identity, as in Medusa
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.ModuleList):
    """Head i: num_layers ResBlocks, then a vocabulary projection, either its own (as published:
    key "{i}.{num_layers}.weight") or, with shared_lm_head, the target's LM head passed to forward
    (config "medusa_shared_lm_head": true; the checkpoint then holds only the residual blocks)."""

    def __init__(self, hidden: int, vocab: int, num_heads: int = 4, num_layers: int = 1,
                 shared_lm_head: bool = False):
        super().__init__(
            nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)],
                          *([] if shared_lm_head else [nn.Linear(hidden, vocab, bias=False)]))
            for _ in range(num_heads)
        )
        self.shared_lm_head = shared_lm_head
        self.draft_vocab: torch.Tensor | None = None  # [N] long: token ids the heads draft (None: all)
        self.config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "hidden_size": hidden,
                       "vocab_size": vocab, "medusa_shared_lm_head": shared_lm_head}

    def logits(self, head: nn.Module, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """One head's logits [..., V] from hidden [..., H]."""
        if not self.shared_lm_head:
            return head(hidden)
        if lm_head is None:
            raise ValueError("these Medusa heads share the target's LM head: pass it as lm_head")
        return lm_head(head(hidden))

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module | None = None) -> torch.Tensor:
        """hidden [..., H] -> logits [..., num_heads, V]; lm_head: the target's (needed if shared)."""
        if self.shared_lm_head and lm_head is not None:  # one pass over the big LM head for all heads
            return lm_head(torch.stack([head(hidden) for head in self], dim=-2))
        return torch.stack([self.logits(head, hidden, lm_head) for head in self], dim=-2)

    @classmethod
    def load(cls, folder: str | Path, hidden: int, vocab: int) -> MedusaHeads:
        folder = Path(folder)
        config = json.loads((folder / "config.json").read_text())
        if config.get("vocab_size", vocab) != vocab:  # shared-LM-head files hold no vocabulary-sized weight to catch it
            raise ValueError(f"these heads were trained for a vocabulary of {config['vocab_size']} tokens, "
                             f"the target has {vocab}")
        heads = cls(hidden, vocab, config["medusa_num_heads"], config.get("medusa_num_layers", 1),
                    shared_lm_head=bool(config.get("medusa_shared_lm_head", False)))
        if (folder / "model.safetensors").exists():
            from safetensors.torch import load_file

            state = load_file(folder / "model.safetensors")
        else:
            state = torch.load(folder / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
        draft_vocab = state.pop("draft_vocab", None)
        heads.load_state_dict({k: v.float() for k, v in state.items()})
        if draft_vocab is not None:
            if not heads.shared_lm_head:
                raise ValueError("draft_vocab needs heads that share the target's LM head")
            if draft_vocab.dim() != 1 or not 0 < len(draft_vocab) <= vocab:
                raise ValueError(f"draft_vocab must list 1..{vocab} token ids")
            heads.draft_vocab = draft_vocab.long()
        heads.config.update({k: v for k, v in config.items() if k not in heads.config})
        return heads.eval()

    def save(self, folder: str | Path) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.config, indent=2))
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        if self.draft_vocab is not None:
            state["draft_vocab"] = self.draft_vocab.cpu().contiguous()
        save_file(state, folder / "model.safetensors")


def sparse_tree_paths(accuracy: list[list[float]], n_nodes: int) -> list[tuple[int, ...]]:
    """Medusa's sparse tree: n_nodes paths chosen greedily by expected acceptance, where
    accuracy[d][r] is how often head d's rank-r candidate is the right token at depth d + 1 (a path's
    value is the product along it, assuming independent heads). Children get ranks 0, 1, ... in order."""
    chosen: list[tuple[int, ...]] = []
    values = {(): 1.0}
    children = {(): 0}  # path -> number of children chosen so far
    while len(chosen) < n_nodes:
        candidates = [(values[p] * accuracy[len(p)][children[p]], p + (children[p],)) for p in values
                      if len(p) < len(accuracy) and children[p] < len(accuracy[len(p)])]
        if not candidates:
            break
        value, path = max(candidates)
        chosen.append(path)
        values[path], children[path] = value, 0
        children[path[:-1]] += 1
    return chosen


class MedusaDrafter(StatelessDrafter):
    """Proposes a static tree from Medusa heads applied to the target's hidden state.

    Reads the target's final hidden state at the last cached position (the target CachedModel is
    switched to keep_hidden); with none available it proposes the root alone (a plain step). A node is
    worth the product of its heads' probabilities along its path; with `step_cost` the tree keeps only
    the nodes worth verifying (keep_worthwhile).
    """

    def __init__(self, heads: MedusaHeads, target: CachedModel, shape: TreeShape, name: str = "medusa",
                 step_cost: StepCost | None = None):
        self.dtype = drafting_dtype(target.model)
        self.heads = drafter_module(heads, target.model)
        self.lm_head = None  # the heads' own projections, or (shared) the target's LM head in drafting precision
        self._vocab = None  # the token ids the shared LM head's rows score (None: all)
        if heads.shared_lm_head:
            self._vocab, self.lm_head = draft_vocab_rows(target, heads.draft_vocab)
        self.target = target
        self.shape = shape
        self.name = name
        self.step_cost = step_cost
        target.keep_hidden = True

    @torch.inference_mode()
    def propose_tree(
        self, ids: list[int], depth: int, params: SamplingParams, generator: torch.Generator | None
    ) -> DraftTree:
        shape = self.shape.truncated(min(depth, len(self.heads)))
        hidden = self.target.hidden_at(len(ids) - 2, len(ids) - 1)  # [1, H]: its logits chose ids[-1]
        if hidden is None:
            return DraftTree(torch.tensor([ids[-1]], device=self.target.device), (-1,), None)
        rows = self.heads(hidden[0].to(self.dtype), self.lm_head)  # [heads, V], or [heads, N] over _vocab
        logits = full_vocab_logits(rows, self._vocab, self.target.n_vocab)  # [heads, V]
        history = torch.tensor(ids, device=logits.device)
        scores = process_logits(logits, params, history, history[:0])  # [heads, V]; ranks only
        top = scores.softmax(-1).topk(1 + max(shape.ranks), dim=-1)  # [heads, ranks]
        candidates, probs = top.indices.tolist(), top.values.tolist()
        depths = node_depths(shape.parents)
        tokens, values = [ids[-1]], [1.0]
        for node in range(1, len(shape.parents)):
            head, rank = depths[node] - 1, shape.ranks[node]
            tokens.append(candidates[head][rank])
            values.append(values[shape.parents[node]] * probs[head][rank])
        tree = DraftTree(torch.tensor(tokens, device=self.target.device), shape.parents, None, values=tuple(values))
        return tree if self.step_cost is None else keep_worthwhile(tree, self.step_cost)
