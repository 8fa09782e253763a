"""A causal LM together with its KV cache and the exact token ids the cache holds.

Rollback is a crop of the cache to a prefix. `forward` feeds whatever part of the requested context
the cache does not hold yet, so prefill, decode, verify and "catch up after a fully accepted block"
are one code path. Invariant: `cached_ids` always equals the tokens whose keys and values the cache
holds, position for position.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from speclens.engine.runtime.lean_forward import lean_forward_for
from speclens.engine.runtime.masks import node_depths, tree_attention
from speclens.engine.runtime.static_forward import StaticLlamaForward, static_forward_for, why_not_static

# Tokens per prefill forward: a 10k-token prompt then answers Stop and Ctrl-C between chunks (about
# 0.4 s each for the default model on 2 cores), and the attention's scores stay [chunk, context].
PREFILL_CHUNK = 128


class AppendLayer(DynamicLayer):
    """A DynamicLayer that writes new keys and values into spare capacity.

    DynamicLayer concatenates the whole cache with the new entries on every forward, an O(context)
    copy per layer per step. Here the entries live in buffers that grow by doubling, so a step copies
    only its new entries, and the layer counts how many it holds (`length`). `keys` and `values` are
    views of the buffers' first `length` entries, made when read: the lean forward moves `length` of
    every layer on every step and reads no view, and making 60 views a step (and 60 more to crop) took
    0.4 ms of a 6 ms forward. In-place writes through `keys`/`values` land in the buffers.
    """

    buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, H, capacity, D] each
    planes: tuple[torch.Tensor, torch.Tensor] | None = None  # the buffers' batch 0, [H, capacity, D] each
    length = 0  # entries held: the buffers' first `length` (when there are buffers)
    _views: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (length, keys, values) last made

    @property
    def keys(self) -> torch.Tensor | None:
        return self._view(1)

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:  # HF's own code (lazy_initialization, reset) sets them
        self._set_view(1, value)

    @property
    def values(self) -> torch.Tensor | None:
        return self._view(2)

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._set_view(2, value)

    def _view(self, which: int) -> torch.Tensor | None:
        if self.buffers is not None and (self._views is None or self._views[0] != self.length):
            end = self.length
            self._views = (end, self.buffers[0][..., :end, :], self.buffers[1][..., :end, :])
        return None if self._views is None else self._views[which]

    def _set_view(self, which: int, value: torch.Tensor | None) -> None:
        # a tensor set from outside replaces the buffers (HF's lazy_initialization sets empty ones)
        views = list(self._views or (0, None, None))
        views[which] = value
        self.buffers = None
        self.length = 0 if value is None or value.dim() < 2 else value.shape[-2]
        views[0] = self.length
        self._views = tuple(views)

    def update(self, key_states, value_states, *args, **kwargs):
        n = self.get_seq_length() if self.is_initialized else 0
        end = n + key_states.shape[-2]
        keys, values = self.reserve(end, key_states, value_states)
        keys[..., n:end, :] = key_states
        values[..., n:end, :] = value_states
        self.advance(end)
        return self.keys, self.values

    def reserve(self, end: int, key_like: torch.Tensor, value_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers [B, H, capacity, D] with capacity >= end, grown by doubling if needed (shaped like
        key_like and value_like [B, H, *, D]); the entries held are kept."""
        if not self.is_initialized:
            self.lazy_initialization(key_like, value_like)
        n = self.get_seq_length()
        if self.buffers is None or end > self.buffers[0].shape[-2]:
            capacity = max(2 * end, 256)
            grown = []
            for old, like in ((self.keys, key_like), (self.values, value_like)):
                # zeros, not garbage: a graph step reads every slot under its mask, and NaN * 0 is NaN
                buffer = like.new_zeros(*like.shape[:-2], capacity, like.shape[-1])  # [B, H, capacity, D]
                if n:
                    buffer[..., :n, :] = old
                grown.append(buffer)
            self.buffers, self.length, self._views = tuple(grown), n, None
            self.planes = tuple(buffer[0] for buffer in grown)  # [H, capacity, D]: batch 1's, what the lean forward writes
        return self.buffers

    def advance(self, end: int) -> None:
        """Hold the buffers' first `end` entries (written there by the caller)."""
        self.length = end

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        if self.buffers is not None:
            return self.length
        return super().get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        """DynamicLayer.crop (a negative count removes that many entries), as a move of `length`."""
        if self.buffers is None or tokens_to_remove >= 0:  # HF's own checks and errors
            return super().crop(tokens_to_remove)
        self.length = max(0, self.length + tokens_to_remove)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, at C speed
        return n
    return next(i for i in range(n) if a[i] != b[i])


def new_cache(config, every_layer: bool = False) -> DynamicCache:
    """HF's DynamicCache with its full-attention layers appending in place (other kinds unchanged), or
    with `every_layer` all of them (the static-cache forward masks sliding windows itself)."""
    cache = DynamicCache(config=config)
    cache.layers = [AppendLayer() if every_layer or type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def sync(device: torch.device) -> None:
    """Wait for a GPU's queued work, so that a timer around it measures it; nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CachedModel:
    def __init__(self, model: PreTrainedModel, n_vocab: int | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        # Logits are cut to the tokenizer's vocabulary so that padding ids are never sampled.
        self.n_vocab = n_vocab or model.config.get_text_config().vocab_size
        self.cached_ids: list[int] = []
        # Positions the model was trained for (None where the config does not say): decoding stops there.
        text_config = model.config.get_text_config()
        limit = getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "n_positions", None)
        self.context_length: int | None = int(limit) if limit else None
        # Opt-in for Medusa / EAGLE heads: final hidden states [n, H] of the positions the latest
        # forward fed, the first at position hidden_start, linear up to hidden_end.
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None
        self.hidden_start = self.hidden_end = 0
        # Opt-in for EAGLE-3 heads (request_features): the hidden states of these layers (HF's
        # hidden_states indices) are kept too, `hidden` then being [n, (1 + len(feature_layers)) H].
        self.feature_layers: tuple[int, ...] = ()
        self.hidden_size = model.config.get_text_config().hidden_size
        # The forward every step runs: the whole decoder in one native call where the model runs on the
        # native CPU kernels; else the static-cache forward (CUDA graphs on a GPU) for the Llama family;
        # else HF's own (`runtime` says which, and why).
        self.lean = lean_forward_for(model) or static_forward_for(model)
        self._cache = new_cache(model.config, self.lean is not None)

    @property
    def runtime(self) -> str:
        """Which forward runs this model, in words (the benchmark and `speclens doctor` print it)."""
        if isinstance(self.lean, StaticLlamaForward):
            return "static-cache forward" + (" with CUDA graphs" if self.lean.graphs else "")
        if self.lean is not None:
            return "native lean forward"
        why = why_not_static(self.model)
        return "HF forward" + (f" (the static-cache forward does not run it: {why})" if why else "")

    def request_features(self, layers: Sequence[int]) -> None:
        """Keep the hidden states of `layers` (HF's hidden_states indices: 0 the embeddings, j the output of
        layer j - 1) of every position fed, beside the final ones (features_at)."""
        top = self.model.config.get_text_config().num_hidden_layers
        if any(not 0 <= j <= top for j in layers):
            raise ValueError(f"feature layers {tuple(layers)} are not hidden-state indices 0..{top} of this model")
        self.feature_layers = tuple(sorted(set(self.feature_layers) | set(layers)))
        self.keep_hidden = True

    def reset(self) -> None:
        self.cached_ids = []
        self._cache = new_cache(self.model.config, self.lean is not None)

    def common_prefix(self, ids: list[int]) -> int:
        return common_prefix(self.cached_ids, ids)

    def truncate(self, n: int) -> None:
        """Roll the cache back so that it holds exactly the first n cached tokens."""
        drop = len(self.cached_ids) - n
        if drop < 0:
            raise ValueError(f"cannot truncate {len(self.cached_ids)} cached tokens to {n}")
        if drop:
            self._cache.crop(-drop)
            del self.cached_ids[n:]

    def prefill(self, ids: list[int], stop: Callable[[], bool] | None = None,
                chunk: int = PREFILL_CHUNK) -> bool:
        """Make the cache hold exactly ids[:-1] (the newest token is fed by the next step).

        The tokens go in forwards of at most `chunk`, so that memory stays bounded on a long prompt and
        `stop` (asked between chunks) can end the prefill within about one chunk's time. Returns False
        when stopped (the cache then holds the chunks done); with keep_hidden, `hidden` covers every
        position fed, as one forward would have left it.
        """
        if len(ids) <= 1:
            self.truncate(0)
            return True
        want = ids[:-1]
        start = min(self.common_prefix(want), len(want) - 1)  # the first position the loop feeds
        hidden: list[torch.Tensor] = []
        end = start
        while end < len(want):
            if stop is not None and stop():
                return False
            end = min(end + chunk, len(want))
            self.forward(want[:end], [], 1)
            if self.keep_hidden and self.hidden is not None:
                hidden.append(self.hidden)  # positions of this chunk: the previous end .. end
        if self.keep_hidden and len(hidden) > 1:
            self.hidden, self.hidden_start, self.hidden_end = torch.cat(hidden), start, len(want)
        return True

    @torch.inference_mode()
    def forward(self, context: list[int], block: list[int], n_logits: int) -> torch.Tensor:
        """Logits [n_logits, V] of the last n_logits positions of context + block.

        The cache is first rolled back to its longest prefix shared with context + block; the rest
        is fed in one forward; positions whose logits are asked for are always fed.
        """
        ids = context + block
        if not 1 <= n_logits <= len(ids):
            raise ValueError(f"n_logits={n_logits} out of range for {len(ids)} tokens")
        keep = min(self.common_prefix(ids), len(ids) - n_logits)
        self.truncate(keep)
        new = ids[keep:]
        if self.lean is not None:  # host tensors: the forward moves what it needs
            logits, hidden = self.lean(torch.tensor(new), torch.arange(keep, len(ids)), None, self._cache, n_logits,
                                       self.keep_hidden, self.feature_layers)
        else:
            input_ids = torch.tensor([new], dtype=torch.long, device=self.device)
            out = self.model(
                input_ids=input_ids,
                cache=self._cache,
                use_cache=True,
                logits_to_keep=n_logits,
                output_hidden_states=self.keep_hidden,
            )
            logits, hidden = out.logits[0, -n_logits:], self._hf_hidden(out)
        if self.keep_hidden:
            self.hidden, self.hidden_start, self.hidden_end = hidden, keep, len(ids)
        self.cached_ids.extend(new)
        return logits[:, : self.n_vocab]

    def time_forwards(self, ids: list[int], sizes: Sequence[int], rounds: int = 5) -> dict[int, float]:
        """Median seconds of one forward over t new tokens, with logits for all t as a verify step needs,
        after ids[:-1] are cached; per t in sizes. Rounds interleave the sizes, after one warm-up round;
        the tokens are ids repeated, so the work is realistic. The cache then holds ids[:-1]."""
        if not ids:
            raise ValueError("timing forwards needs a non-empty prompt")
        self.prefill(ids)
        context = ids[:-1]
        filler = (ids * (max(sizes) // len(ids) + 1))[: max(sizes)]
        times: dict[int, list[float]] = {t: [] for t in sizes}
        for round_ in range(rounds + 1):
            for t in sizes:
                sync(self.device)
                start = time.perf_counter()
                self.forward(context, filler[:t], t)
                sync(self.device)
                if round_:
                    times[t].append(time.perf_counter() - start)
                self.truncate(len(context))
        return {t: sorted(v)[len(v) // 2] for t, v in times.items()}

    @torch.inference_mode()
    def forward_tree(self, context: list[int], tree_tokens: list[int], parents: list[int]) -> torch.Tensor:
        """Logits [N, V] of every node of a token tree hung below context, in one forward.

        tree_tokens[0] must equal context[-1] (the root). Node i attends to the context and to its
        ancestors, at position len(context) - 1 + depth(i), through an explicit 4D mask. Afterwards
        the cache holds context followed by the other N - 1 nodes, whose cached_ids are TREE_SLOT
        (they are not a linear context) until `keep_tree_path` or a truncation removes them.
        """
        if not context or tree_tokens[0] != context[-1]:
            raise ValueError("the tree's root must be the last context token")
        keep = min(self.common_prefix(context), len(context) - 1)
        self.truncate(keep)
        linear = context[keep:-1]  # context tokens the cache lacks, fed causally before the tree
        n_lin, n_tree = len(linear), len(tree_tokens)
        allowed = torch.zeros(n_lin + n_tree, keep + n_lin + n_tree, dtype=torch.bool)  # [Q, KV]
        allowed[:, : keep + n_lin] = True
        allowed[:n_lin, keep : keep + n_lin] = torch.ones(n_lin, n_lin, dtype=torch.bool).tril()
        allowed[n_lin:, keep + n_lin :] = tree_attention(parents)
        depths = torch.tensor(node_depths(parents))
        position_ids = torch.cat([torch.arange(keep, keep + n_lin), keep + n_lin + depths])  # [Q]
        input_ids = torch.tensor(linear + tree_tokens, dtype=torch.long)  # [Q]
        if self.lean is not None:
            logits, hidden = self.lean(input_ids, position_ids, allowed, self._cache, n_tree, self.keep_hidden,
                                       self.feature_layers)
        else:
            dtype = next(self.model.parameters()).dtype
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
            out = self.model(
                input_ids=input_ids[None].to(self.device),
                attention_mask=mask[None, None].to(self.device),  # [1, 1, Q, KV] additive
                position_ids=position_ids[None].to(self.device),
                cache=self._cache,
                use_cache=True,
                logits_to_keep=n_tree,
                output_hidden_states=self.keep_hidden,
            )
            logits, hidden = out.logits[0, -n_tree:], self._hf_hidden(out)
        if self.keep_hidden:  # rows: the linear part, then one per tree node (only the root is linear)
            self.hidden, self.hidden_start, self.hidden_end = hidden, keep, len(context)
        self.cached_ids.extend(linear + tree_tokens[:1] + [TREE_SLOT] * (n_tree - 1))
        return logits[:, : self.n_vocab]

    @torch.inference_mode()
    def keep_tree_path(self, tree_tokens: list[int], path: list[int]) -> None:
        """After forward_tree: keep the root and the nodes of `path` (node indices, depth 1 down),
        moving their keys and values into consecutive slots, and drop the rest of the tree."""
        root = self._tree_root()
        if any(not 0 < node < len(self.cached_ids) - root for node in path):
            raise ValueError(f"path {path} is not inside the cached tree")
        if path != list(range(1, len(path) + 1)):  # a path along the first nodes is in place already
            src = [root + node for node in path]
            dst = list(range(root + 1, root + 1 + len(path)))
            if self.lean is not None:  # every layer an AppendLayer whose buffers the lean forward filled
                self.lean.move_rows([buffer for layer in self._cache.layers for buffer in layer.buffers], src, dst)
            else:
                src, dst = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
                for layer in self._cache.layers:
                    layer.keys[:, :, dst] = layer.keys[:, :, src]  # [B, H, len(path), D]
                    layer.values[:, :, dst] = layer.values[:, :, src]
        drop = len(self.cached_ids) - (root + 1 + len(path))
        if drop:
            self._cache.crop(-drop)
        self.cached_ids[root + 1 :] = [tree_tokens[node] for node in path]
        if self.keep_hidden and self.hidden is not None and self.hidden_end == root + 1:
            n_lin = root - self.hidden_start
            rows = torch.tensor([n_lin + node for node in path], dtype=torch.long, device=self.device)
            self.hidden = torch.cat([self.hidden[: n_lin + 1], self.hidden[rows]])
            self.hidden_end = root + 1 + len(path)

    def _hf_hidden(self, out) -> torch.Tensor | None:
        """From HF's output: final hidden states [T, H], then those of feature_layers, as one [T, (1 + n) H]."""
        if not self.keep_hidden:
            return None
        states = out.hidden_states
        return torch.cat([states[-1][0], *(states[j][0] for j in self.feature_layers)], dim=-1)

    def _kept(self, start: int, end: int) -> torch.Tensor | None:
        valid_end = min(self.hidden_end, len(self.cached_ids))
        if self.hidden is None or not self.hidden_start <= start <= end <= valid_end:
            return None
        return self.hidden[start - self.hidden_start : end - self.hidden_start]

    def hidden_at(self, start: int, end: int) -> torch.Tensor | None:
        """Final hidden states [end - start, H] of cached positions start..end-1, if the latest
        forward kept them (keep_hidden) and they are still cached; else None."""
        kept = self._kept(start, end)
        return None if kept is None else kept[:, : self.hidden_size]

    def features_at(self, start: int, end: int, layers: Sequence[int]) -> torch.Tensor | None:
        """Hidden states of `layers` (asked for with request_features) at cached positions start..end-1,
        side by side: [end - start, len(layers) H]; None where hidden_at would be."""
        kept = self._kept(start, end)
        if kept is None:
            return None
        h = self.hidden_size
        blocks = [(1 + self.feature_layers.index(j)) * h for j in layers]
        return torch.cat([kept[:, b : b + h] for b in blocks], dim=-1)

    def _tree_root(self) -> int:
        """Slot of the root of the tree held after forward_tree (the last non-TREE_SLOT slot)."""
        slot = len(self.cached_ids) - 1
        while slot >= 0 and self.cached_ids[slot] == TREE_SLOT:
            slot -= 1
        if slot < 0:
            raise ValueError("no token tree in the cache")
        return slot


TREE_SLOT = -1  # cached_ids entry of a tree node that is not part of a linear context
