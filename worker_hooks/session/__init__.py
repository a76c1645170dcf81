"""One rank's session with the controller, engine-neutral: what the SGLang and vLLM
adapters (worker_hooks/engines/) share instead of writing it each, one job per file.

* `rank.py` `RankSession`: the agent, the version served, the plan handlers (a Prepare
  checked, a Commit marked, an Abort dropped and reported), a plan made live, a plan
  stopped half-way; `engine_agent` and `worker_identity`.
* `windows.py` `WindowPipeline`: counts windows closed per placement and copied to the
  host without the serving thread waiting for the device, one close rule (`window_due`);
  `CountWindows` is it over an engine's slot counts.
* `book.py` `PlanBook`: the plans held (staged maps, the committed version).
* `messages.py` `PlanMessages`: a Commit marked, an Abort dropped, counted and reported,
  a refusal reported, alike on every rank: the engine adapters' `RankSession` and the
  hook's plan driver.
* `agreement.py`: blocking agreement on a version or a plan digest, for an engine's one
  decision point (vLLM's policy call, a fault path).
* `staging.py` `GroupStaging`: weights staged beside serving in layer groups within a
  budget, swapped at agreed steps (tickets).

The SGLang adapter and the project's own hook agree without waiting, on
worker_hooks/agree.py's `CommitAgreement`. The hook (worker_hooks/hook.py) is fed through
the same parts: its windows are a `WindowPipeline` over its recorder's counters, closed by
`window_due`; its plan driver (worker_hooks/plans.py) holds its plans in the session's
`PlanBook` and answers Commit and Abort as `PlanMessages` does. What stays the hook's is
its glue: where counts come from (the recorder inside the forward pass), how weights move
(the migration executor behind the transfer fence) and how a map is made live (its
dispatch tables and weight rows).
"""
