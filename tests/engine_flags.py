"""Run in the test environment's interpreters (tests/in_subprocess.py), which have no pytest: the
installed vLLM's engine flags that the hotfix's own commands would take for one of theirs."""

from __future__ import annotations

import argparse
from typing import Any


def refused_engine_flags() -> dict[str, Any]:
    """Every long flag of the installed vLLM's engine parser that verify's or audit's parser would
    refuse as a near miss of its own options (run in the test environment)."""
    from vllm.engine.arg_utils import EngineArgs, FlexibleArgumentParser

    from vllm_hotfix.commands import parser as command_line

    engine = EngineArgs.add_cli_args(FlexibleArgumentParser())
    flags = sorted({s for a in engine._actions for s in a.option_strings if s.startswith("--")})
    commands = next(
        a for a in command_line.build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    refused = {}
    for name in ("verify", "audit"):
        parser = commands.choices[name]
        own = {s for a in parser._actions for s in a.option_strings}
        refused[name] = [f for f in flags if f not in own and f != "--model" and parser.not_ours([f])]
    return {"flags": len(flags), "refused": refused}
