"""Scheduling: which sequences run, in which KV rows, and what each step computes.

scheduler.py keeps the waiting queue and the running sequences (private), admits, drops the
cancelled and the expired, and builds each step's `StepPlan` (step_plan.py): every scheduled
sequence's KV row and its slice of the step's logits, decode rows and prompt chunks alike. The
rows are packed, decode rows first; the plan is the only place anything else reads a row from.
sequence.py is a request's scheduling state; prefix_cache.py reuses prompt prefixes across
requests; prefill_budget.py sizes a step's prompt chunks from measured step times.
"""
