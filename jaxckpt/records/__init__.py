"""What a run writes besides checkpoints: the workdir's layout and lock, the loss and event logs,
phases, the run's identity and provenance (what each manifest records), and the loss plot."""
