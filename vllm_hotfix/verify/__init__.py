"""The in-worker check of the aux hidden states (VLLM_HOTFIX_VERIFY), and `vllm-hotfix verify`.

Wrong aux states are silent: a draft or a training set built from them is simply worse. So, when a
user asks for it, every vLLM worker checks the states its model hands to the runner, for the first
few steps, and logs one verdict line per process:

- `settings.py`: the switches (VLLM_HOTFIX_VERIFY, VLLM_HOTFIX_VERIFY_REPORT,
  VLLM_HOTFIX_VERIFY_TIMEOUT), read without torch;
- `checks.py`: the checks of one step (count and shape, ranks agree, finite, final id), with torch;
- `exchange.py`: the one exchange per checked step between the TP ranks (CPU group, deadline,
  handshake), which a rank whose check raised still joins;
- `window.py`: the steps of one process together: verdict, log line, JSON report, hint;
- `seam.py`: where the runner receives the states, probed per loaded runner class, and the
  wrapper put there for the window only;
- `command.py`: `vllm-hotfix verify MODEL`, which starts vLLM with the check on.
"""
