"""Run configurations shared by several test modules, so that identical engine runs are made once."""

import pytest

N = 4  # layers in the tiny checkpoint: id 4 is the final layer's output
WITH_FINAL = ["1,4", "4", "1,2,4", "4,1", "1,1,4"]
WITHOUT_FINAL = ["1,2", "2", ""]
EAGER_VARIANTS = ";".join(WITH_FINAL + WITHOUT_FINAL)
# Eager runs also trace DeepseekV2Model's graph and run the whole model compiled (a compiled parent).
EAGER_OPTIONS = ("--graph-variants", "1,4;1,2", "--parent-variants", "1,4")
# Tests that read these eager runs stay on one pytest-xdist worker, whose session cache holds them.
EAGER_GROUP = pytest.mark.xdist_group("eager-states")
