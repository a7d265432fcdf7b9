"""Model Runner V2 ignores an EAGLE3 draft's aux layer ids kept under `eagle_config`.

Why: the V1 runner and the EAGLE3 drafts read the ids from
`eagle_config["eagle_aux_hidden_state_layer_ids"]` when the draft's config has no top-level ids (the
form SpecForge and EAGLE checkpoints use); the V2 runner's resolver, `get_eagle3_aux_layers_from_config`
(vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py), never reads that nested key and falls back to
the target's default layers: with three declared ids the draft runs on layers it was not trained on,
with no error. V2 is the default on CUDA from 0.29.0 and the only runner in 0.34.0.

How: derived from the installed resolver, the nested key is read in the V1 runner's order of
precedence, right after the top-level ids; where the resolver returns early without top-level ids
(0.22.0-0.23.0) that return becomes the V1 runner's `getattr(..., None)` read. Releases whose drafts
do not read the nested key (the probe reads llama_eagle3.py) are `not affected`.

Affected releases: vLLM 0.22.0 to 0.34.0 and later.

Upstream: not fixed as of vLLM 0.34.0; the patch offered is in upstream/eagle3-nested-layer-ids/.

When to drop: when upstream's resolver reads the nested key and the project stops supporting the
releases before that.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Mapping

from vllm_hotfix.fixes.base import Fix, Probe, parse_function, parse_or_unknown, reads_key, same_code
from vllm_hotfix.runtime.decisions import Decision

KEY = "eagle_aux_hidden_state_layer_ids"
DRAFT_MODULE = "vllm.model_executor.models.llama_eagle3"
TOP_LEVEL = f'layer_ids = getattr(hf_config, "{KEY}", None)'
NO_TOP_LEVEL = f'if not hasattr(hf_config, "{KEY}"):\n    return None'
READ_TOP_LEVEL = f"layer_ids = hf_config.{KEY}"
TO_TUPLE = "if layer_ids and isinstance(layer_ids, (list, tuple)):\n    return tuple(layer_ids)"
# The V1 runner's read of the nested key, as its `if not layer_ids:` branch does it: (depth, line).
NESTED_READ = (
    (0, "if not layer_ids:"),
    (1, 'eagle_config = getattr(hf_config, "eagle_config", None)'),
    (1, "if eagle_config and isinstance(eagle_config, dict):"),
    (2, f'layer_ids = eagle_config.get("{KEY}")'),
)


class Shape:
    """Where the resolver reads the top-level ids (the statements the fix replaces or follows)."""

    def __init__(self, function: ast.FunctionDef) -> None:
        body = function.body
        self.anchor: ast.stmt | None = None  # the getattr read, followed by the nested read
        self.early: tuple[ast.stmt, ast.stmt] | None = None  # hasattr-return + attribute read
        self.missing: list[str] = []
        reads = 0
        for index, statement in enumerate(body):
            if same_code(statement, TOP_LEVEL):
                self.anchor, reads = statement, reads + 1
            elif same_code(statement, NO_TOP_LEVEL) and index + 1 < len(body):
                if same_code(body[index + 1], READ_TOP_LEVEL):
                    self.early, reads = (statement, body[index + 1]), reads + 1
        if reads != 1:
            self.missing.append(
                f"exactly one read of the top-level ids (`{TOP_LEVEL}`, or `{NO_TOP_LEVEL.splitlines()[0]}"
                f" return None` then `{READ_TOP_LEVEL}`)"
            )
        if not any(same_code(statement, TO_TUPLE) for statement in body):
            self.missing.append(f"`{TO_TUPLE.splitlines()[0]} return tuple(layer_ids)`")
        if any(
            isinstance(node, ast.Name) and node.id == "eagle_config" and isinstance(node.ctx, ast.Store)
            for node in ast.walk(function)
        ):
            self.missing.append("no other use of the name `eagle_config`")


class Eagle3NestedLayerIds(Fix):
    """get_eagle3_aux_layers_from_config (Model Runner V2) also reads eagle_config's aux layer ids."""

    fix_id = "eagle3-nested-layer-ids"
    title = "Model Runner V2 feeds an EAGLE3 draft the layers its eagle_config declares"
    module = "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils"
    owner = None
    attribute = "get_eagle3_aux_layers_from_config"
    affected = ("0.22.0", "0.34.0")
    fixed_in = None
    upstream = (
        "none yet (vLLM issue #40551 reports worse EAGLE3 acceptance on Model Runner V2; the V1 runner"
        " reads the nested ids from 0.22.0)"
    )
    related = (DRAFT_MODULE,)
    absent = Decision.NOT_AFFECTED  # before 0.17.0 there is no V2 resolver

    def probe_source(self, source: str, related: Mapping[str, str | None] | None = None) -> Probe:
        function = parse_or_unknown(source)
        if isinstance(function, Probe):
            return function
        if reads_key(function, KEY):
            return Probe(Decision.FIXED_UPSTREAM, f'the resolver reads `eagle_config["{KEY}"]`')
        shape = Shape(function)
        if shape.missing:
            missing = "; ".join(shape.missing)
            return Probe(Decision.UNKNOWN, f"not the known shape of the V2 resolver; missing: {missing}")
        if shape.early is not None:
            # The early-return form predates the drafts' nested read in some releases: ask the draft.
            draft = (related or {}).get(DRAFT_MODULE)
            if draft is None:
                return Probe(Decision.UNKNOWN, f"{DRAFT_MODULE} could not be read")
            try:
                draft_tree = ast.parse(draft)
            except SyntaxError as error:
                return Probe(Decision.UNKNOWN, f"{DRAFT_MODULE} could not be parsed: {error}")
            if not reads_key(draft_tree, KEY):
                return Probe(
                    Decision.NOT_AFFECTED,
                    f'the EAGLE3 draft does not read `eagle_config["{KEY}"]` either: both runners and the'
                    " draft ignore the nested ids alike",
                )
        return Probe(
            Decision.PATCHED,
            f'the resolver never reads `eagle_config["{KEY}"]`, which the V1 runner and the draft read:'
            " the target captures its default layers instead of the declared ones; fixed: read it right"
            " after the top-level ids",
        )

    def transform_source(self, source: str) -> str:
        text = textwrap.dedent(source)
        function = parse_function(text)
        shape = Shape(function)
        lines = text.splitlines(keepends=True)
        first = function.body[0]
        indent, unit = " " * first.col_offset, " " * (first.col_offset - function.col_offset)
        nested = [f"{indent}{unit * depth}{line}\n" for depth, line in NESTED_READ]
        if shape.anchor is not None:  # after the top-level read
            end = shape.anchor.end_lineno
            assert end is not None
            return "".join(lines[:end] + nested + lines[end:])
        # the early return and the attribute read become the V1 runner's getattr read
        assert shape.early is not None
        start, end = shape.early[0].lineno, shape.early[1].end_lineno
        assert end is not None
        return "".join([*lines[: start - 1], f"{indent}{TOP_LEVEL}\n", *nested, *lines[end:]])
