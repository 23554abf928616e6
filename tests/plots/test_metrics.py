"""nbtrain.plots.metrics: every numeric metric a run logs gets a chart, grouped by prefix, the kind's
most watched first, units only where true (the charts contract the Lab draws by)."""

from __future__ import annotations

from nbtrain.plots import charts, group, numeric_keys, smoothed, unit

DPO_KEYS = [
    "step",
    "loss",
    "eval_loss",
    "rewards/chosen",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "grad_norm",
    "learning_rate",
    "tokens_per_s",
    "peak_memory_gb",
    "peak_memory_gb_rank1",
    "step_time",
    "epoch",
    "time",
]


def test_groups_follow_the_prefix():
    assert group("rewards/margins") == "rewards" and group("logps/chosen") == "logps"
    assert group("eval_rewards/x") == "eval" and group("eval_loss") == "eval"
    assert group("reward_std") == "reward" and group("peak_memory_gb_rank3") == "memory"
    assert group("step_time") == "timings" and group("gen_s") == "timings"
    assert group("tokens_per_s") == "tokens_per_s" and group("kl") == "kl"


def test_dpo_charts_every_metric_the_overview_first():
    got = charts("dpo", DPO_KEYS)
    assert [c.title for c in got] == [
        "loss",
        "rewards/margins",
        "rewards/accuracies",
        "rewards/chosen",
        "logps/chosen",
        "grad_norm",
        "learning_rate",
        "tokens_per_s",
        "peak memory",
        "step_time",
        "epoch",
    ]
    assert got[0].keys == ("loss", "eval_loss")
    assert got[8].keys == ("peak_memory_gb", "peak_memory_gb_rank1")
    charted = {k for c in got for k in c.keys}
    assert charted == set(DPO_KEYS) - {"step", "time"}


def test_grpo_overview_is_each_reward_function_then_reward_length_kl_loss():
    keys = ["loss", "kl", "reward", "reward_std", "rewards/fmt/mean", "rewards/fmt/std"]
    keys += ["rewards/len/mean", "completions/mean_length", "clip_ratio/low_mean"]
    titles = [c.title for c in charts("grpo", keys)]
    assert titles[:6] == [
        "rewards/fmt/mean",
        "rewards/len/mean",
        "reward",
        "completions/mean_length",
        "kl",
        "loss",
    ]
    assert titles[6:] == ["reward_std", "rewards/fmt/std", "clip_ratio/low_mean"]


def test_units_only_where_true_and_what_is_smoothed():
    assert unit("loss", "sft") == "nats/token" and unit("eval_loss", None) == "nats/token"
    assert unit("loss", "dpo") == "loss" and unit("loss", "grpo") == "loss"
    assert unit("tokens_per_s") == "tokens/s" and unit("peak_memory_gb_rank1") == "GB"
    assert unit("mfu") == "%" and unit("step_time") == "s" and unit("logps/chosen") == "nats"
    assert unit("completions/mean_length") == "tokens" and unit("grad_norm") == "grad_norm"
    assert not smoothed("learning_rate") and not smoothed("peak_memory_gb")
    assert smoothed("loss", 100, 100) and not smoothed("eval_loss", 4, 100)


def test_numeric_keys_skip_text_and_bools():
    rows = [{"step": 1, "loss": 1.0, "note": "x", "flag": True}, {"step": 2, "kl": 0.1}]
    assert numeric_keys(rows) == ["step", "loss", "kl"]
