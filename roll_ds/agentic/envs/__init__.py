"""The shipped environments (registered by name in ``roll_ds/agentic/registry.py``).

guess_number.py   ``GuessNumberEnv``: guess a secret number from "higher" / "lower" replies
calculator.py     ``CalculatorEnv``: multiply two numbers with the ``calc`` tool
"""
