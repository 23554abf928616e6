"""Recipes, the top layer of training: one per workload (SFT, DPO, GRPO), each a class with set-up,
train and save, and `finetune`, which picks one by its config. They import every layer below; none
imports them.
"""
