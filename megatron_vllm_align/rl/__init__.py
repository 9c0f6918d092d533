"""On-policy RL (GRPO) with the aligned trainer: rollouts from the in-process vLLM engine, verifiable
rewards, a clipped-ratio step against the engine's logprobs, the new weights pushed into the running
engine, per-step on-policy mismatch figures and a fail-closed guard (:func:`.run.run_grpo`)."""
