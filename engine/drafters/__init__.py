"""Drafters: implementations of the one interface in speclens.engine.decoding.drafter.

draft_model (a small LM, chains), trees (a small LM proposing token trees; lookup and datastore
chains grafted into another drafter's trees), eagle (EAGLE-2 heads on the target's features),
medusa (Medusa heads), lookup (prompt lookup), datastore (REST-style retrieval of the target's
earlier answers), synthetic (a drafter with a chosen acceptance, for benchmarks) and vocab (a
head's draft vocabulary). A new drafter is one module here. Imports decoding and runtime only.
"""
