"""What runs inside a child interpreter: scripts the test process starts by path with the test
environment's Python, the modules they share, and the sites/ instrumentations (sitecustomize).

A script run by path has this directory first on sys.path and not the repository, so that the
child imports stock vLLM and no vllm_hotfix from the checkout: here modules import each other by
bare name (`import in_process`), inside the function that needs them where the module is also
imported from the test process as `harness.child.NAME`.
"""
