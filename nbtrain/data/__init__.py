"""Training data: where rows come from, their formats and chat templates, tokenization with the loss
mask, the token cache every rank reads memory-mapped, batches, preference pairs and prompts. The
data nbtrain ships for demos and tests is in `nbtrain.data.examples`.
"""
