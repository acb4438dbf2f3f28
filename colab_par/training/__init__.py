"""On the engines: the Trainer and its option values (trainer.py, options.py), what a logged step
measures and where its rows go (step_measures.py, telemetry.py, run_publisher.py, loggers.py),
checkpoints (checkpoint*.py) and the recovery protocol a lost engine triggers (recovery.py);
post-training beside the Trainer (grpo/: the GRPO objective as TRL defines it, group-relative
advantages, rewards from the user's functions)."""
