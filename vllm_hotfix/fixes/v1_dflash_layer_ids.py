"""The V1 runner drops a DFlash draft's aux layer ids when its config also has an `eagle_config`.

Why: with no top-level `eagle_aux_hidden_state_layer_ids`,
`GPUModelRunner._get_eagle3_aux_layers_from_config` (vllm/v1/worker/gpu_model_runner.py) takes
DFlash's `dflash_config["target_layer_ids"]`, then, whenever `eagle_config` is a dict, overwrites
them with `eagle_config.get("eagle_aux_hidden_state_layer_ids")`: `None` when that key is not
there (a DFlash checkpoint's `eagle_config` holds other keys), and the runner sets the target's
default layers, with no error.

How: derived from the installed method, that one assignment becomes `layer_ids =
eagle_config.get(...) or layer_ids`: the nested ids still win when present (V1's order, which
eagle3-nested-layer-ids gives V2), DFlash's are kept when not.

Affected releases: vLLM 0.22.0 to 0.33.x (0.34.0 has no V1 runner).

Upstream: not fixed; the patch offered is in upstream/v1-dflash-layer-ids/.

When to drop: when the project no longer supports vLLM 0.22.0 to 0.33.x.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping

from vllm_hotfix.fixes.base import Fix, Probe, parse_function, parse_or_unknown, reads_key, same_code
from vllm_hotfix.runtime.decisions import Decision

KEY = "eagle_aux_hidden_state_layer_ids"
TOP_LEVEL = f'layer_ids = getattr(hf_config, "{KEY}", None)'
DFLASH_BIND = 'dflash_config = getattr(hf_config, "dflash_config", None)'
EAGLE_BIND = 'eagle_config = getattr(hf_config, "eagle_config", None)'
DFLASH_TEST = "dflash_config and isinstance(dflash_config, dict)"
OVERWRITE = f'if eagle_config and isinstance(eagle_config, dict):\n    layer_ids = eagle_config.get("{KEY}")'
KEPT = f'layer_ids = eagle_config.get("{KEY}") or layer_ids'
TO_TUPLE = "if layer_ids and isinstance(layer_ids, (list, tuple)):\n    return tuple(layer_ids)"


def _assigns_layer_ids(statement: ast.stmt) -> bool:
    return any(
        isinstance(node, ast.Name) and node.id == "layer_ids" and isinstance(node.ctx, ast.Store)
        for node in ast.walk(statement)
    )


class Shape:
    """The block that reads DFlash's ids then overwrites them with the nested ones (0.22.0-0.33.x)."""

    def __init__(self, function: ast.FunctionDef) -> None:
        self.overwrite: ast.Assign | None = None  # `layer_ids = eagle_config.get(KEY)`
        self.missing: list[str] = []
        body = function.body
        reads = [index for index, statement in enumerate(body) if same_code(statement, TOP_LEVEL)]
        block = body[reads[0] + 1] if len(reads) == 1 and reads[0] + 1 < len(body) else None
        if not (isinstance(block, ast.If) and ast.dump(block.test) == _test("not layer_ids")):
            self.missing.append(f"exactly one `{TOP_LEVEL}` followed by `if not layer_ids:`")
            return
        inner = block.body
        if not any(same_code(statement, DFLASH_BIND) for statement in inner):
            self.missing.append(f"`{DFLASH_BIND}` in the `if not layer_ids:` block")
        if not any(same_code(statement, EAGLE_BIND) for statement in inner):
            self.missing.append(f"`{EAGLE_BIND}` in the `if not layer_ids:` block")
        dflash = [
            index
            for index, statement in enumerate(inner)
            if isinstance(statement, ast.If)
            and ast.dump(statement.test) == _test(DFLASH_TEST)
            and _assigns_layer_ids(statement)
            and reads_key(statement, "target_layer_ids")
        ]
        overwrites = [index for index, statement in enumerate(inner) if same_code(statement, OVERWRITE)]
        if len(dflash) != 1:
            self.missing.append(
                f"exactly one `if {DFLASH_TEST}:` that sets `layer_ids` from"
                ' `dflash_config.get("target_layer_ids")`'
            )
        if len(overwrites) != 1:
            test, assign = OVERWRITE.splitlines()
            self.missing.append(f"exactly one `{test} {assign.strip()}`")
        if len(dflash) == 1 and len(overwrites) == 1 and overwrites[0] < dflash[0]:
            self.missing.append("the nested read after the DFlash read")
        if not any(same_code(statement, TO_TUPLE) for statement in body):
            self.missing.append(f"`{TO_TUPLE.splitlines()[0]} return tuple(layer_ids)`")
        if not self.missing:
            statement = inner[overwrites[0]]
            assert isinstance(statement, ast.If) and isinstance(statement.body[0], ast.Assign)
            self.overwrite = statement.body[0]


def _test(expression: str) -> str:
    return ast.dump(ast.parse(expression, mode="eval").body)


class V1DflashLayerIds(Fix):
    """GPUModelRunner._get_eagle3_aux_layers_from_config keeps DFlash's ids beside an eagle_config."""

    fix_id = "v1-dflash-layer-ids"
    title = "the V1 runner keeps a DFlash draft's layer ids when its config has an eagle_config"
    module = "vllm.v1.worker.gpu_model_runner"
    owner = "GPUModelRunner"
    attribute = "_get_eagle3_aux_layers_from_config"
    affected = ("0.22.0", "0.33.0")
    fixed_in = None
    upstream = (
        "none (0.34.0 removed the V1 runner; Model Runner V2's resolver keeps DFlash's ids unless"
        " eagle_config declares its own)"
    )
    absent = Decision.NOT_AFFECTED  # before 0.11.1 no method; 0.34.0 no V1 runner

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        function = parse_or_unknown(source)
        if isinstance(function, Probe):
            return function
        if any(same_code(node, KEPT) for node in ast.walk(function)):
            return Probe(
                Decision.FIXED_UPSTREAM,
                f'the resolver keeps the ids it has when `eagle_config` has no "{KEY}"',
            )
        if not (reads_key(function, KEY) and reads_key(function, "target_layer_ids")):
            return Probe(
                Decision.NOT_AFFECTED,
                f'the resolver does not read both DFlash\'s "target_layer_ids" and `eagle_config["{KEY}"]`:'
                " no nested read can drop DFlash's ids",
            )
        shape = Shape(function)
        if shape.missing:
            missing = "; ".join(shape.missing)
            return Probe(Decision.UNKNOWN, f"not the known shape of the V1 resolver; missing: {missing}")
        return Probe(
            Decision.PATCHED,
            f'a dict `eagle_config` overwrites DFlash\'s ids with its "{KEY}", None when it has none, and'
            " the target captures its default layers; fixed: the nested ids win only when present",
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        shape = Shape(parse_function(text))
        assert shape.overwrite is not None
        value = shape.overwrite.value  # ` or layer_ids` goes right after it, on its last line
        end, column = value.end_lineno, value.end_col_offset
        assert end is not None and column is not None
        lines = text.splitlines(keepends=True)
        line = lines[end - 1]
        lines[end - 1] = f"{line[:column]} or layer_ids{line[column:]}"
        return "".join(lines)
