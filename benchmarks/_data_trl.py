"""The TRL arm of bench_data: `trl.SFTTrainer` for one step, timed from process start to the first step.

    python _data_trl.py CONFIG_JSON    # {"model", "data", "cache_dir", "output_dir", "num_proc"}

The data goes through `datasets.load_dataset("json", ..., cache_dir=...)` and SFTTrainer's own
tokenization (`dataset_num_proc` worker processes, Arrow cache files beside the dataset's): a fresh
cache_dir is TRL cold, the same one again is TRL warm. The end of the first step is a TrainerCallback's
`on_step_end`; the LoRA settings are nbtrain's defaults (r 16, alpha 32, dropout 0.05, all-linear). Prints
one JSON line; peak RSS of this process, and of the largest worker it waited for.
"""

import time

T_SCRIPT = time.time()  # before the imports

import _common  # noqa: E402  (stdlib only: a few ms)

PROC_START = _common.process_start()

import json  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from datasets import load_dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

T_IMPORTED = time.time()
args = json.loads(sys.argv[1])
marks: dict[str, float] = {}


class FirstStep(TrainerCallback):
    def on_step_end(self, *a, **k):  # noqa: ANN002, ANN003
        marks.setdefault("first_step_end", time.time())


ds = load_dataset("json", data_files=args["data"], split="train", cache_dir=args["cache_dir"])
marks["dataset_loaded"] = time.time()
tokenizer = AutoTokenizer.from_pretrained(args["model"])
model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
config = SFTConfig(
    output_dir=args["output_dir"],
    dataset_num_proc=args["num_proc"],
    assistant_only_loss=True,
    max_length=1024,
    max_steps=1,
    per_device_train_batch_size=2,
    report_to=[],
    save_strategy="no",
    learning_rate=2e-4,
    seed=42,
    # TRL's bf16 default needs a GPU; nbtrain trains in fp32 on the CPU too
    use_cpu=not torch.cuda.is_available(),
    bf16=torch.cuda.is_available(),
)
trainer = SFTTrainer(
    model=model,
    args=config,
    train_dataset=ds,
    processing_class=tokenizer,
    peft_config=LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"
    ),
    callbacks=[FirstStep()],
)
marks["trainer_built"] = time.time()
trainer.train()
t_end = time.time()

print(
    json.dumps(
        {
            "rank": 0,
            "world": 1,
            "threads": torch.get_num_threads(),
            "proc_start": PROC_START,
            "script_start": T_SCRIPT,
            "imported": T_IMPORTED,
            **marks,
            "train_end": t_end,
            "rows": len(ds),
            "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "children_maxrss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        }
    ),
    flush=True,
)
