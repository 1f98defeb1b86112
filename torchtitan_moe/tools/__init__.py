"""User tools on top of the trainer, each `python -m torchtitan_moe.tools.NAME`: check_config, plan,
tune_dispatch, bench_train (with train_runs, step_profile, gpu_power), parity (with parity_report)."""
