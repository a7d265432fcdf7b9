"""The in-worker check of the aux hidden states (VLLMHOTFIX_VERIFY), and `vllm-hotfix verify`.

Wrong aux states are silent: a draft or a training set built from them is simply worse. So, when a
user asks for it, every vLLM worker checks the states its model hands to the runner, for the first
few steps, and logs one verdict line per process:

- `settings.py`: the switches (VLLMHOTFIX_VERIFY, VLLMHOTFIX_VERIFY_REPORT,
  VLLMHOTFIX_VERIFY_TIMEOUT, and the run id VLLMHOTFIX_VERIFY_RUN_ID set by the command), read
  without torch;
- `checks.py`: the checks of one step (count and shape, ranks agree, finite, final id), with torch;
- `exchange.py`: the one exchange per checked step between the TP ranks (CPU group, deadline,
  handshake), which a rank whose check raised still joins;
- `window.py`: the steps of one process together: verdict, log line, JSON report, hint;
- `seam.py`: where the runner receives the states, probed per loaded runner class, and the
  wrapper put there for the window only;
- `command.py`: `vllm-hotfix verify MODEL`, which starts vLLM with the check on;
- `outcome.py`: that command's verdict and exit code from the workers' reports of its run.
"""
