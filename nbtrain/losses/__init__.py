"""The losses, each computed from hidden states without the [tokens, vocab] logits where it can:
SFT's cross-entropy, DPO's pair losses, GRPO's clipped policy loss.
"""
