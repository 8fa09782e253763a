"""The model runtime: everything that turns token ids into logits, fast.

Owns loading and converting models (models, paths), the KV cache and its tree forward (cache,
masks), attention over a cached prefix (attention), CPU kernels (cpu_kernels: packed MKL blocks;
native_kernels + native_kernels.cpp: SpecLens's own compiled decoder), the lean Llama forward
(lean_forward) and incremental detokenisation (detok). A new runtime (a static-cache GPU forward,
integer CPU kernels) lands here, behind CachedModel. Imports nothing else of SpecLens.
"""
