"""What test modules share: models, data, launchers, DDP reference runners and the parity check.

Test modules import from here only, never from one another (tests/test_test_layout.py checks it), so a
test file can be renamed, split or deleted without breaking another one.
"""
