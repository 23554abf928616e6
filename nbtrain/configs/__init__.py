"""The settings of a run, checked where they enter: `SFTConfig`, `DPOConfig`, `GRPOConfig`, and the
docs' settings table made from them.
"""
