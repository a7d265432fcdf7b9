"""The code the tests, benchmarks and scripts use to run real vLLM, and the maintainers' release
tooling (never shipped): the drivers used from the test process here, what runs inside a child
interpreter in harness/child/ (see its docstring for how it imports), the release tooling in
harness/releases/ (`python -m harness.releases`). docs/development.md, "Where things are", has the
whole layout."""
