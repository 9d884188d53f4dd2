"""Many processes and the remote tier, from the trainer's side: joining the job, agreed stops and
saves, the step watchdog, and the run's mirror in object storage."""
