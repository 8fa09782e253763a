"""The decoding algorithm, as functions over a runtime.

Owns sampling (warping and penalties), verification (modified rejection sampling for chains and
trees, greedy acceptance), the drafter interface (drafter), the chain step (step), token trees and
the tree step (tree), the decoding loop that yields events (decode, events) and the advisor that
predicts speedups from measured costs (advisor). Imports only speclens.engine.runtime.
"""
