"""The round's decisions, one idea a module; flows/round.py orders them around the cached stages.

- plan: which round this is, with which labels, which samples it may select (RoundPlan, PoolData)
- params: the labeled and test sets on disk and the train and evaluate stages' parameters
- stop: the stop rules and the label budget (close_round, stop_reason, budget_left)
- records: what a round's state records of its stages, and summary.md then round.json
- simulate: the simulated annotator that answers a finished round's export
- intake: the labels in from every source, then the round planned on them and its first state (open_round)

Plain functions of the project's files and config sections, unit-tested without a Prefect server. round.json itself
is read and written as a RoundState (pipeline/round_state.py).
"""
