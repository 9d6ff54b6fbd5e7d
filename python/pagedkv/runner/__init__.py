"""The model side of a step: `ModelRunner.execute(plan, StepRequests) -> ModelRunnerOutput`
(model_runner.py, step_messages.py), the step's results from hidden states (results.py, sampler.py),
the persistent batch, CUDA-graph replay, and what the engine knows of the model (`ModelInfo`)."""
