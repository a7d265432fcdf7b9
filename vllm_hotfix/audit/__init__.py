"""`vllm-hotfix audit`: which files of a dataset of aux states already made are wrong, and which ids.

The files (safetensors with `hidden_states` [tokens, ids, hidden] and `token_ids` [tokens], as
vLLM's ExampleHiddenStatesConnector and speculators' `generate-offline-data` write them) are read,
never written; their states are recomputed by an engine whose own states the pre-flight check
proves right in the same run, and compared per file, per id and per token (compare.py).
"""
