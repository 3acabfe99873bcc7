"""Extensions defined outside kfac_compiler, as a user would write them, one file each: a Fisher
block, an optimizer, a differentiation rule and a loss (tests/test_extension_*.py)."""
