"""The GRPO recipe: its step, the rollouts that sample and score completions, and the disaggregated
placement (an actor group and a rollout group, and the link between them).
"""
