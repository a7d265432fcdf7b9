"""What the pre-flight check and the audit share: how exact aux states must be, the verdict words and
exit codes, and the facts read inside vLLM's engine.
"""
