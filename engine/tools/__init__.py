"""The commands: `speclens generate | bench | selftest | doctor | train-drafter` (cli, args), and what
they are made of: the benchmark (bench), the exactness self-test (selftest), the environment report
(doctor) and drafter training with its distilled data (train). The top layer of the
engine: it may import everything below it, and nothing below imports it.
"""
