"""The commands: `speclens generate | bench | selftest | doctor | train-drafter` (cli, args), and what
they are made of: the benchmark (bench), the exactness self-test (selftest), the environment report
(doctor), distilled training data (distilled) and drafter training (train). The top layer of the
engine: it may import everything below it, and nothing below imports it.
"""
