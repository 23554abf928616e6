"""LoRA/SFT fine-tuning that runs on every rank (engine side): `SFTConfig` and `finetune`."""
