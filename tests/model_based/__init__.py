"""The model-based test's harness (tests/test_model_based.py): the modelled project, the steps a seeded
generator draws, and the invariants checked after each step."""
