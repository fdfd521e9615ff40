"""Helpers shared by tests: generators of inputs in other tools' formats."""
