"""What a run reports: MFU and the per-step meter, rank 0's log and run record, TensorBoard and MLflow,
and the time spent waiting in the gradient all-reduce.
"""
