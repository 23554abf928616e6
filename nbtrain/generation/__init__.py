"""Generation on the ranks of a run: `nbtrain.generate`, the batched decoding loop it and GRPO's
rollouts share, and the samples a run takes while it trains.
"""
