"""Fisher blocks defined outside kfac_compiler, as a user would (tests/test_extension_block.py)."""
