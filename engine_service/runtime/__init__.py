"""The runtime: what ties the scheduler, the generation controls and the model into a served engine.

build.py assembles an `Engine` whole from an `EngineConfig` (precision, model, runner, scheduler,
prefill budget, decode loop); engine.py is its async face (submit a request, stream its deltas
back, drain, fatal); loop.py is the decode loop's thread and the one place that decides recovery
(drop -> admit -> plan -> forward -> sample -> emit -> retire); model_runner.py runs one step's
plan through the model; speculator.py drafts and verifies prompt-lookup tokens; delta.py is a
step's output on its way to the RPC; build_kernels.py builds the model's C++ kernels ahead of
any start (`make setup`). Rule: only the loop catches, and only a SequenceError.
"""
