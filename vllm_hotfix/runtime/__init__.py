"""What every vLLM process loads: the switches, arming, decisions, probes' verdicts, installing a
patched function and the store of generated sources. Imports nothing of the rest of the package.
"""
