"""The command line: one parser, the JSON envelope, one module per command, and the engine session
that `verify` and `audit` run on.
"""
