"""The trainer (trainer.py), its step (step.py), reading a job config (job_config.py) and what a run
loads (checkpoint.py). `python -m torchtitan_moe.train --job.config_file FILE [--section.key value ...]`."""
