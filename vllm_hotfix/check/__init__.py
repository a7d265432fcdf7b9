"""`vllm-hotfix verify`: a pre-flight check of the aux hidden states, in an engine of its own.

Wrong aux states are silent: a draft or a training set built from them is simply worse. The command
(command.py) starts vLLM with the user's flags; hook.py and taps.py hook only the model; checks.py,
reference.py and outcome.py judge the ranks' records after the run (docs/design.md, section 8).
"""
