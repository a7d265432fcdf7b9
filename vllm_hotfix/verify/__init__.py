"""`vllm-hotfix verify`: a pre-flight check of the aux hidden states, in an engine of its own.

Wrong aux states are silent: a draft or a training set built from them is simply worse. The command
starts vLLM with the user's flags, hooks only the model and checks every forward of a workload:

- `command.py`: the command (its plan, its run on own_engine.py, the workload, the output);
- `settings.py`: the switches the command sets for its engine, read without torch;
- `hook.py`: in each engine process, the hooks on the model class the engine builds;
- `taps.py`: what each decoder layer received (module hooks, one custom op);
- `checks.py`, `reference.py`: a forward's record in a rank, and its judgement over the ranks;
- `outcome.py`: the ranks' records combined after the run, one report per rank, and the verdict;
- `inductor_order.py`: torch's fix of a lost write-before-read order, where the taps need it.
"""
