"""SpecLens engine: exact speculative decoding. Knows nothing about Qt.

Layers, each importing only the ones before it (tests/test_layering.py):

    runtime   models, caches, forward passes, kernels
    decoding  sampling, verification, the drafter interface, chain and tree steps, the loop
    drafters  the drafter implementations
    session   Engine: what front ends (the window, the commands) talk to
    tools     the commands: generate, bench, selftest, doctor, train-drafter
"""
