"""Signals a rank turns into a stop at a step's boundary, so that no rank is left in a collective:
an interrupt (SIGINT, `interrupts`) and a preemption notice (SIGTERM, or Slurm's SIGUSR1, `preempt`)."""
